#!/usr/bin/env bash
# GPU calls (device tool, one nvidia-h200, back to back on the warm machine) for issue 35: images in one or two
# network evaluations, and guidance that keeps diversity. Carried: .whl (../shared/tools/device-wheels.sh) and
# .data/cifar10 (a copy of ../shared/data/cifar10).
#
#   PART=1 bash benchmarks/quality/gpu_fewstep.sh   the judge classifier (2 min), the seed's recipe (4 min), its
#                                                    evaluation (Euler 50, 10,000 images): /tmp/clf, /tmp/seed,
#                                                    /tmp/fewstep/seed_eval.json
#   PART=2 bash benchmarks/quality/gpu_fewstep.sh   ours (--preset cifar10, 4 min), its distillation (hf-cgpu train
#                                                    flow-distill --preset cifar10, DISTILL_MINUTES, default 3, cut
#                                                    to leave TABLE_S for the table), then the table until the deadline
#   PART=3 bash benchmarks/quality/gpu_fewstep.sh   (if rows are left) the rest of the table on what PART=2 left
#   DISTILL_MORE=m (PART=2 and the first PART=3)      PART=2 leaves the table out; PART=3 resumes the distillation
#                                                    for m more minutes (its learning rate is constant), then the table
#
# The table includes autoguidance rows (fewstep_table.py: each pipeline guided by its raw weights and by an early
# checkpoint of its run), so both runs keep every checkpoint (ours one every 3000 steps).
#
# The machine stays warm 30 s between calls, so /tmp survives. Every step after training is bounded by DEADLINE_S
# (default 560 s from the start); the table keeps its finished rows in /tmp/fewstep/table.json and PART=3 skips them.
# The reference of FD / precision / recall is the classifier's features of the first 10,000 training images (the
# issue's), the test split scored against it the ceiling.
#
# SMOKE=1: the whole chain on the CPU in a few minutes (tiny classifier, tiny flow runs in place of the seed's recipe
# and ours, a few images per row), all parts in one call, in a temporary folder:
#   SMOKE=1 OUT=/tmp/out bash benchmarks/quality/gpu_fewstep.sh
#
# Writes under $OUT (at most 8 files): timeline.txt, env.txt, PART=1: classifier.log, seed.log, seed_eval.json;
# PART=2/3: ours.log and distill.log (each ends with the run's all_results; the table's progress is appended to
# distill.log), fewstep.md (the table), fewstep.json (its rows), grids.tar (one picture grid per row).
source benchmarks/quality/fewstep_common.sh
TABLE_S=${TABLE_S:-60}
KEEP=(--checkpoints_total_limit 50)  # every checkpoint stays: the table's autoguidance takes an early one as the guide
OURS=(--preset cifar10 --max_minutes "$MIN" --checkpointing_steps 3000 "${KEEP[@]}")
DISTILL=(--preset cifar10 "${KEEP[@]}")
TABLE=(--num_images "${NUM_IMAGES:-5000}")
if [ -n "${SMOKE:-}" ]; then  # CPU: the same chain at toy sizes (fewstep_common.sh: the classifier, the seed, R)
  OURS=(--preset tiny --max_steps 6 --checkpointing_steps 2 "${KEEP[@]}" --limit 256)
  DISTILL=(--preset tiny --limit 64 "${KEEP[@]}")
  TABLE=(--num_images 40 --batch_size 20 --evaluations 1,2,4,6 --ag_base 6 --ag_scales 2)
fi
W=$R/fewstep
mkdir -p "$W" "$OUT"

describe_env "$OUT/env.txt"
mark "decoded"

