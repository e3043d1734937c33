#!/usr/bin/env bash
# GPU call (device tool, nvidia-h200): the seed chapter's text recipe (benchmarks/quality/bench_seed_text.py) on zh-poetry
# for 7 minutes, right after gpu_zh_poetry.sh on the same warm machine.
source benchmarks/gpu_env.sh --gpu || exit 1
export TOKENIZERS_PARALLELISM=true
date -u > $OUT/env.txt
timeout 570 python3 benchmarks/quality/bench_seed_text.py --data .data/zh-poetry --minutes 7 --out /tmp/seed_text \
  "$@" > $OUT/seed_text.log 2>&1
cp /tmp/seed_text/results.json $OUT/seed_text_results.json
grep -E "chars/token|step time|val_bpc" $OUT/seed_text.log | tail -30
