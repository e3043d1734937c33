#!/usr/bin/env bash
# GPU call 1 (device tool, nvidia-h200): bench, ~5 min GPT-124M on zh-poetry, ~3.5 min flow matching on CIFAR-10.
# Carried: .whl (wheels the GPU image lacks, from ../shared/tools/device-wheels.sh) and .data (zh-poetry, cifar10).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export HF_CGPU_CACHE=/tmp/hfc PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,transformers,diffusers,peft,accelerate,datasets,bitsandbytes as b;print('torch',torch.__version__,'transformers',transformers.__version__,'diffusers',diffusers.__version__,'peft',peft.__version__,'accelerate',accelerate.__version__,'datasets',datasets.__version__,'bitsandbytes',b.__version__)"
  timeout 90 python3 -m hf_cgpu.cli bench; } > $OUT/env_bench.txt 2>&1
timeout 420 python3 recipes/train_gpt.py --preset 124m --dataset .data/zh-poetry --output_dir /tmp/gpt124m \
  --max_steps 700 --warmup_steps 100 --eval_steps 200 --checkpointing_steps 350 --max_minutes 4.5 \
  --prompts "床前明月光|春眠不覺曉|白日依山盡" --max_new_tokens 48 --progress false > $OUT/gpt124m.log 2>&1
cp /tmp/gpt124m/all_results.json $OUT/gpt124m_results.json
timeout 300 python3 recipes/train_flow.py --preset cifar10 --dataset .data/cifar10 --output_dir /tmp/flow \
  --max_steps 9000 --max_minutes 3.5 --sample_every_epochs 15 --progress false > $OUT/flow.log 2>&1
cp /tmp/flow/all_results.json $OUT/flow_results.json
cp "$(ls /tmp/flow/samples/*.png | tail -1)" $OUT/flow_grid_final.png
cp "$(ls /tmp/flow/samples/*.png | head -1)" $OUT/flow_grid_first.png
ls -la /tmp/gpt124m /tmp/flow >> $OUT/env_bench.txt 2>&1
