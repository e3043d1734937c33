"""The few-step table: FD / precision / recall / class balance by sampler x network evaluations x guidance
setting, for a base flow pipeline and its distilled student, in one classifier's features (benchmarks/quality/
gpu_fewstep.sh runs it; see there).

Autoguidance rows (``hf_cgpu.flow.guide``: v_weak + w (v - v_weak), the same class through both models) guide each
pipeline by a weaker version of itself: its raw (non-EMA) weights of the same step, and an early checkpoint of its run
(the one nearest --early_fraction of its steps: the runs keep their checkpoints for it), at --ag_scales, Heun at
--ag_base evaluations for the base (full and --intervals) and Euler at --ag_distilled for the distilled pipeline.

Rows are planned from the samplers' own evaluation counts (``steps_within``; a guided call counts two, a call outside
the guidance interval one) and run in priority order (the distilled pipeline at 1 and 2 evaluations first, then the
base at 10, ...). Each finished row is appended to WORK/table.json and rewritten into OUT/fewstep.md, and its picture
grid goes into OUT/grids.tar, so a call cut by its deadline keeps every finished row, and a second call with the same
WORK skips them. The reference is the classifier's features of --split (train, the first 10,000 images: the issue's
reference); the test split scored against it is the ceiling row. --seed_eval adds the seed recipe's row (an
``hf-cgpu eval`` JSON made with the same reference) and the targets relative to it. --guided adds a student
distilled with --guidance_range at --guided_evaluations x --guided_scales, first: its guidance scale is its input
(one network evaluation a step at every w), so its rows cost what the unguided rows do.

    python benchmarks/quality/fewstep_table.py --classifier /tmp/clf --dataset .data/cifar10 --base /tmp/ours \
        --distilled /tmp/distill --seed_eval /tmp/fewstep/seed_eval.json --work /tmp/fewstep --out $OUT
"""

from __future__ import annotations

import argparse
import json
import tarfile
import time
from pathlib import Path

import torch

from hf_cgpu.evaluation.classifier import load_classifier
from hf_cgpu.evaluation.flow import (ImageEvalSettings, evaluate_pipeline, grid_name, load_pipeline, load_real_images,
                                     real_reference, save_grid)
from hf_cgpu.evaluation.images import (feature_statistics, frechet_distance, image_features, kth_neighbour_radii,
                                       precision_recall)
from hf_cgpu.flow.samplers import evaluations_per_image, format_interval, parse_interval, steps_within
from hf_cgpu.flow.guide import weight_variants
from hf_cgpu.train.checkpoint import list_checkpoints, step_of

KEYS = ["model", "sampler", "steps", "guidance", "guide", "nfe_per_image", "fd", "fd_vs_seed", "precision", "recall",
        "class_share_min", "class_share_max", "classes_within_30pct", "num_images"]


GUIDES = ("raw", "early")
"""The weak models of the autoguidance rows: the pipeline's raw weights, and an early checkpoint of its run."""


def _fits(e: int, sampler: str, w: float, interval) -> int | None:
    """The most steps of ``sampler`` within ``e`` evaluations, or None where no distinct row fits: a guided row
    over budget (1 evaluation), Heun 1 (= Euler 1), an interval that guides no call (= the unguided row)."""
    steps = steps_within(e, sampler, w, interval)
    cost = evaluations_per_image(sampler, steps, w, interval)
    if cost > e or (sampler == "heun" and steps == 1) or (w != 1 and cost == evaluations_per_image(sampler, steps)):
        return None
    return steps


def plan(evaluations: list[int], scale: float, intervals: list, distilled: bool, ag_scales: tuple = (),
         ag_base: tuple = (), ag_distilled: tuple = (), gan: bool = False, guided: tuple = ()) -> list[tuple]:
    """(model, sampler, steps, scale, interval, guide) rows in the order they run (guide None: the null class, or no
    guidance at scale 1): the guidance-input student's (``guided``: (evaluations, scales), Euler, one evaluation a
    step at any w) first, the distilled pipeline's rows at the fewest evaluations (and its adversarial stage's,
    ``gan``) and its autoguided ones, then the base pipeline's at 10, 4, 20, 2, 1 evaluations, each followed by its
    autoguided rows."""
    rows = [("guided", "euler", e, w, None, None) for e in guided[0] for w in guided[1]] if guided else []
    if distilled:
        rows += [("distilled", "euler", e, 1.0, None, None) for e in evaluations]
    if gan:
        rows += [("distilled_gan", "euler", e, 1.0, None, None) for e in evaluations]
    if distilled:
        rows += [("distilled", "euler", steps, w, None, g) for e in ag_distilled for g in GUIDES for w in ag_scales
                 if (steps := _fits(e, "euler", w, None))]
    order = sorted(evaluations, key=lambda e: (e != 10, e != 4, e != 20, -e))
    for e in order:
        for sampler in ("heun", "euler"):
            for w, interval in [(1.0, None), (scale, None)] + [(scale, i) for i in intervals]:
                if steps := _fits(e, sampler, w, interval):
                    rows.append(("base", sampler, steps, w, interval, None))
        if e in ag_base:
            rows += [("base", "heun", steps, w, i, g) for g in GUIDES for w in ag_scales for i in [None, *intervals]
                     if (steps := _fits(e, "heun", w, i))]
    return list(dict.fromkeys(rows))


