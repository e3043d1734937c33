#!/usr/bin/env bash
# ONE GPU call (device tool, one GPU, at most ~9.5 minutes) for guidance as the one-step student's input (`hf-cgpu
# train flow-distill --guidance_range`): one student that samples at w = 1 for the data's variety or higher for
# precision, each at one network evaluation a step. Carried: .whl (../shared/tools/device-wheels.sh) and .data/cifar10
# (a copy of ../shared/data/cifar10).
#
#   bash benchmarks/quality/gpu_fewstep_guided.sh
#
# In order, each phase bounded by DEADLINE_S (default 560 s from the start): the judge classifier (CLF_MINUTES,
# default 1; skipped where /tmp/clf is left from an earlier call on the warm machine), the flow base (--preset
# cifar10, FLOW_MINUTES, default 2.5), its distillation with --guidance_range GUIDANCE_RANGE (default 1:3; the preset's
# teacher guidance 2 in t 0.25:0.8; DISTILL_MINUTES, default 2.5, cut to leave TABLE_S = 90 s for the table; more
# flags in DISTILL_ARGS, e.g. "--compile false"; --judge reports the rarest class at the saved default w = 2), then
# the table (fewstep_table.py --guided): the student at 1 and 2 evaluations x w = GUIDED_SCALES (default
# 1,1.5,2,2.5), FD / precision / recall against the first 10,000 training images in the judge's features and the
# rarest class share, NUM_IMAGES (default 5000) each, then the base at 10 evaluations while time is left. The seed recipe's row (the anchor) comes from SEED_EVAL (default
# /tmp/fewstep/seed_eval.json, left by gpu_fewstep.sh PART=1 on the warm machine) where it exists; else, where ANCHOR=1
# and the deadline leaves FLOW_MINUTES + 2 minutes after the table, the seed recipe is trained and scored here (Euler
# 50, 10,000 images) and the table rewritten with its row.
#
# SMOKE=1: the same chain on the CPU at toy sizes (tiny classifier, tiny flow runs, a few images a row, the seed's
# stand-in always), in a temporary folder:
#   SMOKE=1 OUT=/tmp/out bash benchmarks/quality/gpu_fewstep_guided.sh
#
# Writes under $OUT (at most 8 files): timeline.txt (with the environment), run.log (every command's output and exit
# status; each run ends with its all_results), fewstep.md (the table), fewstep.json (its rows), grids.tar (one
# picture grid per row, one row per class), seed_eval.json (where the anchor was scored here).
FLOW_MINUTES=${FLOW_MINUTES:-2.5} DISTILL_MINUTES=${DISTILL_MINUTES:-2.5}  # this call's defaults, before the shared ones
source benchmarks/quality/fewstep_common.sh
CLF_MINUTES=${CLF_MINUTES:-1}
TABLE_S=${TABLE_S:-90}
RANGE=(--guidance_range "${GUIDANCE_RANGE:-1:3}")
SEED_EVAL=${SEED_EVAL:-/tmp/fewstep/seed_eval.json}
[ -z "${SMOKE:-}" ] && CLF=(--preset cifar10 --max_minutes "$CLF_MINUTES")
OURS=(--preset cifar10 --max_minutes "$MIN")
DISTILL=(--preset cifar10 --judge $R/clf --judge_images 1000 ${DISTILL_ARGS:-})
TABLE=(--num_images "${NUM_IMAGES:-5000}" --guided_evaluations 1,2 --guided_scales "${GUIDED_SCALES:-1,1.5,2,2.5}"
       --evaluations 10 --ag_scales "" --row_seconds 25)
if [ -n "${SMOKE:-}" ]; then  # CPU: the same chain at toy sizes (fewstep_common.sh: the classifier, the seed, R)
  OURS=(--preset tiny --max_steps 6 --checkpointing_steps 0 --limit 256)
  DISTILL=(--preset tiny --limit 64 --max_steps 6 --judge $R/clf --judge_images 20)
  TABLE=(--num_images 40 --batch_size 20 --guided_evaluations 1,2 --guided_scales "${GUIDED_SCALES:-1,1.5,2,2.5}"
         --evaluations 2 --ag_scales "")
  SEED_EVAL=$R/fewstep/seed_eval.json ANCHOR=1 TABLE_S=30
fi
W=$R/fewstep_guided
mkdir -p "$W" "$OUT"

describe_env "$OUT/timeline.txt"
mark "decoded"
run_log() {  # run_log COMMAND...: the command's output and exit status appended to run.log
  echo "== $(date -u +%T) $*" >> "$OUT/run.log"; "$@" >> "$OUT/run.log" 2>&1; echo "== rc $?" >> "$OUT/run.log"
}
table() {
  local seed=()
  [ -f "$SEED_EVAL" ] && seed=(--seed_eval "$SEED_EVAL")
  run_log timeout "$(left)" python3 benchmarks/quality/fewstep_table.py --classifier $R/clf --dataset "$DATA" \
    "${REF[@]}" --base $R/ours --guided $R/guided "${seed[@]}" --work "$W" --out "$OUT" \
    --deadline $(( T0 + DEADLINE )) "${TABLE[@]}"
  mark "table"
}

if [ ! -f $R/clf/classifier.safetensors ]; then
  run_log timeout "$(python3 -c "print(int(${CLF_MINUTES} * 60 + 45))")" python3 recipes/train_classifier.py \
    "${CLF[@]}" --dataset "$DATA" --output_dir $R/clf --progress false
  mark "classifier trained"
fi
rm -rf $R/ours $R/guided "$W/table.json" "$W/grids"
run_log timeout "$(python3 -c "print(int($MIN * 60 + 90))")" python3 recipes/train_flow.py "${OURS[@]}" \
  --dataset "$DATA" --output_dir $R/ours --sample_every_epochs 0 --progress false
mark "base trained"
minutes=$(python3 -c "print(round(max(0.5, min($DISTILL_MINUTES, ($(left) - $TABLE_S - 60) / 60)), 2))")
budget=(--max_minutes "$minutes")
[ -n "${SMOKE:-}" ] && budget=()
run_log timeout "$(left)" python3 recipes/train_flow_distill.py "${DISTILL[@]}" "${budget[@]}" "${RANGE[@]}" \
  --teacher $R/ours --dataset "$DATA" "${GUIDANCE[@]}" --output_dir $R/guided --progress false
mark "distilled over ${RANGE[1]} ($minutes min)"
table
if [ ! -f "$SEED_EVAL" ] && [ "${ANCHOR:-0}" = 1 ] && [ "$(left)" -gt "$(python3 -c "print(int($MIN * 60 + 120))")" ]
then  # the anchor, where the deadline leaves time for it
  rm -rf $R/seed
  run_log timeout "$(python3 -c "print(int($MIN * 60 + 90))")" "${SEED[@]}"
  mark "seed trained"
  mkdir -p "$(dirname "$SEED_EVAL")"
  run_log timeout "$(left)" python3 -m hf_cgpu.cli eval $R/seed --classifier $R/clf --dataset "$DATA" "${REF[@]}" \
    --num_images "$SEED_IMAGES" --scheduler euler --num_inference_steps 50 --guidance_scale 1 --progress false \
    --output_dir "$W/eval_seed" --output_json "$SEED_EVAL"
  cp "$SEED_EVAL" "$OUT/seed_eval.json"
  mark "seed evaluated"
  table  # every row kept: only the anchor's row is added
fi
mark "done"
