#!/usr/bin/env bash
# GPU calls (device tool, one GPU, back to back on the warm machine; /tmp survives between them) for the adversarial
# stage of `hf-cgpu train flow-distill`: one-step images that keep the data's variety. Carried: .whl
# (../shared/tools/device-wheels.sh) and .data/cifar10 (a copy of ../shared/data/cifar10).
#
#   PART=1 bash benchmarks/quality/gpu_fewstep_gan.sh   the judge classifier (2 min), the seed's recipe (4 min), its
#                                                        evaluation (Euler 50, 10,000 images): /tmp/clf, /tmp/seed
#   PART=2 bash benchmarks/quality/gpu_fewstep_gan.sh   ours (--preset cifar10, FLOW_MINUTES, default 4), its
#                                                        distillation (--preset cifar10, DISTILL_MINUTES, default 3)
#   PART=12 bash benchmarks/quality/gpu_fewstep_gan.sh  two calls instead of three: the judge, then PART=2 (no seed
#                                                        recipe, so the table has no anchor row)
#   PART=3 bash benchmarks/quality/gpu_fewstep_gan.sh   DISTILL_MORE (default 2) more minutes of that distillation
#                                                        (exact resume), the adversarial stage from it (--preset
#                                                        cifar10-gan, GAN_MINUTES, default 2), then the table
#
# Training in all: 4 + 3 + 2 + 2 = 11 minutes. The distillation and the adversarial stage report the judge's rarest
# class share at every evaluation (--judge /tmp/clf). The table (fewstep_table.py) has rows for the distilled student
# and its adversarial stage at 1 and 2 evaluations (then the base at few evaluations while time is left), each with
# FD / precision / recall against the first 10,000 training images in the judge's features, the rarest class share,
# the seed recipe's row as the anchor, and a picture grid per row (one row per class). Knobs of the stage:
# ADV_WEIGHT, DISTILL_WEIGHT, DISC_LR, DISC_TIME, GAN_LR (defaults: the preset's).
#
# Every phase is bounded by DEADLINE_S (default 560 s from the start of the call).
#
# SMOKE=1: the whole chain on the CPU at toy sizes, all parts in one call, in a temporary folder:
#   SMOKE=1 OUT=/tmp/out bash benchmarks/quality/gpu_fewstep_gan.sh
#
# Writes under $OUT (at most 8 files): timeline.txt (with the environment), PART=1: part1.log, seed_eval.json;
# PART=2: part2.log; PART=3: part3.log (each run ends with its all_results), fewstep.md (the table), fewstep.json
# (its rows), grids.tar (one picture grid per row).
source benchmarks/quality/fewstep_common.sh
DISTILL_MORE=${DISTILL_MORE:-2}
GAN_MINUTES=${GAN_MINUTES:-2}
OURS=(--preset cifar10 --max_minutes "$MIN")
DISTILL=(--preset cifar10 --judge $R/clf --judge_images 1000)
MORE=(--max_minutes "$DISTILL_MORE")
GAN=(--preset cifar10-gan --max_minutes "$GAN_MINUTES" --judge $R/clf --judge_images 1000)
TABLE=(--num_images "${NUM_IMAGES:-5000}" --evaluations 1,2 --ag_scales "" --row_seconds 30)
if [ -n "${SMOKE:-}" ]; then  # CPU: the same chain at toy sizes (fewstep_common.sh: the classifier, the seed, R)
  OURS=(--preset tiny --max_steps 6 --checkpointing_steps 0 --limit 256)
  DISTILL=(--preset tiny --limit 64 --max_steps 6 --judge $R/clf --judge_images 20)
  MORE=(--max_steps 8)
  GAN=(--preset tiny --limit 64 --max_steps 4 --adversarial_weight 0.5 --disc_width 16 --sample_steps 1
       --judge $R/clf --judge_images 20)
  TABLE=(--num_images 40 --batch_size 20 --evaluations 1,2 --ag_scales "")
fi
KNOBS=()
for pair in "ADV_WEIGHT adversarial_weight" "DISTILL_WEIGHT distill_weight" "DISC_LR disc_lr" "DISC_TIME disc_time" \
            "GAN_LR learning_rate"; do
  set -- $pair
  [ -n "${!1:-}" ] && KNOBS+=("--$2" "${!1}")
done
W=$R/fewstep_gan
mkdir -p "$W" "$OUT"