part1() {
  rm -rf $R/clf $R/seed "$W" && mkdir -p "$W"
  timeout 170 python3 recipes/train_classifier.py "${CLF[@]}" --dataset "$DATA" --output_dir $R/clf \
    --progress false > "$OUT/classifier.log" 2>&1
  mark "classifier trained"
  timeout "$(python3 -c "print(int($MIN * 60 + 90))")" "${SEED[@]}" > "$OUT/seed.log" 2>&1
  mark "seed trained"
  timeout "$(left)" python3 -m hf_cgpu.cli eval $R/seed --classifier $R/clf --dataset "$DATA" "${REF[@]}" \
    --num_images "$SEED_IMAGES" --scheduler euler --num_inference_steps 50 --guidance_scale 1 --progress false \
    --output_dir "$W/eval_seed" --output_json "$W/seed_eval.json" > "$W/eval_seed.log" 2>&1
  cat "$W/eval_seed.log" >> "$OUT/seed.log"; cp "$W/seed_eval.json" "$OUT/seed_eval.json"
  mark "seed evaluated"
}
part2() {
  [ -f $R/clf/classifier.safetensors ] || { echo "PART=2 needs PART=1's $R/clf (warm machine)"; exit 1; }
  rm -rf $R/ours $R/distill "$W/table.json" "$W/grids"
  timeout "$(python3 -c "print(int($MIN * 60 + 90))")" python3 recipes/train_flow.py "${OURS[@]}" --dataset "$DATA" \
    --output_dir $R/ours --sample_every_epochs 0 --progress false > "$OUT/ours.log" 2>&1
  mark "ours trained"
  local minutes
  minutes=$(python3 -c "print(max(0.5, min($DISTILL_MINUTES, ($(left) - $TABLE_S - 60) / 60)))")
  timeout "$(left)" python3 recipes/train_flow_distill.py "${DISTILL[@]}" --teacher $R/ours --dataset "$DATA" \
    "${GUIDANCE[@]}" --max_minutes "$minutes" --output_dir $R/distill --progress false > "$OUT/distill.log" 2>&1
  mark "distilled ($minutes min)"
  [ -n "${DISTILL_MORE:-}" ] || table  # PART=3 continues the distillation first: a table now would be of the wrong model
}
distill_more() {  # PART=3 with DISTILL_MORE=m: m more minutes of the same distillation run (exact resume), then the table
  [ -f $R/distill/model_index.json ] || { echo "DISTILL_MORE needs PART=2's $R/distill (warm machine)"; exit 1; }
  python3 - "$W/table.json" <<'PY'  # rows of the distilled pipeline were of the shorter run: measure them again
import json, sys
from pathlib import Path
p = Path(sys.argv[1])
if p.is_file():
    p.write_text(json.dumps([r for r in json.loads(p.read_text()) if r["model"] != "distilled"], indent=1))
PY
  timeout "$(left)" python3 recipes/train_flow_distill.py "${DISTILL[@]}" --teacher $R/ours --dataset "$DATA" \
    "${GUIDANCE[@]}" --max_minutes "$DISTILL_MORE" --output_dir $R/distill --progress false \
    --resume_from_checkpoint latest >> "$OUT/distill.log" 2>&1
  mark "distilled $DISTILL_MORE more min"
}
table() {
  local distilled=$R/distill
  [ -f $R/distill/model_index.json ] || distilled=""
  timeout "$(left)" python3 benchmarks/quality/fewstep_table.py --classifier $R/clf --dataset "$DATA" "${REF[@]}" \
    --base $R/ours --distilled "$distilled" --seed_eval "$W/seed_eval.json" --work "$W" --out "$OUT" \
    --deadline $(( T0 + DEADLINE )) "${TABLE[@]}" >> "$OUT/distill.log" 2>&1
  mark "table"
}

case "${PART:-}" in
  1) part1 ;;
  2) part2 ;;
  3) [ -n "${DISTILL_MORE:-}" ] && distill_more; table ;;
  *) if [ -z "${SMOKE:-}" ]; then echo "PART=1, 2 or 3 (or SMOKE=1)"; exit 2; fi
     part1; part2; if [ -n "${DISTILL_MORE:-}" ]; then distill_more; table; fi ;;
esac
mark "done"
