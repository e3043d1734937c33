"""Measure one training command as the ledger predicts it: peak memory under a card-sized cap, step time, where the
device time goes, and how many steps the minutes held.

Runs ``hf-cgpu train TASK ARGS`` in this process after ``torch.cuda.set_per_process_memory_fraction`` (a fresh
process: the cap holds only when set before the first allocation), with a global optimizer-step hook that stamps
every step and profiles ``--active`` steps after ``--skip`` (compile and warm-up left out). Writes one JSON object:

    wall_s_per_step       median of the stamped steps after --skip (evaluations and checkpoints left out)
    profile               device ms per step by kind (matmul, attention, convolution, ...), kernels per step
    peak_alloc_gib, peak_reserved_gib, steps, oom, all_results (the run's own figures)

    python benchmarks/ledger/measure_one.py --cap_gib 16 --out m.json -- train gpt --preset 124m ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from gpu_gpt_profile import kernel_rows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap_gib", type=float, default=16.0, help="memory cap (GiB) set before anything is allocated")
    p.add_argument("--skip", type=int, default=20, help="optimizer steps before the timed window")
    p.add_argument("--active", type=int, default=5, help="optimizer steps profiled")
    p.add_argument("--out", required=True)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- train TASK ARGS")
    a = p.parse_args()
    argv = [w for w in a.command if w != "--"]
    cuda = torch.cuda.is_available()
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2**30 / total))
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    state = {"n": 0, "prof": None, "stamps": []}

    def hook(optimizer, args, kwargs):
        now = time.perf_counter()
        if state["stamps"] and now - state["stamps"][-1] < 2e-3:  # an optimizer inside another (accelerate's
            state["stamps"][-1] = now  # wrapper, Muon's AdamW): the same step
            return
        state["n"] += 1
        n = state["n"]
        state["stamps"].append(now)
        if n == a.skip and state["prof"] is None:
            if cuda:
                torch.cuda.synchronize()
            state["prof"] = torch.profiler.profile(activities=acts)
            state["prof"].__enter__()
        elif n == a.skip + a.active and state["prof"] is not None and "closed" not in state:
            if cuda:
                torch.cuda.synchronize()
            state["prof"].__exit__(None, None, None)
            state["closed"] = True

    handle = register_optimizer_step_post_hook(hook)
    from hf_cgpu.cli import main as cli

    result: dict = {"command": argv, "cap_gib": a.cap_gib, "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    started = time.perf_counter()
    try:
        result["exit"] = cli(argv)
    except torch.cuda.OutOfMemoryError as err:
        result["exit"], result["oom"] = "oom", str(err).splitlines()[0][:300]
    except BaseException as err:  # the record says what failed; the driver goes on with the next configuration
        result["exit"] = f"{type(err).__name__}: {str(err)[:300]}"
        result["traceback"] = traceback.format_exc()[-2000:]
    finally:
        handle.remove()
    result["wall_s"] = time.perf_counter() - started
    stamps = state["stamps"]
    result["steps"] = state["n"]
    gaps = [b - a_ for a_, b in zip(stamps, stamps[1:])][a.skip:]
    if gaps:
        result["wall_s_per_step"] = statistics.median(gaps)
        result["first_step_s"] = stamps[0] - started if stamps else None
    if cuda:
        result["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if state.get("closed"):
        rows, busy, shares = kernel_rows(state["prof"], cuda)
        result["profile"] = {"busy_ms_per_step": busy / a.active,
                             "kernels_per_step": sum(r["calls"] for r in rows) / a.active,
                             "ms_per_step": {k: v / a.active for k, v in shares.items()},
                             "top": [{**r, "ms": r["ms"] / a.active, "calls": r["calls"] / a.active}
                                     for r in rows[:12]]}
    out_dir = next((argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "--output_dir"), None)
    if out_dir and (Path(out_dir) / "all_results.json").is_file():
        res = json.loads((Path(out_dir) / "all_results.json").read_text())
        result["all_results"] = {k: v for k, v in res.items() if k not in ("settings", "history")}
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k not in ("profile", "all_results", "traceback")},
                     default=str))


if __name__ == "__main__":
    main()
