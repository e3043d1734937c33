#!/usr/bin/env bash
# On the GPU (nvidia-h200), one call: instruction LoRA of the Pythia-1.4B shape on zh-poetry, TRL SFTTrainer (padded,
# packed) against hf-cgpu (packed, padded), then 16,384 tokens per sequence under a 16 GiB cap with the ledger's peak
# beside it (benchmarks/finetune/bench_sft_vs_trl.py). Carry .whl (datasets from ../shared/tools/device-wheels.sh and
# trl-1.16.0-py3-none-any.whl: `pip download trl==1.16.0 --no-deps -d .whl`) and .data/zh-poetry (a copy of
# ../shared/data/zh-poetry). ROWS=a,b picks the rows (in that order), FIRST=a,b moves rows to the front, e.g.
# FIRST=ours_padded,long16k,ours_packed_recompute. Writes OUT/sft_vs_trl.md (the table), .jsonl, data.json, rows.log, bench.log, env.txt.
source benchmarks/gpu_env.sh --gpu || exit 1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,transformers,peft,trl;print('torch',torch.__version__,'transformers',transformers.__version__,'peft',peft.__version__,'trl',trl.__version__)"
} > $OUT/env.txt 2>&1
timeout ${LIMIT:-540} python3 benchmarks/finetune/bench_sft_vs_trl.py --zh .data/zh-poetry --out $OUT \
  --deadline ${DEADLINE:-480} ${EXAMPLES:+--examples $EXAMPLES} ${ROWS:+--rows $ROWS} ${FIRST:+--first $FIRST} > $OUT/bench.log 2>&1
echo "bench exit $?" >> $OUT/bench.log
tail -15 $OUT/bench.log
