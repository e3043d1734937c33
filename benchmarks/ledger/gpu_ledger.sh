#!/usr/bin/env bash
# GPU: the ledger check (issue "Know in advance"): `hf-cgpu bench`, the random LoRA bases, then one configuration set
# under a 16 GiB cap, each in a fresh process; everything lands in $OUT (bench.json, ledger_<SET>.json, the log).
#
#   device run, carry [".whl", ".data"]:  SET=A bash benchmarks/ledger/gpu_ledger.sh
#   then here:  python benchmarks/ledger/compare.py <files_at>/ledger_A.json --bench <files_at>/bench.json
set -uo pipefail
source benchmarks/gpu_env.sh --gpu || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SET=${SET:-A}
export HF_CGPU_CACHE=/tmp/hfc TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, diffusers, peft; print(torch.__version__, transformers.__version__, diffusers.__version__, peft.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m hf_cgpu.cli bench --output "$OUT/bench.json" 2>&1 | tail -12
cp "$OUT/bench.json" /tmp/hfc/bench.json 2>/dev/null || { mkdir -p /tmp/hfc && cp "$OUT/bench.json" /tmp/hfc/bench.json; }
python3 benchmarks/ledger/make_bases.py --out /tmp/ledger_bases 2>&1 | grep -v Writing
python3 benchmarks/ledger/run_all.py --set "$SET" --out "$OUT/ledger_$SET.json" --timeout "${TIMEOUT:-200}" ${ONLY:+--only $ONLY} 2>&1 \
  | grep -v '^==' | tee "$OUT/ledger_$SET.log"
