#!/usr/bin/env bash
# One GPU call (nvidia-h100-x1 or nvidia-h200, <= ~9.5 minutes): the zh-poetry-modern preset against the levers for
# many epochs of a small corpus (--input_noise, --swa_start, --teacher, --weight_decay_end, --mtp_heads) at EQUAL
# STEPS, several runs at once on the one GPU (small models leave an H100 idle; sharing it makes wall time
# meaningless, so everything is read by step).
#
#   bash benchmarks/quality/gpu_zh_levers.sh                # on the GPU machine
#   SMOKE=1 OUT=/tmp/levers_out bash benchmarks/quality/gpu_zh_levers.sh   # the same chain on the CPU, tiny preset
#
# Two phases, each of its runs started at once, every run on the same cosine over STEPS steps (--fit_schedule_to_time
# false), each stopped by --max_minutes if the phase's share of the DEADLINE (570 s from the start) comes first:
#   A: A1..A4, default base (the preset), noise (--input_noise 0.05), swa (--ema_decay 0 --swa_start 0.7; the preset's
#      EMA off: the two averages exclude each other);
#   B: B1..B4, default kd (--teacher = phase A's base run, --distill_weight 0.5), all (noise + swa) and wd_ramp (the
#      weight decay held for half the schedule, then ramped to 3x); the teacher is the base run of this call (as many
#      steps as the student): its training seconds are reported beside the kd rows.
# Each An/Bn is "name:flags for recipes/train_gpt.py" on top of --preset $PRESET; an empty one is left out (B1= skips
# the distillation). Phase A's saved models are scored by `hf-cgpu eval` while phase B trains, phase B's after it
# (what is left of the deadline). STEPS (default 200) is what three runs at once are expected to reach in a phase:
# levers.md shows the steps each reached (a run cut by its minutes compares at the last step all reached).
# CORPUS=tenth|third: train on that share of the training split (benchmarks/quality/auto_corpora.py, validation
# unchanged), so a short schedule reaches the many epochs of the 7-minute preset: e.g. CORPUS=third STEPS=600 (about 11
# epochs of a third) puts the levers in the regime they are for; the 200-step default on the whole corpus is ~1 epoch.
# Carried: .whl (../shared/tools/device-wheels.sh) and .data/zh-poetry (a copy of ../shared/data/zh-poetry).
# Writes to $OUT (6 files): levers.md (the table: steps, best validation bits/char and its step, the saved model's
# bits/char as hf-cgpu eval scores it, the train/val gap, first evaluated step at or below TARGET_BPC), levers.json
# (rows and curves), levers.png (validation bits/char by step), levers_minutes.png (plot_zh_curves.py: by minutes,
# shared-GPU minutes), env.txt, logs.tgz. EXTRA: flags for every run (the prep too), e.g. a smaller shape for a CPU
# check of the preset's own flags on the real corpus.
set -u
if [ -z "${SMOKE:-}" ]; then
  source benchmarks/gpu_env.sh --gpu || exit 1
  PRESET=${PRESET:-zh-poetry-modern} DATA=${DATA-.data/zh-poetry} STEPS=${STEPS:-200} EVAL=${EVAL:-20}
  OVERHEAD=${OVERHEAD:-130}  # start-up, a cold compile, the final evaluation, save and continuations of one run
else
  source benchmarks/gpu_env.sh --cpu
  PRESET=${PRESET:-tiny} DATA=${DATA-} STEPS=${STEPS:-12} EVAL=${EVAL:-4} OVERHEAD=${OVERHEAD:-25}
fi
DEADLINE=${DEADLINE:-570} TARGET_BPC=${TARGET_BPC:-5.74} RESERVE=${RESERVE:-45}  # RESERVE > the 25 s of grace below
export TOKENIZERS_PARALLELISM=true TARGET_BPC
OUT=${OUT:-/tmp/levers_out}; W=/tmp/levers; rm -rf $W; mkdir -p "$OUT" $W/eval
if [ -n "${CORPUS:-}" ]; then  # a share of the training split, the validation split whole
  src=${DATA:-../shared/data/zh-poetry}
  python3 benchmarks/quality/auto_corpora.py --src "$src" --out $W/corpora ${SMOKE:+--limit 2000} > /dev/null \
    || { echo "auto_corpora.py failed on $src"; exit 1; }
  DATA=$W/corpora/$CORPUS
  [ -f "$DATA/train.parquet" ] || { echo "CORPUS=$CORPUS: use tenth, third or all"; exit 2; }
