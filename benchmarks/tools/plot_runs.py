"""Validation curves of several runs in one figure, from their ``history.json`` files:

    python benchmarks/tools/plot_runs.py --out benchmarks/quality/results/2026-12-01-ema/zh_poetry_ema.png \
        "no EMA=benchmarks/quality/results/2026-12-01-fitted-cosine/wd025" \
        "EMA 0.999=benchmarks/quality/results/2026-12-01-ema/ema999"

Left: validation bits per character (or the first ``eval/`` metric found) by optimizer step; right: the same by
training tokens (runs with different batches compare there). Each label is marked at its best point."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def curves(folder: Path, metric: str) -> tuple[list[int], list[float], list[float]]:
    """(steps, tokens, values) of ``metric`` in ``folder/history.json``; tokens at the run's mean tokens per step
    (``all_results.json``: toks_seen / steps)."""
    history = json.loads((folder / "history.json").read_text())
    results = json.loads((folder / "all_results.json").read_text())
    per_step = results["toks_seen"] / max(results["steps"], 1)
    rows = [r for r in history if metric in r]
    return [r["step"] for r in rows], [r["step"] * per_step for r in rows], [r[metric] for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=FOLDER (a run's output folder or a copy of its files)")
    parser.add_argument("--metric", default="eval/val_bpc")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--after", type=int, default=0, help="only steps from this one (zoom on the end)")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5))
    for spec in args.runs:
        label, sep, folder = spec.partition("=")
        if not sep or not (Path(folder) / "history.json").is_file():
            print(f"error: {spec!r} is not LABEL=FOLDER with a history.json in FOLDER", file=sys.stderr)
            return 2
        steps, tokens, values = curves(Path(folder), args.metric)
        keep = [i for i, s in enumerate(steps) if s >= args.after]
        best = min(range(len(values)), key=values.__getitem__)
        text = f"{label} (best {values[best]:.3f} at step {steps[best]:,})"
        by_step.plot([steps[i] for i in keep], [values[i] for i in keep], marker=".", label=text)
        by_tokens.plot([tokens[i] / 1e6 for i in keep], [values[i] for i in keep], marker=".", label=label)
    by_step.set(xlabel="optimizer step", ylabel=args.metric)
    by_tokens.set(xlabel="training tokens (M)", ylabel=args.metric)
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
