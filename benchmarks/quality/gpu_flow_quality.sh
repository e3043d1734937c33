#!/usr/bin/env bash
# GPU call (device tool; nvidia-h200-x2 preferred, nvidia-h200 works): image quality after the same training
# wall-clock, the seed's recipe (benchmarks/quality/bench_seed_image.py) against `recipes/train_flow.py --preset cifar10`,
# both scored by `hf-cgpu eval` in the features of a classifier trained here (`recipes/train_classifier.py --preset
# cifar10`). Carried: .whl (../shared/tools/device-wheels.sh) and .data/cifar10 (a copy of ../shared/data/cifar10).
#
# Two GPUs: the seed trains on GPU 0 while the classifier and then our run train on GPU 1, so each run has a GPU to
# itself, for FLOW_MINUTES (default 4) each. One GPU: the same steps one after another with FLOW_MINUTES default 2.5.
# Every step after training is bounded by the time left, so the script ends within DEADLINE_S (default 570 s);
# a sweep cut short keeps its finished rows.
#
# Writes under $OUT: env.txt, timeline.txt, classifier.log + classifier_results.json + classifier_curves.png,
#   seed.log + seed.json, ours.log + ours_results.json + ours_curves.png, eval_seed/ (eval.json, grid: Euler 50, no
#   guidance), eval_ours/ (eval.json, grid: the same sampler, EMA weights), sweep_ema/ and sweep_raw/ (sweep.json,
#   sweep.md, grids; sweep.png where matplotlib is importable, else afterwards:
#   python -c "from hf_cgpu.evaluation.flow import plot_sweep; plot_sweep('sweep_ema/sweep.json')").
source benchmarks/gpu_env.sh --gpu || exit 1
T0=$(date +%s)
DEADLINE=${DEADLINE_S:-570}
mark() { echo "$(( $(date +%s) - T0 ))s $*" >> "$OUT/timeline.txt"; }
left() { local l=$(( DEADLINE - ($(date +%s) - T0) )); echo $(( l > 1 ? l : 1 )); }
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then GA=0; GB=1; MIN=${FLOW_MINUTES:-4}; else GA=0; GB=0; MIN=${FLOW_MINUTES:-2.5}; fi
# One GPU at the full 4-minute budget: two back-to-back calls on the same warm machine, PART=1 (classifier, seed
# recipe, its evaluation) then PART=2 (ours, its evaluation and sweeps; reuses /tmp/clf when the machine stayed warm);
# PART=3 (a third call) sweeps the grid: Euler/Heun x 5/10/20/50 evaluations x guidance 1/1.5/2/3 x EMA/raw.
if [ -n "${PART:-}" ]; then MIN=${FLOW_MINUTES:-4}; fi
TRAIN_TIMEOUT=$(python3 -c "print(int($MIN * 60 + 90))")
DATA=.data/cifar10
EVAL=(python3 -m hf_cgpu.cli eval)
EV=(--classifier /tmp/clf --dataset "$DATA" --progress false)
SWEEP=(--sweep --num_images 5000 --sweep_schedulers euler,heun --sweep_steps 4,8,16 --sweep_guidance 1,1.5,2.5)

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch,diffusers,datasets,accelerate;print('torch',torch.__version__,'diffusers',diffusers.__version__,'datasets',datasets.__version__,'accelerate',accelerate.__version__)"
  echo "GPUs for seed/ours: $GA/$GB, minutes per flow run: $MIN"
  # decode both splits once, so the jobs below read the cache instead of racing to write it
  python3 -c "from hf_cgpu.data.images import load_image_dataset as f; [f('$DATA', s) for s in ('train', 'test')]"
} > "$OUT/env.txt" 2>&1
mark "decoded"

