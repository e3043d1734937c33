"""Where a recipe's own step goes, loop included: runs ``recipes/<name>.py ARGS`` unchanged, with torch.profiler
attached by a global optimizer-step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``), so the
profiled window is ``--active`` whole optimizer steps after ``--skip`` steps (compile, warm-up), data loading, EMA,
guards, logging and checkpoint bookkeeping included. ``gpu_gpt_profile.py`` profiles an isolated step; the gap
between the two is the loop's cost.

Prints and writes to ``--out`` (profile.json): wall ms per step, device busy ms per step, the gap (the GPU waiting
for the host), the top kernels by device time and the top CPU ops by self time (what the host does between steps).

GPU:   python benchmarks/tools/profile_recipe.py --out $OUT/loop_profile -- recipes/train_flow.py --preset cifar10 \
           --dataset .data/cifar10 --max_steps 80 --output_dir /tmp/run
CPU:   python benchmarks/tools/profile_recipe.py --skip 2 --active 2 --out /tmp/lp -- recipes/train_flow.py --preset tiny \
           --dataset DIR --max_steps 6 --output_dir /tmp/run     (checks the script only; no figure to quote)
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gpt_profile import kernel_rows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip", type=int, default=50, help="optimizer steps before the profiled window")
    p.add_argument("--active", type=int, default=10, help="optimizer steps profiled")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--out", default="loop_profile")
    p.add_argument("recipe", nargs=argparse.REMAINDER, help="-- recipes/NAME.py ARGS")
    a = p.parse_args()
    recipe = [w for w in a.recipe if w != "--"][:1]
    if not recipe:
        p.error("name the recipe after --, e.g. -- recipes/train_flow.py --preset cifar10 ...")
    argv = a.recipe[a.recipe.index(recipe[0]):]
    cuda = torch.cuda.is_available()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    state = {"n": 0, "prof": None, "t0": None, "wall": None, "stamps": []}

    def hook(optimizer, args, kwargs):
        state["n"] += 1
        n = state["n"]
        state["stamps"].append(time.perf_counter())
        if n == a.skip:
            if cuda:
                torch.cuda.synchronize()
            state["prof"] = torch.profiler.profile(activities=acts)
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        elif n == a.skip + a.active and state["prof"] is not None:
            if cuda:
                torch.cuda.synchronize()
            state["wall"] = time.perf_counter() - state["t0"]
            state["prof"].__exit__(None, None, None)

    handle = register_optimizer_step_post_hook(hook)
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        handle.remove()
    prof = state["prof"]
    if prof is None or state["wall"] is None:
        sys.exit(f"the run took {state['n']} optimizer steps, fewer than --skip {a.skip} + --active {a.active}: "
                 "raise --max_steps")
    wall_ms = state["wall"] * 1e3
    rows, busy, shares = kernel_rows(prof, cuda) if cuda else ([], 0.0, {})
    cpu = sorted(({"name": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
                  for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda r: -r["self_ms"])
    stamps = state["stamps"]
    after = stamps[a.skip + a.active:]
    gaps = sorted(b - x for x, b in zip(after, after[1:]))
    steps = a.active
    summary = {
        "device": torch.cuda.get_device_name() if cuda else "CPU (the script only, no figure to quote)",
        "torch": torch.__version__, "recipe": argv, "skip": a.skip, "profiled_steps": steps,
        "wall_ms_per_step": wall_ms / steps,
        "device_busy_ms_per_step": busy / steps if cuda else None,
        "gap_share": max(0.0, wall_ms - busy) / wall_ms if cuda else None,
        "unprofiled_step_ms_median": 1e3 * gaps[len(gaps) // 2] if gaps else None,
        "device_shares_of_wall": {k: v / wall_ms for k, v in shares.items()},
        "top_kernels": [{**r, "ms_per_step": r["ms"] / steps} for r in rows[: a.top]],
        "top_cpu_ops": [{**r, "self_ms_per_step": r["self_ms"] / steps, "calls_per_step": r["calls"] / steps}
                        for r in cpu[: a.top]],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(summary, indent=1))
    print(f"{summary['device']} | torch {summary['torch']} | {' '.join(argv)}")
    print(f"{steps} steps after {a.skip}: {summary['wall_ms_per_step']:.2f} ms/step under the profiler"
          + (f", device busy {summary['device_busy_ms_per_step']:.2f} ms, GPU waiting {summary['gap_share']:.0%}"
             if cuda else "")
          + (f"; the steps after the window (no profiler), median {summary['unprofiled_step_ms_median']:.2f} ms"
             if gaps else ""))
    if cuda:
        print("device shares: " + ", ".join(f"{k} {v:.1%}" for k, v in summary["device_shares_of_wall"].items()))
        print("| kernel | calls/step | ms/step | category |\n|---|---|---|---|")
        for r in summary["top_kernels"]:
            print(f"| {r['name'][:80]} | {r['calls'] // steps} | {r['ms_per_step']:.3f} | {r['category']} |")
    print("| CPU op (self time) | calls/step | ms/step |\n|---|---|---|")
    for r in summary["top_cpu_ops"]:
        print(f"| {r['name'][:80]} | {r['calls_per_step']:.1f} | {r['self_ms_per_step']:.3f} |")
    print(f"wrote {out / 'profile.json'}")


if __name__ == "__main__":
    main()
