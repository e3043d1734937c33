#!/usr/bin/env bash
# One GPU call (nvidia-h200): rank GPT options on the early part of the 7-minute zh-poetry run by running them AT
# ONCE on one GPU, each on the same schedule (the cosine over STEPS steps, as the 7-minute run fits it), and comparing
# their validation curves at equal steps. Sharing the GPU makes wall time meaningless, so nothing here is read by
# time: each run stops after MINUTES of its own (fewer steps for a slower option), and the table compares every run
# at the largest step all of them reached. A full 7-minute call (gpu_zh_poetry_modern.sh) keeps the record.
#
#   V1="base:" V2="ve:--value_embeddings 3" V3="skips:--unet_skips true --logit_softcap 15" \
#     MINUTES=5 bash benchmarks/quality/gpu_zh_screen.sh
#
# Each Vn is "name:flags for recipes/train_gpt.py" on top of --preset $PRESET (zh-poetry-modern); up to V8.
# Carried: .whl (../shared/tools/device-wheels.sh) and .data/zh-poetry (a copy of ../shared/data/zh-poetry).
# Writes $OUT/screen.md (the table, with the first evaluated step at or below TARGET_BPC, default 5.74: steps to
# the seed's quality times a solo step's seconds is the time to it), screen.json, screen.png (validation bits/char
# by step), the runs' logs in logs.tgz. SMOKE=1 runs it on the CPU with the tiny preset and the embedded corpus (a
# check of the script). STEPS (default 2200) is the schedule's length: what the 7-minute run of the preset fits.
# SOLO=1 runs the options one after another instead (each alone on the GPU, so that its seconds are its own: the
# table adds seconds per step and the seconds of training to TARGET_BPC); a run that would end past DEADLINE (570 s
# from the start) is skipped and named.
if [ -z "${SMOKE:-}" ]; then
  source benchmarks/gpu_env.sh --gpu || exit 1
  PRESET=${PRESET:-zh-poetry-modern} DATA=${DATA-.data/zh-poetry} STEPS=${STEPS:-2200} EVAL=${EVAL:-50}
  MINUTES=${MINUTES:-5}
else
  source benchmarks/gpu_env.sh --cpu
  PRESET=${PRESET:-tiny} DATA=${DATA-} STEPS=${STEPS:-40} EVAL=${EVAL:-5} MINUTES=${MINUTES:-0.3}
fi
export TOKENIZERS_PARALLELISM=true
OUT=${OUT:-/tmp/screen_out}; W=/tmp/screen; rm -rf $W; mkdir -p "$OUT" $W
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch,transformers;print('torch',torch.__version__,'transformers',transformers.__version__)"
  echo "PRESET=$PRESET STEPS=$STEPS MINUTES=$MINUTES EVAL=$EVAL"; for i in 1 2 3 4 5 6 7 8; do v=V$i; [ -n "${!v:-}" ] && echo "$v=${!v}"; done
} > $OUT/env.txt 2>&1
common=(--preset "$PRESET" ${DATA:+--dataset $DATA} --progress false --checkpointing_steps 0 --max_new_tokens 8)
# the tokenizer and the packed tokens once (the runs below find both in $HF_CGPU_CACHE), without compiling
timeout 240 python3 recipes/train_gpt.py "${common[@]}" --output_dir $W/prep --max_steps 1 --max_minutes 0 \
  --fit_schedule_to_time false --compile false --eval_steps 0 --load_best_at_end false --early_stopping_patience 0 \
  > $W/prep.log 2>&1 || { tail -5 $W/prep.log; exit 1; }