describe_env "$OUT/timeline.txt"
mark "decoded"
run_log() {  # run_log LOG COMMAND...: the command's output and exit status appended to LOG
  local log=$1; shift
  echo "== $(date -u +%T) $*" >> "$log"; "$@" >> "$log" 2>&1; echo "== rc $?" >> "$log"
}

part1() {
  rm -rf $R/clf $R/seed "$W" && mkdir -p "$W"
  run_log "$OUT/part1.log" timeout 170 python3 recipes/train_classifier.py "${CLF[@]}" --dataset "$DATA" \
    --output_dir $R/clf --progress false
  mark "classifier trained"
  [ "${SEED_RECIPE:-1}" = 0 ] && return  # no anchor row this time (PART=12 below)
  run_log "$OUT/part1.log" timeout "$(python3 -c "print(int($MIN * 60 + 90))")" "${SEED[@]}"
  mark "seed trained"
  run_log "$OUT/part1.log" timeout "$(left)" python3 -m hf_cgpu.cli eval $R/seed --classifier $R/clf \
    --dataset "$DATA" "${REF[@]}" --num_images "$SEED_IMAGES" --scheduler euler --num_inference_steps 50 \
    --guidance_scale 1 --progress false --output_dir "$W/eval_seed" --output_json "$W/seed_eval.json"
  cp "$W/seed_eval.json" "$OUT/seed_eval.json"
  mark "seed evaluated"
}
part2() {
  [ -f $R/clf/classifier.safetensors ] || { echo "PART=2 needs PART=1's $R/clf (warm machine)"; exit 1; }
  rm -rf $R/ours $R/distill $R/gan "$W/table.json" "$W/grids"
  run_log "$OUT/part2.log" timeout "$(python3 -c "print(int($MIN * 60 + 90))")" python3 recipes/train_flow.py \
    "${OURS[@]}" --dataset "$DATA" --output_dir $R/ours --sample_every_epochs 0 --progress false
  mark "ours trained"
  local minutes
  minutes=$(python3 -c "print(max(0.5, min($DISTILL_MINUTES, ($(left) - 60) / 60)))")
  local budget=(--max_minutes "$minutes")
  [ -n "${SMOKE:-}" ] && budget=()
  run_log "$OUT/part2.log" timeout "$(left)" python3 recipes/train_flow_distill.py "${DISTILL[@]}" "${budget[@]}" \
    --teacher $R/ours --dataset "$DATA" "${GUIDANCE[@]}" --output_dir $R/distill --progress false
  mark "distilled ($minutes min)"
}
part3() {
  [ -f $R/distill/model_index.json ] || { echo "PART=3 needs PART=2's $R/distill (warm machine)"; exit 1; }
  run_log "$OUT/part3.log" timeout "$(left)" python3 recipes/train_flow_distill.py "${DISTILL[@]}" "${MORE[@]}" \
    --teacher $R/ours --dataset "$DATA" "${GUIDANCE[@]}" --output_dir $R/distill --progress false \
    --resume_from_checkpoint latest
  mark "distilled more"
  rm -rf $R/gan "$W/table.json" "$W/grids"
  run_log "$OUT/part3.log" timeout "$(left)" python3 recipes/train_flow_distill.py "${GAN[@]}" "${KNOBS[@]}" \
    --teacher $R/ours --init_student $R/distill --dataset "$DATA" "${GUIDANCE[@]}" --output_dir $R/gan \
    --progress false
  mark "adversarial stage"
  local gan=$R/gan
  [ -f $R/gan/model_index.json ] || gan=""
  run_log "$OUT/part3.log" timeout "$(left)" python3 benchmarks/quality/fewstep_table.py --classifier $R/clf \
    --dataset "$DATA" "${REF[@]}" --base $R/ours --distilled $R/distill --gan "$gan" --seed_eval "$W/seed_eval.json" \
    --work "$W" --out "$OUT" --deadline $(( T0 + DEADLINE )) "${TABLE[@]}"
  mark "table"
}

case "${PART:-}" in
  1) part1 ;;
  12) SEED_RECIPE=0 part1; part2 ;;
  2) part2 ;;
  3) part3 ;;
  *) if [ -z "${SMOKE:-}" ]; then echo "PART=1, 2 or 3 (or SMOKE=1)"; exit 2; fi
     part1; part2; part3 ;;
esac
mark "done"