def early_checkpoint(run: Path, fraction: float) -> Path | None:
    """The checkpoint of ``run`` before its last step nearest ``fraction`` of its steps (None: it kept none)."""
    final = json.loads((run / "all_results.json").read_text())["steps"]
    earlier = [c for c in list_checkpoints(run) if step_of(c) < final]
    return min(earlier, key=lambda c: abs(step_of(c) - fraction * final)) if earlier else None


def ceiling(classifier, real: dict, s: ImageEvalSettings, k: int) -> dict:
    """The test split scored as if generated, against the same reference: the best a generator can do here."""
    test = load_real_images(ImageEvalSettings(classifier=s.classifier, dataset=s.dataset, split="test"))
    feats, _ = image_features(classifier, test.images, batch_size=s.batch_size)
    device = next(classifier.parameters()).device
    radii = kth_neighbour_radii(real["features"].to(device, torch.float32), k)
    precision, recall = precision_recall(real["features"], feats, k=k, device=device, real_radii=radii)
    return {"model": "CIFAR-10 test split (ceiling)", "sampler": "-", "steps": 0, "guidance": "-",
            "nfe_per_image": 0, "fd": frechet_distance(real["mu"], real["sigma"], *feature_statistics(feats)),
            "precision": precision, "recall": recall, "num_images": len(feats)}


def class_rows_grid(images, num_classes: int | None, path: Path, per_class: int = 10) -> Path:
    """The first ``per_class`` images of each class (labels in turn, as ``generate_images`` draws them), one row per
    class, so a reader sees each class's variety."""
    if not num_classes:
        return save_grid(images[: per_class * per_class], path, per_class)
    order = [k + num_classes * j for k in range(num_classes) for j in range(per_class)
             if k + num_classes * j < len(images)]
    return save_grid(images[order], path, len(order) // num_classes)


def write(rows: list[dict], seed: dict | None, out: Path) -> None:
    def cell(v):
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(KEYS) + " |", "|" + "---|" * len(KEYS)]
    for r in ([seed] if seed else []) + rows:
        lines.append("| " + " | ".join(cell(r.get(k)) for k in KEYS) + " |")
    (out / "fewstep.md").write_text("\n".join(lines) + "\n")


def balanced(histogram: list[int]) -> bool:
    """Every class within 30% of the uniform share."""
    k, n = len(histogram), sum(histogram)
    return all(0.7 / k <= c / n <= 1.3 / k for c in histogram)


