#!/usr/bin/env bash
# GPU call 3 (device tool, nvidia-h200): GPT-124M compile-scope variants vs the GPT2 peer; flow run with EMA warm-up.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export HF_CGPU_CACHE=/tmp/hfc PYTHONUNBUFFERED=1
timeout 60 python3 -m hf_cgpu.cli bench > $OUT/bench.txt 2>&1
timeout 270 python3 benchmarks/bench_gpt_throughput.py --json $OUT/throughput.json \
  --variants hf_cgpu-blocks,hf_cgpu-whole,hf_cgpu-whole-fulllogits,transformers_gpt2 > $OUT/throughput.log 2>&1
timeout 230 python3 recipes/train_flow.py --preset cifar10 --dataset .data/cifar10 --output_dir /tmp/flow \
  --max_steps 9000 --max_minutes 2.6 --sample_every_epochs 15 --progress false > $OUT/flow.log 2>&1
cp /tmp/flow/all_results.json $OUT/flow_results.json
cp "$(ls /tmp/flow/samples/*.png | tail -1)" $OUT/flow_grid_final.png
