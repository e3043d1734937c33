#!/usr/bin/env bash
# One GPU call (<= ~9.5 minutes): what a 16 GB card gives in each short preset's minutes, emulated on the lent GPU,
# with the quality reached; and where the zh-poetry-modern step's time goes, against the time ledger's rows.
#
#   device run, carry [".whl", ".data"]:   bash benchmarks/ledger/gpu_emulate16.sh
#   SMOKE=1 OUT=/tmp/emu bash benchmarks/ledger/gpu_emulate16.sh     (the same chain on the CPU at toy sizes)
#
# Emulated (--emulate_card "$CARD", default RTX 5070 Ti): each run trains the steps the ledger gives that card in the
# preset's minutes, its cosine fitted to them, under the card's memory (the allocator capped at 16 GiB less the CUDA
# context). The step counts are fixed, so the runs share the GPU at once and the wall time says nothing:
#   text     zh-poetry-modern (7 min) and --preset auto (7 min, the rule choosing for that card), scored by hf-cgpu eval
#            on the whole validation split (bits/char);
#   images   the flow preset cifar10 (4 min), then flow-distill cifar10 (7 min) from it, scored in the features of a
#            judge classifier trained here (FD, precision, recall, rarest class share; 5,000 images against 10,000
#            training images), the flow model at its saved sampler, the student at 1 and 2 evaluations.
# Before them, alone on the GPU: `hf-cgpu bench`, `hf-cgpu budget --preset zh-poetry-modern` on this card (the ledger's
# rows) and benchmarks/tools/gpu_gpt_profile.py --preset zh-poetry-modern (the step's device time by kind of kernel).
# Writes to $OUT: emulate16.md (the table), emulate16.json, budget_modern.txt, profile/ (profile.json, its log),
# logs.tgz, env.txt.
set -u
if [ -z "${SMOKE:-}" ]; then
  source benchmarks/gpu_env.sh --gpu || exit 1
  CARD=${CARD:-RTX 5070 Ti} TEXT_DATA=.data/zh-poetry IMG_DATA=.data/cifar10 DEADLINE=${DEADLINE:-560}
  ZH=(--preset zh-poetry-modern) AUTO=(--preset auto --max_minutes 7)
  FLOW=(--preset cifar10 --max_minutes 4) DISTILL=(--preset cifar10 --max_minutes 7)
  CLF=(--preset cifar10) IMAGES=5000 REF=(--split train --real_limit 10000) PROFILE=(--preset zh-poetry-modern)
else
  source benchmarks/gpu_env.sh --cpu
  CARD=${CARD:-RTX 3060} TEXT_DATA="" IMG_DATA=${IMG_DATA:-../shared/data/cifar10} DEADLINE=${DEADLINE:-1500}
  ZH=(--preset tiny --max_minutes 0.002 --compile false) AUTO=(--preset auto --max_minutes 0.01 --compile false)
  FLOW=(--preset tiny --limit 256 --max_minutes 0.002) DISTILL=(--preset tiny --limit 64 --max_minutes 0.005)
  CLF=(--preset tiny --max_steps 5) IMAGES=40 REF=(--split train --real_limit 300) PROFILE=(--smoke)
fi
OUT=${OUT:-/tmp/emu_out}; W=/tmp/emulate16; rm -rf $W; mkdir -p "$OUT" $W
export TOKENIZERS_PARALLELISM=true
mark() { echo "${SECONDS}s $*" >> "$OUT/env.txt"; }
left() { local l=$(( DEADLINE - SECONDS )); echo $(( l > 5 ? l : 5 )); }
EMU=(--emulate_card "$CARD" --progress false)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch,transformers,diffusers,accelerate;print('torch',torch.__version__,'transformers',transformers.__version__,'diffusers',diffusers.__version__,'accelerate',accelerate.__version__)"
  echo "CARD=$CARD"
  [ -n "$IMG_DATA" ] && python3 -c "from hf_cgpu.data.images import load_image_dataset as f; [f('$IMG_DATA', s) for s in ('train', 'test')]"
} > "$OUT/env.txt" 2>&1
[ -z "${SMOKE:-}" ] && { timeout 40 python3 -m hf_cgpu.cli bench >> "$OUT/env.txt" 2>&1; mark "bench"; }

# alone on the GPU: the ledger's rows for the modern step on this card, and the step's profile
timeout 120 python3 -m hf_cgpu.cli budget "${ZH[@]}" ${TEXT_DATA:+--dataset $TEXT_DATA} > "$OUT/budget_modern.txt" 2>&1
timeout 150 python3 benchmarks/tools/gpu_gpt_profile.py "${PROFILE[@]}" --out "$OUT/profile" > $W/profile.log 2>&1
cp $W/profile.log "$OUT/profile/" 2>/dev/null
mark "profiled"

# the emulated runs, at once
text_data=(${TEXT_DATA:+--dataset $TEXT_DATA})
timeout "$(left)" python3 recipes/train_gpt.py "${ZH[@]}" "${EMU[@]}" "${text_data[@]}" --output_dir $W/zh \
  > $W/zh.log 2>&1 &
