#!/usr/bin/env bash
# GPU call (device tool, nvidia-h200): `recipes/train_gpt.py --preset zh-poetry-modern` (rotary, qk_norm, relu2,
# Muon) for its 7-minute budget, then `hf-cgpu eval` of the saved (best-by-validation) model over the whole validation
# split: compare val_bpc with benchmarks/quality/gpu_zh_poetry.sh (the plain preset). Extra arguments go to the recipe,
# and so do the flags in EXTRA (for an A/B call: EXTRA="--document_masking true"; hf-cgpu eval reads it from config.json).
# Carried: .whl (../shared/tools/device-wheels.sh) and .data/zh-poetry (a copy of ../shared/data/zh-poetry).
# Wall time: the loop stops at 7 minutes (max_minutes, from its first step); tokenizer, packing, a cold compile (up to
# ~80 s), the final save and the continuations come on top, so the recipe is capped at 545 s and the eval gets what is
# left of 590 s (the loop's own val_bpc is over the same whole split; the eval re-checks it from the saved files).
bash benchmarks/tools/gguf_parts.sh stash  # a carried part of the SmolLM2 GGUF waits in /tmp (gpu_finetune_smollm2.sh)
source benchmarks/gpu_env.sh --gpu || exit 1
export TOKENIZERS_PARALLELISM=true
PRESET=${PRESET:-zh-poetry-modern}
rm -rf /tmp/zhm  # a warm machine keeps /tmp: every call trains from scratch
{ date -u; echo "EXTRA=$EXTRA $*"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,transformers,accelerate,datasets;print('torch',torch.__version__,'transformers',transformers.__version__,'accelerate',accelerate.__version__,'datasets',datasets.__version__)"
  timeout 15 python3 -m hf_cgpu.cli bench; } > $OUT/env.txt 2>&1
timeout 545 python3 recipes/train_gpt.py --preset $PRESET --dataset .data/zh-poetry --output_dir /tmp/zhm \
  --progress false $EXTRA "$@" > $OUT/train.log 2>&1
echo "train exit $?" >> $OUT/train.log
# KEEP=DIR: the saved run copied there, for a later call on the same warm machine (/tmp stays): e.g. a 7-minute
# teacher, then EXTRA="--teacher DIR --distill_weight 0.5" distils it into a student in the next call's 7 minutes
[ -n "${KEEP:-}" ] && rm -rf "$KEEP" && cp -r /tmp/zhm "$KEEP"
cp /tmp/zhm/all_results.json /tmp/zhm/history.json /tmp/zhm/training_curves.png /tmp/zhm/config.json $OUT/ 2>/dev/null
timeout $(( SECONDS < 570 ? 590 - SECONDS : 20 )) python3 -m hf_cgpu.cli eval /tmp/zhm --dataset .data/zh-poetry --seq_len 512 --output_json $OUT/eval.json \
  > $OUT/eval.log 2>&1
tail -5 $OUT/eval.log
grep -E "plan|warning|best|early|val_bpc|load_best|train exit" $OUT/train.log | tail -40
