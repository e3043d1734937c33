#!/usr/bin/env bash
# On the GPU (nvidia-h200): SmolLM2-135M-Instruct (the real GGUF) before and after LoRA / QLoRA / full
# (8-bit AdamW) fine-tuning, MINUTES of the loop per tier, scored as on the CPU (benchmarks/finetune/bench_finetune_smollm2.py).
# The GGUF does not fit one call: `bash benchmarks/tools/gguf_parts.sh split` here, then carry .gguf-parts/0, /1, /2 in
# three calls on one warm machine (any GPU script that starts with `gguf_parts.sh stash` keeps its part); this
# script runs once all three are on the machine. Carry also .whl and .data/zh-poetry.
# COMPILE=1 compiles each block as the lora/qlora presets do (without it every tier runs eager).
bash benchmarks/tools/gguf_parts.sh stash
GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $GGUF ] || { echo "no $GGUF yet: nothing run"; exit 0; }
source benchmarks/gpu_env.sh --gpu /tmp/gguf-parts/gguf-*.whl || exit 1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,transformers,peft;print('torch',torch.__version__,'transformers',transformers.__version__,'peft',peft.__version__)"
} > $OUT/env.txt 2>&1
timeout ${LIMIT:-540} python3 benchmarks/finetune/bench_finetune_smollm2.py --gguf $GGUF --zh .data/zh-poetry \
  --minutes ${MINUTES:-2} --train_examples ${EXAMPLES:-4000} --out /tmp/smg ${COMPILE:+--compile} \
  > $OUT/smollm2.log 2>&1
echo "bench exit $?" >> $OUT/smollm2.log
cp /tmp/smg/results.json $OUT/smollm2_results.json 2>/dev/null
grep -E "^(base|lora|qlora|adamw8bit) |bench exit|Error" $OUT/smollm2.log | tail -8
