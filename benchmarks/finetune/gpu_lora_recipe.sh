#!/usr/bin/env bash
# `recipes/finetune_lora.py --preset lora` end to end (evaluation, checkpoints, accumulation 8 included) on the
# Pythia-1.4B shape (random weights, saved once by bench_lora_speed.py's checkpoint_dir), once per compile mode
# (MODES, default "default reduce-overhead"): steady tok/s (median of the logged windows after step WARM), the
# loss at the end, peak memory, recompiles. Whether CUDA graphs (reduce-overhead) hold up in the real loop with
# gradient accumulation, evaluation and checkpointing, and what they give there.
#
# GPU:  OUT=/tmp/lora_recipe bash benchmarks/finetune/gpu_lora_recipe.sh          (carry .whl; ~3 minutes)
# CPU:  bash benchmarks/finetune/gpu_lora_recipe.sh --smoke                       (tiny GPTNeoX, eager: checks the script)
set -u
SMOKE=0; [ "${1:-}" = "--smoke" ] && SMOKE=1
if [ $SMOKE = 0 ]; then source benchmarks/gpu_env.sh --auto || exit 1; else source benchmarks/gpu_env.sh --cpu; fi
OUT=${OUT:-/tmp/lora_recipe}; mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false
ROOT=${ROOT:-/tmp/hf_cgpu_bench}
STEPS=${STEPS:-40}; WARM=${WARM:-10}; LOG=${LOG:-5}
if [ $SMOKE = 1 ]; then
  STEPS=4; WARM=0; LOG=2
  EXTRA=(--seq_len 32 --micro_batch_size 2 --gradient_accumulation_steps 2 --lora_r 4)
  MODES_=${MODES:-default}
else
  EXTRA=(); MODES_=${MODES:-default reduce-overhead}
fi
CKPT=$(cd benchmarks/throughput && python3 -c "
from pathlib import Path; from bench_lora_speed import checkpoint_dir
print(checkpoint_dir(Path('$ROOT'), 'pythia-1.4b', $([ $SMOKE = 1 ] && echo True || echo False)))" | tail -1) || exit 1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  python3 -c "import torch,transformers,peft;print('torch',torch.__version__,'transformers',transformers.__version__,'peft',peft.__version__)"
  echo "checkpoint $CKPT, $STEPS steps, log every $LOG, steady after step $WARM, modes: $MODES_"
} > "$OUT/env.txt" 2>&1
for M in $MODES_; do
  rm -rf "/tmp/lora_recipe_$M"
  COMPILE=(--compile_mode "$M"); [ $SMOKE = 1 ] && COMPILE=(--compile false)
  timeout ${LIMIT:-240} python3 recipes/finetune_lora.py --preset lora --model "$CKPT" --dataset builtin \
    --max_steps "$STEPS" --warmup_steps 5 --log_steps "$LOG" --eval_steps $((STEPS / 2)) --eval_batches 4 \
    --checkpointing_steps $((STEPS / 2)) --progress false --output_dir "/tmp/lora_recipe_$M" "${COMPILE[@]}" \
    "${EXTRA[@]}" > "$OUT/lora_$M.log" 2>&1 || echo "run $M failed: see lora_$M.log"
  cp "/tmp/lora_recipe_$M/all_results.json" "$OUT/lora_${M}_results.json" 2>/dev/null
  cp "/tmp/lora_recipe_$M/history.json" "$OUT/lora_${M}_history.json" 2>/dev/null
done
MODES_="$MODES_" WARM=$WARM python3 - "$OUT" <<'EOF'
import json, os, statistics, sys
from pathlib import Path
out, warm = Path(sys.argv[1]), int(os.environ["WARM"])
md = ["| compile mode | tok/s steady (median of windows) | val loss at the end | peak alloc / reserved GiB | recompiles |",
      "|---|---|---|---|---|"]
for m in os.environ["MODES_"].split():
    try:
        res = json.loads((out / f"lora_{m}_results.json").read_text())
        hist = json.loads((out / f"lora_{m}_history.json").read_text())
    except (OSError, ValueError):
        md.append(f"| {m} | failed: see lora_{m}.log | | | |")
        continue
    rate = [v for h in hist if h["step"] > warm for k, v in h.items() if k.startswith("train/") and k.endswith("_per_s")]
    mem = [(h.get("train/peak_alloc_gib"), h.get("train/peak_reserved_gib")) for h in hist if "train/peak_alloc_gib" in h]
    peak = f"{max(a for a, _ in mem):.2f} / {max(r for _, r in mem):.2f}" if mem else "-"
    md.append(f"| {m} | {statistics.median(rate):,.0f} ({len(rate)} windows) | {res.get('val_loss', float('nan')):.4f} | "
              f"{peak} | {res.get('recompiles')} |" if rate else f"| {m} | no windows after step {warm} | | | |")
(out / "summary.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
EOF
