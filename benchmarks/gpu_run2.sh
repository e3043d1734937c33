#!/usr/bin/env bash
# GPU call 2 (device tool, nvidia-h200): GPT-124M throughput vs transformers GPT2LMHeadModel, then the memory
# benchmark (ledger vs measured, our LoRA/QLoRA tiers vs stock peft) on the Pythia-1.4B shape.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export HF_CGPU_CACHE=/tmp/hfc PYTHONUNBUFFERED=1
timeout 240 python3 benchmarks/bench_gpt_throughput.py --json $OUT/throughput.json > $OUT/throughput.log 2>&1
timeout 330 python3 benchmarks/bench_memory.py --json $OUT/memory.json > $OUT/memory.log 2>&1