train_classifier() {
  CUDA_VISIBLE_DEVICES=$GB timeout 170 python3 recipes/train_classifier.py --preset cifar10 --dataset "$DATA" \
    --output_dir /tmp/clf --max_minutes 2 --progress false > "$OUT/classifier.log" 2>&1
  cp /tmp/clf/all_results.json "$OUT/classifier_results.json"; cp /tmp/clf/training_curves.png "$OUT/classifier_curves.png"
  touch /tmp/clf.done; mark "classifier trained"
}
train_seed() {
  CUDA_VISIBLE_DEVICES=$GA timeout "$TRAIN_TIMEOUT" python3 benchmarks/quality/bench_seed_image.py --dataset "$DATA" \
    --minutes "$MIN" --output_dir /tmp/seed > "$OUT/seed.log" 2>&1
  cp /tmp/seed/bench_seed.json "$OUT/seed.json"; mark "seed trained"
}
train_ours() {
  CUDA_VISIBLE_DEVICES=$GB timeout "$TRAIN_TIMEOUT" python3 recipes/train_flow.py --preset cifar10 --dataset "$DATA" \
    --output_dir /tmp/ours --max_minutes "$MIN" --sample_every_epochs 0 --progress false > "$OUT/ours.log" 2>&1
  cp /tmp/ours/all_results.json "$OUT/ours_results.json"; cp /tmp/ours/training_curves.png "$OUT/ours_curves.png"
  touch /tmp/ours.done; mark "ours trained"
}
eval_seed() {  # the seed's own sampler: Euler, 50 steps, unconditional
  CUDA_VISIBLE_DEVICES=$GA timeout "$(left)" "${EVAL[@]}" /tmp/seed "${EV[@]}" --num_images 10000 --scheduler euler \
    --num_inference_steps 50 --guidance_scale 1 --output_dir "$OUT/eval_seed" > "$OUT/eval_seed.log" 2>&1
  mark "seed evaluated"
}
eval_ours() {  # the same sampler on our EMA weights, then our sweep
  CUDA_VISIBLE_DEVICES=$GB timeout "$(left)" "${EVAL[@]}" /tmp/ours "${EV[@]}" --weights ema --num_images 10000 \
    --scheduler euler --num_inference_steps 50 --guidance_scale 1 --output_dir "$OUT/eval_ours" > "$OUT/eval_ours.log" 2>&1
  mark "ours evaluated at the seed's sampler"
  sweep_ema
}
sweep_ema() {
  CUDA_VISIBLE_DEVICES=$GB timeout "$(left)" "${EVAL[@]}" /tmp/ours "${EV[@]}" --weights ema "${SWEEP[@]}" \
    --output_dir "$OUT/sweep_ema" > "$OUT/sweep_ema.log" 2>&1
  mark "ours EMA sweep"
}
sweep_raw() {
  CUDA_VISIBLE_DEVICES=$GA timeout "$(left)" "${EVAL[@]}" /tmp/ours "${EV[@]}" --weights raw "${SWEEP[@]}" \
    --output_dir "$OUT/sweep_raw" > "$OUT/sweep_raw.log" 2>&1
  mark "ours raw sweep"
}

if [ "${PART:-}" = 1 ]; then
  train_classifier; train_seed; eval_seed
elif [ "${PART:-}" = 2 ]; then
  [ -f /tmp/clf.done ] || train_classifier; train_ours; eval_ours; sweep_raw
elif [ "${PART:-}" = 3 ]; then  # issue 8's grid, in evaluations per image, on what PART=2 left on this warm machine
  if [ ! -f /tmp/ours.done ] || [ ! -f /tmp/clf.done ]; then echo "PART=3 needs PART=2's /tmp/ours and /tmp/clf"; exit 1; fi
  SWEEP=(--sweep --num_images "${SWEEP_IMAGES:-5000}" --sweep_schedulers euler,heun --sweep_evaluations 5,10,20,50
         --sweep_guidance 1,1.5,2,3)
  sweep_ema; sweep_raw
elif [ "$GA" != "$GB" ]; then
  ( train_seed
    while [ ! -f /tmp/clf.done ] && [ "$(left)" -gt 1 ]; do sleep 2; done; eval_seed
    while [ ! -f /tmp/ours.done ] && [ "$(left)" -gt 1 ]; do sleep 2; done; sweep_raw ) &
  train_classifier; train_ours; eval_ours
  wait
else
  train_classifier; train_seed; train_ours; eval_seed; eval_ours; sweep_raw
fi
mark "done"
ls -la /tmp/clf /tmp/seed /tmp/ours >> "$OUT/env.txt" 2>&1