def seed_row(path: str) -> dict | None:
    if not path or not Path(path).is_file():
        return None
    e = json.loads(Path(path).read_text())
    return {"classes_within_30pct": balanced(e["class_histogram"]), "model": "seed recipe (EMA)", "sampler": e["scheduler"], "steps": e["num_inference_steps"],
            "guidance": "none", **{k: e.get(k) for k in ("nfe_per_image", "fd", "precision", "recall",
                                                        "class_share_min", "class_share_max", "num_images")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classifier", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--base", required=True, help="the flow run (EMA weights as saved)")
    p.add_argument("--distilled", default="", help="the flow-distill run")
    p.add_argument("--gan", default="",
                   help="its adversarial stage (flow-distill --init_student ... --adversarial_weight)")
    p.add_argument("--guided", default="", help="a flow-distill run with --guidance_range (the scale as its input)")
    p.add_argument("--guided_evaluations", default="1,2", help="evaluations of the --guided rows")
    p.add_argument("--guided_scales", default="1,1.5,2,2.5", help="guidance scales of the --guided rows")
    p.add_argument("--seed_eval", default="")
    p.add_argument("--work", required=True, help="where finished rows are kept between calls")
    p.add_argument("--out", required=True)
    p.add_argument("--split", default="train")
    p.add_argument("--real_limit", type=int, default=10000)
    p.add_argument("--num_images", type=int, default=5000)
    p.add_argument("--batch_size", type=int, default=1000)
    p.add_argument("--evaluations", default="1,2,4,10,20")
    p.add_argument("--guidance_scale", type=float, default=2.5)
    p.add_argument("--intervals", default="0.25:0.8", help="comma-separated LO:HI guidance intervals")
    p.add_argument("--ag_scales", default="1.5,2,3", help="autoguidance weights w (empty: no autoguided rows)")
    p.add_argument("--ag_base", default="10,20", help="evaluations of the base pipeline's autoguided (Heun) rows")
    p.add_argument("--ag_distilled", default="2,4", help="evaluations of the distilled pipeline's autoguided rows")
    p.add_argument("--early_fraction", type=float, default=0.25,
                   help="the early checkpoint guiding a pipeline: the one nearest this fraction of its run's steps")
    p.add_argument("--deadline", type=float, default=0.0, help="unix time after which no row starts (0 = none)")
    p.add_argument("--row_seconds", type=float, default=20.0, help="a row starts only this long before --deadline")
    a = p.parse_args()

    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = ImageEvalSettings(classifier=a.classifier, dataset=a.dataset, split=a.split, real_limit=a.real_limit,
                          batch_size=a.batch_size, num_images=a.num_images)
    classifier = load_classifier(a.classifier, device)
    real = real_reference(classifier, a.classifier, s)
    state = work / "table.json"
    rows = json.loads(state.read_text()) if state.is_file() else []
    if not any(r["model"].startswith("CIFAR-10 test") for r in rows):
        rows.append(ceiling(classifier, real, s, 3))
    seed = seed_row(a.seed_eval)
    for r in rows:  # rows kept from a call before the anchor was scored get their ratio now
        if seed and r.get("fd") is not None:
            r["fd_vs_seed"] = r["fd"] / seed["fd"]
    done = {(r["model"], r["sampler"], r["steps"], r["guidance"], r.get("guide", "null class")) for r in rows}
    intervals = [parse_interval(i) for i in a.intervals.split(",") if i.strip()]
    pipes = {"base": a.base, **({"distilled": a.distilled} if a.distilled else {}),
             **({"distilled_gan": a.gan} if a.gan else {}), **({"guided": a.guided} if a.guided else {})}
    guides = {(m, "raw"): "raw" if weight_variants(Path(d))[0].get("raw") else None for m, d in pipes.items()}
    guides.update({(m, "early"): early_checkpoint(Path(d), a.early_fraction) for m, d in pipes.items()})
    loaded = {}
    grids = work / "grids"
    ints = lambda text: tuple(int(e) for e in text.split(",") if e.strip())  # noqa: E731
    for model, sampler, steps, w, interval, g in plan(
            list(ints(a.evaluations)), a.guidance_scale, intervals, bool(a.distilled),
            tuple(float(x) for x in a.ag_scales.split(",") if x.strip()), ints(a.ag_base), ints(a.ag_distilled),
            bool(a.gan), (ints(a.guided_evaluations), tuple(float(x) for x in a.guided_scales.split(",")))
            if a.guided else ()):
        guidance = "none" if w == 1 else f"{w:g}, t in {format_interval(interval)}"
        spec = guides.get((model, g)) if g else ""
        guide = "-" if w == 1 else "null class" if not g else f"early ({spec.name})" if g == "early" and spec else g
        if model == "guided":  # the scale is the student's input: one call a step, no null-class rows
            guidance, guide = f"{w:g} (input)", "-"
        if (model, sampler, steps, guidance, guide) in done:
            continue
        if g and not spec:
            print(f"no {g} guide for {model} (its run kept no checkpoint for it): row left out")
            continue
        if a.deadline and time.time() > a.deadline - a.row_seconds:
            print(f"deadline: {model} {sampler} {steps} {guidance} {guide} and later rows left for the next call")
            break
        if (model, g) not in loaded:
            loaded[model, g] = load_pipeline(Path(pipes[model]), None, device, str(spec) if g else "none")
        name = grid_name(g or "saved", sampler, steps, w, interval)
        r = evaluate_pipeline(loaded[model, g], classifier, real, a.num_images, sampler, steps, w, a.batch_size,
                              mixed_precision="auto", progress=False, guidance_interval=interval, return_images=True)
        r["grid"] = str(class_rows_grid(r.pop("images"), loaded[model, g].unet.config.num_classes,
                                        grids / f"{model}_{name}"))
        row = {"model": model, "sampler": sampler, "steps": steps, "guidance": guidance, "guide": guide, **r}
        row["fd_vs_seed"] = row["fd"] / seed["fd"] if seed else None
        row["classes_within_30pct"] = balanced(r["class_histogram"])
        rows.append(row)
        state.write_text(json.dumps(rows, indent=1))
        print(" ".join(f"{key}={row.get(key)}" for key in KEYS), flush=True)
        write(rows, seed, out)
        with tarfile.open(out / "grids.tar", "w") as tar:
            tar.add(grids, arcname="grids")
    state.write_text(json.dumps(rows, indent=1))
    write(rows, seed, out)
    (out / "fewstep.json").write_text(json.dumps({"seed": seed, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
