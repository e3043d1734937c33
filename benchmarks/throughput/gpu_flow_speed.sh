#!/usr/bin/env bash
# Flow UNet end to end, one device call (nvidia-h200): the seed's pipeline (benchmarks/throughput/bench_seed_flow_speed.py:
# DataLoader with 8 workers and per-image transforms, loss.item() every step, AveragedModel EMA) against ours
# (`recipes/train_flow.py --preset cifar10`: data, EMA, logging, guards included), same UNet (base 128), batch 256,
# CIFAR-10 from .data/cifar10 (a copy of ../shared/data/cifar10, carried with the call), both compiled, bf16.
#
#   images/s in steady state: the seed's over STEPS timed steps after WARM untimed ones; ours, the median (and the
#   mean) of its logged windows (every LOG steps) after step WARM, evaluation and checkpoints excluded as in the log;
#   start-up: seconds to the end of the first step, ours cold (empty $HF_CGPU_CACHE/inductor) then warm (a second,
#   short run on the cache the first one filled).
#
# GPU:   bash benchmarks/throughput/gpu_flow_speed.sh                  (STEPS=300 WARM=50 LOG=25 by default; ~5 minutes)
# CPU:   bash benchmarks/throughput/gpu_flow_speed.sh --smoke          (tiny preset on DATA=a CIFAR-shaped folder; checks the
#        script runs end to end, no figure to quote)
# Writes under $OUT (default /tmp/flow_speed): env.txt, seed.log, seed.json, seed_ours.log, seed_ours.json, ours_LABEL.log, ours_LABEL_results.json,
# ours_LABEL_history.json (one set per VARIANTS entry), ours_warm.log, ours_warm_results.json, summary.json, summary.md.
set -u
SMOKE=0; [ "${1:-}" = "--smoke" ] && SMOKE=1
if [ $SMOKE = 0 ]; then source benchmarks/gpu_env.sh --auto || exit 1; else source benchmarks/gpu_env.sh --cpu; fi
OUT=${OUT:-/tmp/flow_speed}; mkdir -p "$OUT"
DATA=${DATA:-.data/cifar10}
RUNS=${RUNS:-/tmp/flow_speed_runs}; rm -rf "$RUNS"; mkdir -p "$RUNS"
if [ $SMOKE = 1 ]; then
  STEPS=${STEPS:-4}; WARM=${WARM:-2}; LOG=${LOG:-2}; PRESET=tiny; SEED_ARGS=(--smoke)
else
  STEPS=${STEPS:-300}; WARM=${WARM:-50}; LOG=${LOG:-25}; PRESET=cifar10; SEED_ARGS=()
fi
TOTAL=$((WARM + STEPS))
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  python3 -c "import torch,diffusers;print('torch',torch.__version__,'diffusers',diffusers.__version__)"
  echo "steps $STEPS after $WARM warm-up, log every $LOG, preset $PRESET, data $DATA"
  python3 -c "from hf_cgpu.data.images import load_image_dataset as f; [f('$DATA', s) for s in ('train', 'test')]"
} > "$OUT/env.txt" 2>&1

# SEED_UNETS="seed ours": the seed's pipeline with the seed's layers (seed.json) and with hf_cgpu's compiled layer
# forms (seed_ours.json); both are reported
for U in ${SEED_UNETS:-seed ours}; do
  NAME=seed; [ "$U" = ours ] && NAME=seed_ours
  timeout 300 python3 benchmarks/throughput/bench_seed_flow_speed.py --dataset "$DATA" --warmup "$WARM" --steps "$STEPS" \
    --unet "$U" --json "$OUT/$NAME.json" "${SEED_ARGS[@]}" > "$OUT/$NAME.log" 2>&1 || echo "seed run failed: see $NAME.log"
done

COMMON=(--preset "$PRESET" --dataset "$DATA" --log_steps "$LOG" --eval_steps 0 --sample_every_epochs 0
        --checkpointing_steps 0 --progress false)
