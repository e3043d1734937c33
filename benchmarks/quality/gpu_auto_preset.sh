#!/usr/bin/env bash
# GPU call (device tool, nvidia-h200): `--preset auto` against `--preset zh-poetry-modern` on corpora of a tenth, a
# third and all of zh-poetry's training split (validation unchanged; benchmarks/quality/auto_corpora.py), at 2 and 7
# minutes. Each cell trains from scratch, then `hf-cgpu eval` scores the saved (best-by-validation) model on the whole
# validation split; a row of $OUT/auto_table.md (and $OUT/auto_cells.jsonl) is written as each cell ends: the chosen
# settings (shape, dropout, weight decay, warm-up, schedule), steps, epochs and validation bits/char.
#
#   ROWS="tenth-2-auto tenth-2-modern" bash benchmarks/quality/gpu_auto_preset.sh     one call: 1-2 cells
#   SMOKE=1 bash benchmarks/quality/gpu_auto_preset.sh                                CPU check: every cell, tiny
#
# Cells are CORPUS-MINUTES-PRESET with CORPUS in tenth, third, all; MINUTES in 2, 7; PRESET auto or modern. One call
# holds about 9 minutes: three 2-minute cells (a cell takes its minutes, the compile included, + ~55 s of tokenizer,
# saves and eval), or one 7-minute cell (the tokenizer, the final save and the eval come on top of
# the minutes). A cell that would end after DEADLINE (570 s from the start) is skipped and listed, to run in a later
# call. Extra arguments go to every training run. Carried: .whl (../shared/tools/device-wheels.sh) and .data/zh-poetry
# (a copy of ../shared/data/zh-poetry).
set -u
SMOKE=${SMOKE:-0}
DEADLINE=${DEADLINE:-570}
OUT=${OUT:-/tmp/auto-out}
mkdir -p "$OUT"
if [ "$SMOKE" = 1 ]; then
  source benchmarks/gpu_env.sh --cpu
  SRC=${SRC:-../shared/data/zh-poetry}
  ROWS=${ROWS:-tenth-2-auto tenth-2-modern all-7-auto}
  # minutes shrunk so that the CPU check takes seconds a cell: 2 -> 0.05, 7 -> 0.1, and a tiny model
  TINY="--seq_len 64 --vocab_size 512 --micro_batch_size 4 --gradient_accumulation_steps 1 --compile false
        --eval_steps 5 --eval_batches 2 --checkpointing_steps 0 --max_new_tokens 4 --tokenizer_train_docs 500
        --max_steps 10 --peak_tflops 1"
  CORPUS_ARGS="--limit 3000 --val_limit 100"
  EVAL_ARGS="--seq_len 64 --max_windows 8 --device cpu"
else
  bash benchmarks/tools/gguf_parts.sh stash  # a carried part of the SmolLM2 GGUF waits in /tmp
  source benchmarks/gpu_env.sh --gpu || exit 1
  SRC=${SRC:-.data/zh-poetry}
  ROWS=${ROWS:-tenth-2-auto tenth-2-modern}
  TINY=""
  CORPUS_ARGS=""
  EVAL_ARGS="--seq_len 512"
fi
export TOKENIZERS_PARALLELISM=true
CORPORA=/tmp/auto-corpora
{ date -u; echo "ROWS=$ROWS SMOKE=$SMOKE $*"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch,transformers,accelerate;print('torch',torch.__version__,'transformers',transformers.__version__,'accelerate',accelerate.__version__)"
  [ "$SMOKE" = 1 ] || timeout 15 python3 -m hf_cgpu.cli bench
  python3 benchmarks/quality/auto_corpora.py --src "$SRC" --out $CORPORA $CORPUS_ARGS; } >> "$OUT/env.txt" 2>&1
minutes_of() { if [ "$SMOKE" = 1 ]; then [ "$1" = 2 ] && echo 0.05 || echo 0.1; else echo "$1"; fi; }
preset_of() { [ "$1" = modern ] && echo zh-poetry-modern || echo auto; }
skipped=""
for cell in $ROWS; do
  IFS=- read -r corpus minutes which <<< "$cell"
  case "$corpus/$minutes/$which" in
    tenth/2/auto|tenth/2/modern|tenth/7/auto|tenth/7/modern|third/2/auto|third/2/modern|third/7/auto|third/7/modern|\
all/2/auto|all/2/modern|all/7/auto|all/7/modern) ;;
    *) echo "unknown cell $cell: CORPUS-MINUTES-PRESET, CORPUS tenth|third|all, MINUTES 2|7, PRESET auto|modern" >&2
       exit 2 ;;
  esac
  m=$(minutes_of "$minutes")
  need=$(python3 -c "print(int($m * 60 + (20 if $SMOKE else 60)))")  # the minutes + tokenizer, saves and the eval
  if [ $((SECONDS + need)) -gt "$DEADLINE" ]; then skipped="$skipped $cell"; continue; fi
  run=/tmp/auto-runs/$cell
  rm -rf "$run"
  # every cell compiles cold, as a first run does and as the rule prices it: a cached graph of an earlier cell's
  # shape would hand that cell its compile seconds back (WARM=1 keeps the cache)
  [ "${WARM:-0}" = 1 ] || rm -rf "$HF_CGPU_CACHE/inductor" "$HF_CGPU_CACHE/triton"
  echo "=== $cell: --preset $(preset_of "$which") --max_minutes $m ($(date -u +%T))" >> "$OUT/train.log"
  timeout $((DEADLINE + 30 - SECONDS)) python3 -m hf_cgpu.cli train gpt --preset "$(preset_of "$which")" \
    --dataset $CORPORA/$corpus --max_minutes "$m" --output_dir "$run" --progress false $TINY "$@" \
    > /tmp/auto-cell.log 2>&1
  echo "train exit $?" >> /tmp/auto-cell.log
  tr '\r' '\n' < /tmp/auto-cell.log | grep -E '^auto:|^GPT|^plan|^warning|^schedule|eval/val_bpc|reached|train exit|error' \
    >> "$OUT/train.log"
  echo "=== $cell" >> "$OUT/eval.log"
  timeout $((DEADLINE + 50 - SECONDS > 20 ? DEADLINE + 50 - SECONDS : 20)) python3 -m hf_cgpu.cli eval "$run" \
    --dataset $CORPORA/$corpus $EVAL_ARGS --output_json /tmp/auto-eval.json >> "$OUT/eval.log" 2>&1 \
    || rm -f /tmp/auto-eval.json
  python3 benchmarks/quality/auto_table.py "$cell" "$run" /tmp/auto-cell.log /tmp/auto-eval.json \
    "$OUT/auto_table.md" "$OUT/auto_cells.jsonl"
  rm -f /tmp/auto-eval.json
done
[ -z "$skipped" ] || echo "skipped (past DEADLINE=$DEADLINE s; run them in another call): ROWS=\"${skipped# }\"" \
  | tee -a "$OUT/train.log"
cat "$OUT/auto_table.md" 2>/dev/null
