# What the two few-step benchmarks share, sourced from the project root by gpu_fewstep.sh and gpu_fewstep_gan.sh (not
# run): the environment, the deadline clock (mark, left: DEADLINE_S, default 560 s from the start), the data, the
# judge classifier, the seed's recipe and the reference of FD / precision / recall (the first 10,000 training images),
# the distillation's guidance; with SMOKE=1 the toy sizes of a CPU check, in a fresh temporary folder R.
if [ -n "${SMOKE:-}" ]; then source benchmarks/gpu_env.sh --cpu; else source benchmarks/gpu_env.sh --gpu || exit 1; fi
T0=$(date +%s)
DEADLINE=${DEADLINE_S:-560}
mark() { echo "$(( $(date +%s) - T0 ))s PART=${PART:-all} $*" >> "$OUT/timeline.txt"; }
left() { local l=$(( DEADLINE - ($(date +%s) - T0) )); echo $(( l > 1 ? l : 1 )); }
DATA=${DATA:-.data/cifar10}
R=/tmp  # where the runs live between the calls (SMOKE: a fresh temporary folder)
MIN=${FLOW_MINUTES:-4}
DISTILL_MINUTES=${DISTILL_MINUTES:-3}
GUIDANCE=(--guidance_scale "${DISTILL_SCALE:-2.0}" --guidance_interval "${DISTILL_INTERVAL:-0.25:0.8}")
REF=(--split train --real_limit 10000)
CLF=(--preset cifar10 --max_minutes 2)
SEED=(python3 benchmarks/quality/bench_seed_image.py --dataset "$DATA" --minutes "$MIN" --output_dir $R/seed)
SEED_IMAGES=10000
if [ -n "${SMOKE:-}" ]; then  # CPU: the same chain at toy sizes; a tiny unconditional flow run stands in for the seed
  R=$(mktemp -d)
  CLF=(--preset tiny --max_steps 5)
  SEED=(python3 -m hf_cgpu.cli train flow --preset tiny --class_conditional false --dataset "$DATA" --max_steps 4
        --checkpointing_steps 0 --output_dir $R/seed)
  REF=(--split train --real_limit 300)
  SEED_IMAGES=40
  DEADLINE=${DEADLINE_S:-1800}
fi

describe_env() {  # the card, the versions, and the image splits decoded once (the runs then read the cache)
  { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    python3 -c "import torch,diffusers,datasets,accelerate;print('torch',torch.__version__,'diffusers',diffusers.__version__,'datasets',datasets.__version__,'accelerate',accelerate.__version__)"
    python3 -c "from hf_cgpu.data.images import load_image_dataset as f; [f('$DATA', s) for s in ('train', 'test')]"
  } >> "$1" 2>&1
}
