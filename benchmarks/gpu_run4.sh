#!/usr/bin/env bash
# GPU call 4 (device tool, nvidia-h200): the Pythia rows of the memory benchmark again (checkpoint created before
# measuring), and a short train_gpt 124M run through the loop with whole-model compile + full logits.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export HF_CGPU_CACHE=/tmp/hfc PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
timeout 120 python3 benchmarks/bench_memory.py --only pythia --json $OUT/memory_pythia.json > $OUT/memory_pythia.log 2>&1
timeout 170 python3 recipes/train_gpt.py --preset 124m --dataset .data/zh-poetry --output_dir /tmp/gpt124m \
  --max_steps 700 --warmup_steps 100 --eval_steps 0 --checkpointing_steps 0 --max_minutes 1.0 \
  --tokenizer_train_docs 20000 --prompts "床前明月光" --max_new_tokens 32 --progress false > $OUT/gpt124m_whole.log 2>&1
