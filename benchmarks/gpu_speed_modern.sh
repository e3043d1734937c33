#!/usr/bin/env bash
# One device call (nvidia-h200) for issue 12, carried: .whl. In order of what matters most, each part bounded:
#   1. benchmarks/bench_gpt_modern_speed.py: the zh-poetry step, plain vs each modern option, AdamW vs Muon
#      (torch's per-matrix step vs our shape-batched step)                                         (<= 220 s)
#   2. benchmarks/gpu_speed.sh lora: LoRA recompute off/full/selective on the Pythia-1.4B shape        (<= 170 s)
#   3. benchmarks/gpu_speed.sh gpt-profile: torch.profiler of the 124M step at micro-batch 16          (<= 120 s)
# Results: $OUT/speed_modern.tgz (and the logs' tails on stdout).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export HF_CGPU_CACHE=/tmp/hfc PYTHONUNBUFFERED=1
R=/tmp/speed_modern; mkdir -p $R
timeout 220 python3 benchmarks/bench_gpt_modern_speed.py --json $R/modern_speed.json > $R/modern_speed.log 2>&1
tail -12 $R/modern_speed.log
OUT=$R timeout 170 bash benchmarks/gpu_speed.sh lora > $R/lora.log 2>&1
tail -15 $R/lora.log
OUT=$R timeout 120 bash benchmarks/gpu_speed.sh gpt-profile > $R/profile.log 2>&1
grep -E "ms/step|share of wall" $R/profile.log
tar czf $OUT/speed_modern.tgz --exclude=trace.json -C /tmp speed_modern