fi
A1=${A1-base:} A2=${A2-noise:--input_noise 0.05} A3=${A3-swa:--ema_decay 0 --swa_start 0.7} A4=${A4-}
B1=${B1-kd:--teacher $W/base --distill_weight 0.5} B2=${B2-all:--input_noise 0.05 --ema_decay 0 --swa_start 0.7}
B3=${B3-wd_ramp:--weight_decay_end 3 --weight_decay_hold 0.5}
B4=${B4-}  # e.g. B4="kd_all:--teacher /tmp/levers/base --input_noise 0.05 --ema_decay 0 --swa_start 0.7"
# or the multi-token heads, annealed out by half the schedule: B4="mtp:--mtp_heads 2 --mtp_weight 0.3 --mtp_anneal 0.5"
export A1 A2 A3 A4 B1 B2 B3 B4  # the table names each run's flags
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch,transformers;print('torch',torch.__version__,'transformers',transformers.__version__)"
  echo "PRESET=$PRESET STEPS=$STEPS EVAL=$EVAL DEADLINE=$DEADLINE CORPUS=${CORPUS:-all} DATA=$DATA EXTRA=${EXTRA:-}"
  for v in A1 A2 A3 A4 B1 B2 B3 B4; do [ -n "${!v}" ] && echo "$v=${!v}"; done
} > $OUT/env.txt 2>&1
common=(--preset "$PRESET" ${DATA:+--dataset $DATA} --progress false --checkpointing_steps 0 --max_new_tokens 8
        --max_steps "$STEPS" --fit_schedule_to_time false --eval_steps "$EVAL" ${EXTRA:-})
# the tokenizer and the packed tokens once (the runs below find both in $HF_CGPU_CACHE), without compiling
timeout 200 python3 recipes/train_gpt.py "${common[@]}" --output_dir $W/prep --max_steps 1 --max_minutes 0 \
  --compile false --eval_steps 0 --load_best_at_end false --early_stopping_patience 0 > $W/prep.log 2>&1 \
  || { tail -5 $W/prep.log; exit 1; }
rm -rf $W/prep
echo "prep done at ${SECONDS}s" >> $OUT/env.txt

evaluate() {  # hf-cgpu eval of each named run's saved model, within $1 seconds
  local budget=$1; shift
  for name in "$@"; do
    [ -f $W/$name/model.safetensors ] || continue
    timeout "$budget" python3 -m hf_cgpu.cli eval $W/$name --dataset "${DATA:-builtin}" \
      --output_json $W/eval/$name.json > $W/eval_$name.log 2>&1
  done
}

