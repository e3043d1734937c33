#!/usr/bin/env bash
# The longest row that fits a 16 GiB cap for the Pythia-1.4B shape: LoRA with full recompute, LoRA with
# --recompute_policy offload, QLoRA with offload, doubling from 8,192 tokens, the ledger beside each row
# (benchmarks/finetune/gpu_long_context.py). One device call: carry .whl (bitsandbytes for QLoRA, from
# ../shared/tools/device-wheels.sh); DEADLINE (default 240 s) bounds every row together, ROW_LIMIT one row.
#
# GPU:  OUT=/tmp/long bash benchmarks/finetune/gpu_long_context.sh          (DEADLINE=240: ~5 minutes with the base)
# CPU:  SMOKE=1 OUT=/tmp/long bash benchmarks/finetune/gpu_long_context.sh  (tiny GPTNeoX: checks the chain)
# Writes OUT/long_context.md (the table), OUT/long_context.json, OUT/rows.log, OUT/bench.log, OUT/env.txt.
set -u
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then source benchmarks/gpu_env.sh --cpu; else source benchmarks/gpu_env.sh --gpu || exit 1; fi
OUT=${OUT:-/tmp/long_context}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch,transformers,peft;print('torch',torch.__version__,'transformers',transformers.__version__,'peft',peft.__version__)"
} > "$OUT/env.txt" 2>&1
ARGS=(--out "$OUT" --deadline "${DEADLINE:-240}" --row_limit "${ROW_LIMIT:-120}" --steps "${STEPS:-2}")
[ "$SMOKE" = 1 ] && ARGS+=(--smoke --base "${BASE:-/tmp/long_context_base_smoke}") || ARGS+=(--base "${BASE:-/tmp/long_context_base}")
[ -n "${SEQS:-}" ] && ARGS+=(--seqs "$SEQS")
[ -n "${CONFIGS:-}" ] && ARGS+=(--configs "$CONFIGS")
timeout $(( ${DEADLINE:-240} + 60 )) python3 benchmarks/finetune/gpu_long_context.py "${ARGS[@]}" > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"
tail -25 "$OUT/bench.log"
