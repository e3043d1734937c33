"""Validation bits per character against minutes of training, one line per run, and the time each run took to reach a
quality (the seed recipe's 7-minute 5.74 by default), from the run folders' history.json and all_results.json.

    python benchmarks/quality/plot_zh_curves.py --run "preset=RESULTS_DIR_A" --run "+value embeddings=DIR_B" \
        --out curves.png [--target 5.74]

Minutes are the loop's own clock after the first step (its compile left out): a step's time is
the run's training seconds after the first step spread evenly over the steps after it (the runs log no per-step
clock; the evaluations and best-weight saves, which are in those seconds, are spread with them). The time to the target
is interpolated linearly between the two evaluations around the crossing; the table also gives it in steps alone
(the crossing step times the steady step time of the logging windows, which leave out evaluation and saving, the
first window, which holds the compile, left out too).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(folder: Path) -> tuple[list[tuple[int, float]], float, int]:
    """(step, val bits/char) of every evaluation after step 0, seconds per step, steps of the run. ``folder`` is a
    run folder (history.json, all_results.json), a folder with the seed recipe's seed_text_results.json (its
    evaluations carry their minutes), or ``FILE.json:KEY@TOK_PER_S`` (a curve of (tokens, bits/char) pairs under KEY,
    e.g. 2026-12-01-zh-poetry-vs-seed/zh_poetry_val_bpc.json, timed at the run's measured tokens per second)."""
    if "@" in str(folder):  # a token curve: tokens -> seconds at the measured rate, one "step" per second
        path, rate = str(folder).rsplit("@", 1)
        file, key = path.split(":", 1)
        pairs = json.loads(Path(file).read_text())[key]
        curve = [(round(tokens / float(rate)) + 1, bpc) for tokens, bpc in pairs]
        return curve, 1.0, 0  # 0: no step count (the curve is timed, not stepped)
    if (folder / "seed_text_results.json").is_file():  # minutes from the seed script's own clock
        res = json.loads((folder / "seed_text_results.json").read_text())
        curve = [(round(e["minutes"] * 60) + 1, e["bpc"]) for e in res["history"]]
        return curve, 1.0, 0
    hist = json.loads((folder / "history.json").read_text())
    res = json.loads((folder / "all_results.json").read_text())
    curve = sorted((e["step"], e["eval/val_bpc"]) for e in hist if "eval/val_bpc" in e and e["step"] > 0)
    steps = int(res["steps"])
    # the first step (its compile) is left out: the axis counts training after it
    first = float(res.get("seconds_to_first_step") or 0.0)
    per_step = (float(res["train_seconds"]) - first) / max(1, steps - 1)
    return curve, per_step, steps


def steady_seconds_per_step(folder: Path) -> float | None:
    """Median seconds per step of a run folder's logging windows after the first (None: no such windows)."""
    try:
        hist = json.loads((folder / "history.json").read_text())
        res = json.loads((folder / "all_results.json").read_text())
    except (OSError, ValueError):
        return None
    tokens = res["micro_batch_size"] * res["gradient_accumulation_steps"] * res["settings"]["seq_len"]
    tokens *= res.get("processes", 1)
    windows = [(e["step"], e["train/tok_per_s"]) for e in hist if "train/tok_per_s" in e]
    per_step = sorted(tokens / rate for (_, rate) in windows[1:])
    return per_step[len(per_step) // 2] if per_step else None


def seconds_to(curve: list[tuple[int, float]], per_step: float, target: float) -> float | None:
    """Training seconds after the first step at which validation first reaches ``target`` (None: never)."""
    prev = None
    for step, bpc in curve:
        if bpc <= target:
            if prev is None:
                return (step - 1) * per_step
            (s0, b0), frac = prev, (prev[1] - target) / (prev[1] - bpc)
            return (s0 + frac * (step - s0) - 1) * per_step
        prev = (step, bpc)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, help="LABEL=FOLDER (a run folder or its copied files)")
    p.add_argument("--out", required=True, help="the plot (.png)")
    p.add_argument("--target", type=float, default=5.74, help="bits/char whose crossing time is reported")
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    lowest = 9.0
    print(f"| run | steps | s per step | best val bits/char (step) | last | seconds to {a.target} | in steps alone |")
    print("|---|---|---|---|---|---|---|")
    for spec in a.run:
        label, folder = spec.split("=", 1)
        curve, per_step, steps = load(Path(folder))
        ax.plot([(s - 1) * per_step / 60 for s, _ in curve], [b for _, b in curve], label=label)
        best = min(curve, key=lambda e: e[1])
        lowest = min(lowest, best[1])
        hit = seconds_to(curve, per_step, a.target)
        rate, at = (f"{per_step:.4f}", best[0]) if steps else ("-", f"{best[0] - 1} s")  # a timed curve: seconds
        steady = steady_seconds_per_step(Path(folder)) if steps else None
        alone = seconds_to(curve, steady, a.target) if steady else None
        print(f"| {label} | {steps or '-'} | {rate} | {best[1]:.3f} ({at}) | {curve[-1][1]:.3f} | "
              f"{'-' if hit is None else f'{hit:.0f}'} | {'-' if alone is None else f'{alone:.0f}'} |")
    ax.axhline(a.target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("minutes of training (after the first step)")
    ax.set_ylabel("validation bits per character")
    ax.set_ylim(lowest - 0.1, 6.5)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # beside the curves, never over them
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
