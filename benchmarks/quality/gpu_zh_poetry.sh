#!/usr/bin/env bash
# GPU call (device tool, nvidia-h200): `recipes/train_gpt.py --preset zh-poetry` for its 7-minute budget, then
# `hf-cgpu eval` of the saved model over the whole validation split. Extra arguments go to the recipe.
# Carried: .whl (../shared/tools/device-wheels.sh) and .data/zh-poetry (a copy of ../shared/data/zh-poetry).
source benchmarks/gpu_env.sh --gpu || exit 1
export TOKENIZERS_PARALLELISM=true
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,transformers,accelerate,datasets;print('torch',torch.__version__,'transformers',transformers.__version__,'accelerate',accelerate.__version__,'datasets',datasets.__version__)"
  timeout 30 python3 -m hf_cgpu.cli bench; } > $OUT/env.txt 2>&1
timeout 540 python3 recipes/train_gpt.py --preset zh-poetry --dataset .data/zh-poetry --output_dir /tmp/zh \
  --progress false "$@" > $OUT/train.log 2>&1
cp /tmp/zh/all_results.json /tmp/zh/history.json /tmp/zh/training_curves.png $OUT/ 2>/dev/null
timeout 60 python3 -m hf_cgpu.cli eval /tmp/zh --dataset .data/zh-poetry --seq_len 512 --output_json $OUT/eval.json \
  > $OUT/eval.log 2>&1
tail -5 $OUT/eval.log
grep -E "plan|warning|best|early|val_bpc|load_best" $OUT/train.log | tail -40