names=()
phase() {  # phase LABEL VARS...: its runs at once, each stopped by the minutes of the phase's share of what is left
  local label=$1 share=$2; shift 2
  local left=$(( DEADLINE - SECONDS - RESERVE ))  # the last evaluations, the table, the archive
  local budget=$(( left / share ))
  local minutes; minutes=$(python3 -c "print(max(0.1, ($budget - $OVERHEAD) / 60))")
  echo "phase $label: starts at ${SECONDS}s, $budget s, --max_minutes $minutes per run" >> $OUT/env.txt
  local pids=()
  for v in "$@"; do
    [ -z "${!v}" ] && continue
    local name=${!v%%:*} flags=${!v#*:}
    names+=("$name")
    # shellcheck disable=SC2086  # the flags are split on purpose
    timeout $(( budget + 25 )) python3 recipes/train_gpt.py "${common[@]}" --output_dir $W/$name \
      --max_minutes "$minutes" $flags > $W/$name.log 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
}

phase A 2 A1 A2 A3 A4
a_names=("${names[@]}")
evaluate 120 "${a_names[@]}" &  # phase A's saved models, while phase B trains
eval_pid=$!
phase B 1 B1 B2 B3 B4
wait $eval_pid
left=$(( DEADLINE - SECONDS - 15 ))
[ $left -gt 10 ] && evaluate $left "${names[@]:${#a_names[@]}}"
echo "done at ${SECONDS}s" >> $OUT/env.txt

python3 - "$OUT" "$W" "${names[@]}" <<'PY'
import json, os, sys
from pathlib import Path

out, work, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
target = float(os.environ["TARGET_BPC"])
flags = {v.split(":", 1)[0]: v.split(":", 1)[1] for v in (os.environ.get(f"{p}{i}", "") for p in "AB"
                                                           for i in range(1, 5)) if ":" in v}
curves, rows = {}, {}
for name in names:
    row = rows[name] = {"flags": flags.get(name, "").replace(str(work) + "/", "")}
    try:
        hist = json.loads((work / name / "history.json").read_text())
        res = json.loads((work / name / "all_results.json").read_text())
    except (OSError, ValueError) as err:
        row["error"] = str(err)
        continue
    curves[name] = {e["step"]: e["eval/val_bpc"] for e in hist if "eval/val_bpc" in e}
    row.update({k: res.get(k) for k in ("steps", "best_step", "model_step", "val_bpc", "val_loss",
                                        "train_loss_at_model_step", "val_train_gap", "train_seconds",
                                        "seconds_to_first_step", "peak_alloc_gib")})
    scored = work / "eval" / f"{name}.json"
    if scored.is_file():
        row["eval_val_bpc"] = json.loads(scored.read_text()).get("bpc")
    row["first_step_at_target"] = next((s for s in sorted(curves[name]) if s > 0 and curves[name][s] <= target), None)
teacher = rows.get("base", {}).get("train_seconds")
common = set.intersection(*(set(c) for c in curves.values())) if curves else set()
at = max((s for s in common if s > 0), default=None)


def f(x, fmt=".3f"):
    return "-" if x is None else format(x, fmt)


lines = [f"| run | flags | steps | val bits/char at step {at} | best val bits/char (step) | hf-cgpu eval bits/char "
         f"| train/val gap (nats) | first step <= {target} | train s (shared GPU) |", "|---" * 9 + "|"]
for name, r in rows.items():
    c = curves.get(name, {})
    best = min(((b, s) for s, b in c.items() if s > 0), default=(None, None))
    kd = "--teacher" in r["flags"]
    note = " (+ teacher's)" if kd and teacher else ""
    extra_term = kd or "--mtp_heads" in r["flags"]  # its training loss holds the KL or the heads' term
    gap = "-" if extra_term else f(r.get("val_train_gap"))
    lines.append(f"| {name} | `{r['flags']}` | {r.get('steps', '-')} | {f(c.get(at))} | {f(best[0])} ({best[1]}) | "
                 f"{f(r.get('eval_val_bpc'))} | {gap} | {r.get('first_step_at_target') or '-'} | "
                 f"{f(r.get('train_seconds'), '.0f')}{note} |" + (f" error: {r['error']}" if "error" in r else ""))
lines.append("\ntrain/val gap: the saved weights' validation loss minus the training loss of the logging window at "
             "their step (with --input_noise the training loss is on the replaced inputs; a --teacher run's holds the "
             "KL term, an --mtp_heads run's the heads' term until --mtp_anneal, so they have none).")
if teacher:
    lines.append(f"The teacher of the kd runs is the base run of phase A: {teacher:.0f} s of training on the shared "
                 "GPU.")
(out / "levers.md").write_text("\n".join(lines) + "\n")
(out / "levers.json").write_text(json.dumps({"rows": rows, "curves": curves, "compared_at_step": at}, indent=1))
print("\n".join(lines))
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    values = [b for c in curves.values() for s, b in c.items() if s > 0]
    for name, c in curves.items():
        steps = sorted(s for s in c if s > 0)
        ax.plot(steps, [c[s] for s in steps], label=name)
    if values:  # the early evaluations (8 bits/char and more) would flatten the rest
        ax.set_ylim(min(values) - 0.05, min(max(values), min(values) + 1.5) + 0.05)
        if min(values) <= target <= min(values) + 1.5:
            ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("optimizer step (every run on one schedule)"); ax.set_ylabel("validation bits per character")
    ax.legend(); ax.grid(alpha=0.3); fig.tight_layout(); fig.savefig(out / "levers.png", dpi=110)
except ImportError:
    pass
PY
runs=(); for name in "${names[@]}"; do [ -f $W/$name/history.json ] && runs+=(--run "$name=$W/$name"); done
[ ${#runs[@]} -gt 0 ] && python3 benchmarks/quality/plot_zh_curves.py "${runs[@]}" --target "$TARGET_BPC" \
  --out $OUT/levers_minutes.png > $W/plot.log 2>&1
(cd $W && tar -czf $OUT/logs.tgz ./*.log eval)  # ./: a run named -x is not an option
for name in "${names[@]}"; do grep -hE "error|Error|Traceback" $W/$name.log | head -3; done
exit 0