names=()
skipped=""
for i in 1 2 3 4 5 6 7 8; do
  v=V$i; [ -z "${!v:-}" ] && continue
  name=${!v%%:*} flags=${!v#*:}
  if [ -n "${SOLO:-}" ] && [ $((SECONDS + $(python3 -c "print(int($MINUTES * 60 + 75))"))) -gt "${DEADLINE:-570}" ]; then
    skipped="$skipped $name"; continue  # would end past the call's limit: run it in another call
  fi
  names+=("$name")
  # shellcheck disable=SC2086  # the flags are split on purpose
  timeout "$(python3 -c "print(int($MINUTES * 60 + 150))")" python3 recipes/train_gpt.py "${common[@]}" \
    --output_dir $W/$name --max_steps $STEPS --max_minutes $MINUTES --fit_schedule_to_time false \
    --eval_steps $EVAL $flags > $W/$name.log 2>&1 &
  [ -z "${SOLO:-}" ] || wait  # SOLO: one run at a time, so that its seconds are its own
done
wait
[ -z "$skipped" ] || echo "skipped (past DEADLINE):$skipped" | tee -a $OUT/env.txt
python3 - "$OUT" "$W" "${names[@]}" <<'PY'
import json, os, sys
from pathlib import Path

out, work, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
curves, rows = {}, {}
for name in names:
    try:
        hist = json.loads((work / name / "history.json").read_text())
        res = json.loads((work / name / "all_results.json").read_text())
    except (OSError, ValueError) as err:
        rows[name] = {"error": str(err)}
        continue
    curves[name] = {e["step"]: e["eval/val_bpc"] for e in hist if "eval/val_bpc" in e}
    rows[name] = {k: res.get(k) for k in ("steps", "best_step", "val_bpc", "train_loss", "seconds_to_first_step",
                                          "peak_alloc_gib", "recompiles")}
    rows[name]["flags"] = next((os.environ[v].split(":", 1)[1] for v in (f"V{i}" for i in range(1, 9))
                                if os.environ.get(v, "").split(":", 1)[0] == name), "")
common = set.intersection(*(set(c) for c in curves.values())) if curves else set()
checks = sorted(s for s in common if s > 0)
marks = [s for s in checks if s in (checks[-1], checks[len(checks) // 2], checks[len(checks) // 4])]
TARGET = float(os.environ.get("TARGET_BPC", "5.74"))  # the seed's 7-minute quality: steps to it x a solo step's time


def reached(c: dict) -> str:
    return next((str(s) for s in sorted(c) if s > 0 and c[s] <= TARGET), "-")


solo = bool(os.environ.get("SOLO"))
sys.path.insert(0, str(Path("benchmarks/quality").resolve()))
from plot_zh_curves import load, seconds_to, steady_seconds_per_step  # noqa: E402  (the curve plots' rules)

lines = [f"| run | flags | steps | {' | '.join(f'val bits/char at step {s}' for s in marks)} | first step <= {TARGET} "
         + (f"| s per step | seconds of training to {TARGET} | in steps alone " if solo else "") + "| peak alloc GiB |",
         "|---|---|---|" + "---|" * len(marks) + "---|---|" + ("---|---|---|" if solo else "")]
for name, r in rows.items():
    c = curves.get(name, {})
    r["first_step_at_target"] = reached(c)
    timing = ""
    if solo and name in curves:  # a run alone on the GPU: its own seconds per step give the time to the target
        curve, per_step, _ = load(work / name)
        r["s_per_step"], r["seconds_to_target"] = per_step, seconds_to(curve, per_step, TARGET)
        steady = steady_seconds_per_step(work / name)  # no evaluation, saving or first-step compile
        r["seconds_to_target_in_steps"] = seconds_to(curve, steady, TARGET) if steady else None
        timing = (f" | {per_step:.4f} | " + (f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] else "-")
                  + " | " + (f"{r['seconds_to_target_in_steps']:.1f}" if r["seconds_to_target_in_steps"] else "-"))
    lines.append(f"| {name} | `{r.get('flags', '')}` | {r.get('steps')} | "
                 + " | ".join(f"{c[s]:.3f}" if s in c else "-" for s in marks)
                 + f" | {r['first_step_at_target']}{timing} | {r.get('peak_alloc_gib') or 0:.2f} |")
(out / "screen.md").write_text("\n".join(lines) + "\n")
(out / "screen.json").write_text(json.dumps({"rows": rows, "curves": curves}, indent=1))
print("\n".join(lines))
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in curves.items():
        steps = sorted(c)
        ax.plot(steps, [c[s] for s in steps], label=name)
    ax.set_xlabel("optimizer step (all runs on one schedule)"); ax.set_ylabel("validation bits per character")
    ax.set_ylim(top=min(8, max((max(c.values()) for c in curves.values()), default=8)))
    ax.legend(); ax.grid(alpha=0.3); fig.tight_layout(); fig.savefig(out / "screen.png", dpi=110)
except ImportError:
    pass
PY
(cd $W && tar -czf $OUT/logs.tgz ./*.log)  # ./: a run named -ve is not an option
for name in "${names[@]}"; do grep -hE "error|Error|Traceback" $W/$name.log | head -3; done