# VARIANTS="label=extra args|label=extra args": our run once per variant (default: the preset as it is), e.g.
# VARIANTS="preset=|graphs=--compile_mode reduce-overhead"; leading NAME=value words are environment variables of
# that run, e.g. VARIANTS="late=|sync=HF_CGPU_SYNC_STEPS=1" (each step read at once, the loop before issue 12's
# change); the warm start-up run uses the first variant only
IFS='|' read -ra RUNSPECS <<< "${VARIANTS:-preset=}"
split_spec() {  # $1 = "label=words": sets label, envs (leading NAME=value words), extra (the rest)
  label=${1%%=*}; envs=(); extra=()
  local w; read -ra words <<< "${1#*=}"
  for w in "${words[@]}"; do
    if [ ${#extra[@]} = 0 ] && [[ $w =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$w"); else extra+=("$w"); fi
  done
}
LABELS=()
for spec in "${RUNSPECS[@]}"; do
  split_spec "$spec"; LABELS+=("$label")
  timeout ${OURS_LIMIT:-300} env "${envs[@]}" python3 recipes/train_flow.py "${COMMON[@]}" "${extra[@]}" \
    --output_dir "$RUNS/$label" --max_steps "$TOTAL" > "$OUT/ours_$label.log" 2>&1 \
    || echo "our run $label failed: see ours_$label.log"
  cp "$RUNS/$label/all_results.json" "$OUT/ours_${label}_results.json" 2>/dev/null
  cp "$RUNS/$label/history.json" "$OUT/ours_${label}_history.json" 2>/dev/null
done
if [ "${WARMRUN:-1}" = 1 ]; then
  split_spec "${RUNSPECS[0]}"
  timeout 200 env "${envs[@]}" python3 recipes/train_flow.py "${COMMON[@]}" "${extra[@]}" --output_dir "$RUNS/ours_warm" \
    --max_steps "$LOG" > "$OUT/ours_warm.log" 2>&1 || echo "warm start-up run failed: see ours_warm.log"
  cp "$RUNS/ours_warm/all_results.json" "$OUT/ours_warm_results.json" 2>/dev/null
fi

LABELS="${LABELS[*]}" WARM=$WARM SMOKE=$SMOKE PRESET=$PRESET python3 - "$OUT" <<'EOF'
import json, os, statistics, sys
from pathlib import Path
out = Path(sys.argv[1]); warm = int(os.environ["WARM"])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
f = lambda v, p=0: "n/a" if v is None else f"{v:,.{p}f}"
seed, seed_ours, ours_warm = load("seed.json"), load("seed_ours.json"), load("ours_warm_results.json")
s = {"seed_img_per_s": seed and seed["img_per_s"], "seed_seconds_to_first_step": seed and seed["seconds_to_first_step"],
     "seed_with_our_unet_img_per_s": seed_ours and seed_ours["img_per_s"],
     "ours_seconds_to_first_step_warm": ours_warm and ours_warm.get("seconds_to_first_step"),
     "smoke (CPU, tiny: no figure to quote)": os.environ["SMOKE"] == "1", "variants": {}}
md = ["| pipeline | img/s steady state | s to first step | recompiles | train loss at the end |",
      "|---|---|---|---|---|",
      f"| seed (DataLoader x8, loss.item(), AveragedModel; the seed's layers) | {f(s['seed_img_per_s'])} | "
      f"{f(s['seed_seconds_to_first_step'], 1)} | | |"]
if seed_ours:
    md.append(f"| the same with hf_cgpu's compiled UNet layers | {f(seed_ours['img_per_s'])} | "
              f"{f(seed_ours['seconds_to_first_step'], 1)} | | |")
for i, label in enumerate(os.environ["LABELS"].split()):
    ours, hist = load(f"ours_{label}_results.json"), load(f"ours_{label}_history.json")
    windows = [h["train/img_per_s"] for h in (hist or []) if "train/img_per_s" in h and h["step"] > warm]
    losses = [h["train/loss"] for h in (hist or []) if "train/loss" in h]
    steady = statistics.median(windows) if windows else None
    v = {"img_per_s_steady_median": steady, "img_per_s_steady_mean": statistics.fmean(windows) if windows else None,
         "windows": len(windows), "img_per_s_run_mean": ours and ours.get("img_per_s"),
         "speedup_steady": steady / seed["img_per_s"] if steady and seed else None,
         "speedup_vs_seed_with_our_unet": steady / seed_ours["img_per_s"] if steady and seed_ours else None,
         "seconds_to_first_step_cold": ours and ours.get("seconds_to_first_step"),
         "recompiles": ours and ours.get("recompiles"), "last_train_loss": losses[-1] if losses else None,
         "device": (ours or {}).get("device")}
    s["variants"][label] = v
    start = f"cold {f(v['seconds_to_first_step_cold'], 1)}" + (
        f", warm {f(s['ours_seconds_to_first_step_warm'], 1)}" if i == 0 else "")
    md.append(f"| ours `--preset {os.environ['PRESET']}` {label} | {f(steady)} (median of {len(windows)} windows; "
              f"{f(v['speedup_steady'], 2)}x the seed, {f(v['speedup_vs_seed_with_our_unet'], 2)}x with our layers) | "
              f"{start} | {v['recompiles']} | {f(v['last_train_loss'], 4)} |")
(out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
(out / "summary.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
EOF
