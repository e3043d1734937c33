"""The few-step table of issue 35: FD / precision / recall / class balance by sampler x network evaluations x guidance
setting, for a base flow pipeline and its distilled student, in one classifier's features (benchmarks/quality/
gpu_fewstep.sh runs it; see there).

Rows are planned from the samplers' own evaluation counts (``steps_within``; a guided call counts two, a call outside
the guidance interval one) and run in priority order (the distilled pipeline at 1 and 2 evaluations first, then the
base at 10, ...). Each finished row is appended to WORK/table.json and rewritten into OUT/fewstep.md, and its picture
grid goes into OUT/grids.tar, so a call cut by its deadline keeps every finished row, and a second call with the same
WORK skips them. The reference is the classifier's features of --split (train, the first 10,000 images: the issue's
reference); the test split scored against it is the ceiling row. --seed_eval adds the seed recipe's row (an
``hf-cgpu eval`` JSON made with the same reference) and the targets relative to it.

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
                                     real_reference)
from hf_cgpu.evaluation.images import (feature_statistics, frechet_distance, image_features, kth_neighbour_radii,
                                       precision_recall)
from hf_cgpu.flow.samplers import evaluations_per_image, format_interval, parse_interval, steps_within

KEYS = ["model", "sampler", "steps", "guidance", "nfe_per_image", "fd", "fd_vs_seed", "precision", "recall",
        "class_share_min", "class_share_max", "classes_within_30pct", "num_images"]


def plan(evaluations: list[int], scale: float, intervals: list, distilled: bool) -> list[tuple]:
    """(model, sampler, steps, scale, interval) rows in the order they run: the distilled pipeline's rows at the
    fewest evaluations first, then the base pipeline's at 10, 4, 20, 2, 1 evaluations."""
    rows = []
    if distilled:
        rows += [("distilled", "euler", e, 1.0, None) for e in evaluations]
    order = sorted(evaluations, key=lambda e: (e != 10, e != 4, e != 20, -e))
    for e in order:
        for sampler in ("heun", "euler"):
            for w, interval in [(1.0, None), (scale, None)] + [(scale, i) for i in intervals]:
                steps = steps_within(e, sampler, w, interval)
                cost = evaluations_per_image(sampler, steps, w, interval)
                if cost > e:  # a guided 1-evaluation row cannot fit
                    continue
                if (sampler == "heun" and steps == 1) or (w != 1 and cost == evaluations_per_image(sampler, steps)):
                    continue  # Heun 1 is Euler 1; an interval that guides no call is the unguided row
                rows.append(("base", sampler, steps, w, interval))
    return list(dict.fromkeys(rows))


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
    done = {(r["model"], r["sampler"], r["steps"], r["guidance"]) for r in rows}
    intervals = [parse_interval(i) for i in a.intervals.split(",") if i.strip()]
    pipes = {"base": a.base, **({"distilled": a.distilled} if a.distilled else {})}
    loaded = {}
    grids = work / "grids"
    for model, sampler, steps, w, interval in plan([int(e) for e in a.evaluations.split(",")], a.guidance_scale,
                                                   intervals, bool(a.distilled)):
        guidance = "none" if w == 1 else f"{w:g}, t in {format_interval(interval)}"
        if (model, sampler, steps, guidance) in done:
            continue
        if a.deadline and time.time() > a.deadline - a.row_seconds:
            print(f"deadline: {model} {sampler} {steps} {guidance} and later rows left for the next call")
            break
        if model not in loaded:
            loaded[model] = load_pipeline(Path(pipes[model]), None, device)
        r = evaluate_pipeline(loaded[model], classifier, real, a.num_images, sampler, steps, w, a.batch_size,
                              mixed_precision="auto", progress=False, guidance_interval=interval,
                              grid_path=grids / f"{model}_{grid_name('saved', sampler, steps, w, interval)}")
        row = {"model": model, "sampler": sampler, "steps": steps, "guidance": guidance, **r}
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