zh_pid=$!
timeout "$(left)" python3 recipes/train_gpt.py "${AUTO[@]}" "${EMU[@]}" "${text_data[@]}" --output_dir $W/auto \
  > $W/auto.log 2>&1 &
auto_pid=$!
timeout "$(left)" python3 recipes/train_classifier.py "${CLF[@]}" --dataset "$IMG_DATA" --output_dir $W/clf \
  --progress false > $W/clf.log 2>&1 &
clf_pid=$!
( timeout "$(left)" python3 recipes/train_flow.py "${FLOW[@]}" "${EMU[@]}" --dataset "$IMG_DATA" --output_dir $W/flow \
    --sample_every_epochs 0 > $W/flow.log 2>&1
  timeout "$(left)" python3 recipes/train_flow_distill.py "${DISTILL[@]}" "${EMU[@]}" --teacher $W/flow \
    --dataset "$IMG_DATA" --output_dir $W/distill > $W/distill.log 2>&1 ) &
img_pid=$!
wait $zh_pid $auto_pid
mark "text runs trained"
for run in zh auto; do
  [ -f $W/$run/model.safetensors ] && timeout "$(left)" python3 -m hf_cgpu.cli eval $W/$run \
    --dataset "${TEXT_DATA:-builtin}" --output_json $W/eval_$run.json > $W/eval_$run.log 2>&1
done
mark "text runs scored"
wait $clf_pid $img_pid
mark "image runs trained"
EV=(--classifier $W/clf --dataset "$IMG_DATA" "${REF[@]}" --num_images "$IMAGES" --progress false)
[ -n "${SMOKE:-}" ] && EV+=(--batch_size 20)
[ -f $W/flow/model_index.json ] && timeout "$(left)" python3 -m hf_cgpu.cli eval $W/flow "${EV[@]}" \
  --output_dir $W/eval_flow --output_json $W/eval_flow.json > $W/eval_flow.log 2>&1
mark "flow scored"
for n in 1 2; do
  [ -f $W/distill/model_index.json ] && timeout "$(left)" python3 -m hf_cgpu.cli eval $W/distill "${EV[@]}" \
    --num_inference_steps $n --output_dir $W/eval_distill$n --output_json $W/eval_distill$n.json \
    > $W/eval_distill$n.log 2>&1
done
mark "student scored"

python3 - "$OUT" "$W" "$CARD" <<'PY'
import json, sys
from pathlib import Path

out, work, card = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]


def read(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


rows = []
for name, run, evals in (("zh-poetry-modern", "zh", ["eval_zh"]), ("--preset auto", "auto", ["eval_auto"]),
                         ("flow cifar10", "flow", ["eval_flow"]),
                         ("flow-distill cifar10", "distill", ["eval_distill1", "eval_distill2"])):
    res, cfg = read(work / run / "all_results.json"), read(work / run / "config.json")
    led = res.get("ledger") or {}
    for ev in evals:
        e = read(work / f"{ev}.json")
        row = {"job": name, "run": run, "steps": res.get("steps"), "minutes": led.get("minutes"),
               "predicted_reserved_gib": led.get("reserved_gib"), "reserved_gib": res.get("peak_reserved_gib"),
               "params": res.get("num_params") or res.get("params"), "eval": ev,
               "shape": f"{cfg.get('n_layer')} x {cfg.get('n_embd')}" if "n_layer" in cfg else None}
        if run in ("zh", "auto"):
            row.update(bits_per_char=e.get("bpc"), val_bpc_in_run=res.get("val_bpc"))
        else:
            row.update({k: e.get(k) for k in ("fd", "precision", "recall", "class_share_min", "nfe_per_image",
                                               "scheduler", "num_inference_steps", "guidance_scale")})
        rows.append(row)


def f(x, fmt=".3f"):
    return "-" if x is None else format(x, fmt)


lines = [f"| job ({card}, emulated) | minutes | steps | model | reserved GiB (ledger) | figure |", "|---" * 6 + "|"]
for r in rows:
    if "bits_per_char" in r:
        fig = f"{f(r['bits_per_char'])} bits/char (hf-cgpu eval, validation)"
    else:
        fig = (f"FD {f(r.get('fd'), '.1f')}, precision {f(r.get('precision'))}, recall {f(r.get('recall'))}, "
               f"rarest class {f(r.get('class_share_min'), '.3f')} at {r.get('nfe_per_image') or '-'} evaluations")
    lines.append(f"| {r['job']} | {r['minutes'] or '-'} | {r['steps'] or '-'} | {r['shape'] or '-'} | "
                 f"{f(r['reserved_gib'], '.2f')} ({f(r['predicted_reserved_gib'], '.2f')}) | {fig} |")
(out / "emulate16.md").write_text("\n".join(lines) + "\n")
(out / "emulate16.json").write_text(json.dumps(rows, indent=1))
print("\n".join(lines))
PY
for run in zh auto flow distill; do grep -hE "emulating|ledger|preset auto|auto:|schedule" $W/$run.log | head -6; done
(cd $W && tar -czf "$OUT/logs.tgz" ./*.log ./*.json 2>/dev/null)
mark "done"
exit 0
