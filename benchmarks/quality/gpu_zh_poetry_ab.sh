#!/usr/bin/env bash
# Two short `--preset zh-poetry-modern` runs in one device call (nvidia-h200), to rank a change before spending a
# full 7-minute call on it (issue 8: "tune on short runs, keep the full-budget runs for the record"):
#
#   A="" B="--gradient_accumulation_steps 2 --warmup_steps 400" bash benchmarks/quality/gpu_zh_poetry_ab.sh
#
# Each run trains MINUTES (default 2.5) with its cosine fitted to them, then the loop's whole-split validation;
# both start on a warm inductor cache (a 3-step run of each configuration first). Results: $OUT/ab.json (per run: val_bpc, best step,
# steps, tok/s, train loss) and $OUT/ab.tgz (all_results, history, curves of both). Carried: .whl, .data/zh-poetry.
# Wall time: two warm-ups of ~40-80 s (compile), then per run ~30 s of start-up + MINUTES + ~15 s: ~9 minutes at 2.5.
bash benchmarks/tools/gguf_parts.sh stash  # a carried part of the SmolLM2 GGUF waits in /tmp (gpu_finetune_smollm2.sh)
if [ -z "${SMOKE:-}" ]; then
  source benchmarks/gpu_env.sh --gpu || exit 1
else  # CPU check of the script: SMOKE=1 PRESET=tiny DATA= MINUTES=0.2 (the embedded corpus, no GPU)
  source benchmarks/gpu_env.sh --cpu
fi
export TOKENIZERS_PARALLELISM=true
OUT=${OUT:-/tmp/ab_out}; mkdir -p "$OUT" /tmp/ab
MINUTES=${MINUTES:-2.5} PRESET=${PRESET:-zh-poetry-modern} DATA=${DATA-.data/zh-poetry}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,transformers;print('torch',torch.__version__,'transformers',transformers.__version__)"
  echo "MINUTES=$MINUTES A=${A:-} B=${B:-}"; } > $OUT/env.txt 2>&1
# compile time counts in --max_minutes, so each configuration first fills the inductor cache with a 3-step run:
# both timed runs then start warm (a different dropout, say, is a different graph)
for name in A B; do
  rm -rf /tmp/ab/warm_$name
  # shellcheck disable=SC2086
  timeout 200 python3 recipes/train_gpt.py --preset "$PRESET" ${DATA:+--dataset $DATA} --output_dir /tmp/ab/warm_$name \
    --max_steps 3 --max_minutes 0 --fit_schedule_to_time false --eval_steps 0 --load_best_at_end false \
    --checkpointing_steps 0 --progress false ${!name:-} > /tmp/ab/warm_$name.log 2>&1 || echo "warm-up $name failed: see warm_$name.log"
done
for name in A B; do
  rm -rf /tmp/ab/$name
  # shellcheck disable=SC2086  # the arguments of A and B are split on purpose
  timeout "$(python3 -c "print(int($MINUTES * 60 + 120))")" python3 recipes/train_gpt.py --preset "$PRESET" \
    ${DATA:+--dataset $DATA} --output_dir /tmp/ab/$name --max_minutes "$MINUTES" --progress false ${!name:-} \
    > /tmp/ab/$name.log 2>&1
  echo "$name exit $?" >> /tmp/ab/$name.log
done
python3 - "$OUT" <<'PY'
import json, os, sys
from pathlib import Path
out, rows = Path(sys.argv[1]), {}
for name in "AB":
    try:
        r = json.loads(Path(f"/tmp/ab/{name}/all_results.json").read_text())
    except (OSError, ValueError) as err:
        rows[name] = {"args": os.environ.get(name, ""), "error": str(err)}
        continue
    rows[name] = {"args": os.environ.get(name, ""), **{k: r.get(k) for k in (
        "val_bpc", "best_step", "steps", "train_loss", "tok_per_s", "seconds_to_first_step", "train_seconds")}}
(out / "ab.json").write_text(json.dumps(rows, indent=1))
print(json.dumps(rows, indent=1))
PY
tar -czf $OUT/ab.tgz -C /tmp/ab A.log B.log A/all_results.json A/history.json A/training_curves.png \
  B/all_results.json B/history.json B/training_curves.png 2>/dev/null
grep -hE "schedule fitted|^[AB] exit" /tmp/ab/A.log /tmp/ab/B.log
