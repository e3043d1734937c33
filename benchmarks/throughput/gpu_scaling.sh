#!/usr/bin/env bash
# One GPU vs N on a machine with several GPUs (not run yet: no multi-GPU machine was lent). Same effective batch:
# the one-GPU run accumulates N times as many micro-batches. Per recipe: tokens/s (images/s) of each, the scaling
# factor, the first 50 losses side by side and each GPU's peak memory, in $OUT/scaling_*.{json,md}.
#   N=8 OUT=runs/scaling GPT_DATA=../shared/data/zh-poetry FLOW_DATA=../shared/data/cifar10 bash benchmarks/throughput/gpu_scaling.sh
# CPU check of the same logic (2 gloo processes, tiny sizes): CPU=1 N=2 bash benchmarks/throughput/gpu_scaling.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${N:-$(nvidia-smi -L 2>/dev/null | wc -l)}
OUT=${OUT:-runs/scaling}
STEPS=${STEPS:-50}
[ "${N}" -ge 2 ] || { echo "error: gpu_scaling.sh needs N >= 2 GPUs (found ${N}); set N" >&2; exit 2; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
COMMON=(--max_steps "$STEPS" --log_steps 1 --eval_steps 0 --eval_batches 1 --checkpointing_steps 0 --progress false)
if [ "${CPU:-0}" = 1 ]; then
  FLAGS=(--cpu)
  GPT=(--preset tiny --n_layer 2 --n_embd 32 --n_head 2 --seq_len 32 --vocab_size 300 --micro_batch_size 2
       --max_new_tokens 4)
  FLOW=(--preset tiny --base_channels 8 --limit 64 --micro_batch_size 4 --sample_steps 2
        ${FLOW_DATA:+--dataset "$FLOW_DATA"})
else
  FLAGS=()
  # 124M GPT: micro-batch 16 x accumulation 1 per GPU (the one-GPU run: 16 x N), bf16, compiled
  GPT=(--preset 124m --micro_batch_size 16 ${GPT_DATA:+--dataset "$GPT_DATA"} --max_new_tokens 16)
  FLOW=(--preset cifar10 ${FLOW_DATA:+--dataset "$FLOW_DATA"} --sample_every_epochs 0)
fi
python benchmarks/throughput/gpu_scaling.py "${FLAGS[@]}" --recipe gpt --gpus "$N" --config ddp --out "$OUT" -- "${GPT[@]}" "${COMMON[@]}"
# FSDP2 with torch.compile (the blocks compiled in place before fully_shard) is not checked yet: both runs eager
python benchmarks/throughput/gpu_scaling.py "${FLAGS[@]}" --recipe gpt --gpus "$N" --config fsdp2 --out "$OUT" -- "${GPT[@]}" "${COMMON[@]}" --compile false
python benchmarks/throughput/gpu_scaling.py "${FLAGS[@]}" --recipe flow --gpus "$N" --config ddp --out "$OUT" -- "${FLOW[@]}" "${COMMON[@]}"
