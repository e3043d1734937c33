"""Where the GPU waits for the host: idle gaps of a torch.profiler chrome trace, and what the host did meanwhile.

    python benchmarks/tools/trace_gaps.py TRACE.json[.gz] [--steps N] [--min_us 20] [--top 15]

Device work = kernels, memcpys and memsets (their union over time). A gap is a stretch between two of them, inside the
profiled window, longer than ``--min_us``. For each gap the kernel after it was launched by a CUDA runtime call on some
host thread; the time between the gap's start and that launch is time the host had not yet asked for the next kernel.
That host time is attributed to the innermost CPU op (or runtime call) running on the launching thread, and summed
over all gaps by name: the names with the most gap time are what the GPU waits for. Runtime calls that block the host
(``*Synchronize``, device-to-host copies) are counted and timed separately, since each one drains the queue.

``bench_lora_recompute.py --profile N --trace DIR`` writes such traces and prints this summary for each mode,
``gpu_gpt_profile.py --trace`` for the GPT or flow step.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function"}
BLOCKING = ("Synchronize", "cudaMemcpy", "cuMemcpy")  # cudaMemcpyAsync DtoH/HtoD from pageable memory blocks too


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def _busy(device: list[dict]) -> list[tuple[float, float]]:
    """Union of device intervals, sorted."""
    out: list[list[float]] = []
    for e in sorted(device, key=lambda e: e["ts"]):
        s, t = e["ts"], e["ts"] + e.get("dur", 0)
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t)
        else:
            out.append([s, t])
    return [(s, t) for s, t in out]


def _innermost(events: list[dict], starts: list[float], t0: float, t1: float) -> dict[str, float]:
    """Time in [t0, t1) attributed to the innermost host event covering it (by shortest duration), by name."""
    lo = bisect.bisect_left(starts, t0 - 60e6)  # no host op runs a minute: bounds the scan
    live = [e for e in events[lo:bisect.bisect_right(starts, t1)] if e["ts"] + e.get("dur", 0) > t0]
    cuts = sorted({t0, t1, *(max(t0, e["ts"]) for e in live), *(min(t1, e["ts"] + e.get("dur", 0)) for e in live)})
    out: dict[str, float] = collections.Counter()
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        cover = [e for e in live if e["ts"] <= a and e["ts"] + e.get("dur", 0) >= b]
        name = min(cover, key=lambda e: e.get("dur", 0))["name"] if cover else "(no op recorded)"
        out[name] += b - a
    return out


def analyse(events: list[dict], steps: int = 1, min_us: float = 20.0, top: int = 15) -> dict:
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    if not device:
        return {"error": "no device events in the trace (a CPU-only profile?)"}
    launch_of = {}
    for e in host:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_of[e["args"]["correlation"]] = e
    by_thread: dict = collections.defaultdict(list)
    for e in host:
        by_thread[(e["pid"], e["tid"])].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: e["ts"])
    starts = {k: [e["ts"] for e in v] for k, v in by_thread.items()}
    busy = _busy(device)
    first_at = {}
    for e in sorted(device, key=lambda e: e["ts"]):
        first_at.setdefault(e["ts"], e)
    dev_starts = sorted(first_at)
    window = busy[-1][1] - busy[0][0]
    busy_us = sum(t - s for s, t in busy)
    gaps, blame = [], collections.Counter()
    host_late_us = 0.0
    for (_, end), (nxt, _) in zip(busy, busy[1:]):
        if nxt - end < min_us:
            continue
        k = first_at[dev_starts[bisect.bisect_left(dev_starts, nxt)]]
        launch = launch_of.get(k.get("args", {}).get("correlation"))
        late = (launch["ts"] - end) if launch is not None else 0.0
        if launch is not None and late > 0:
            host_late_us += min(late, nxt - end)
            key = (launch["pid"], launch["tid"])
            for name, us in _innermost(by_thread[key], starts[key], end, min(launch["ts"], nxt)).items():
                blame[name] += us
        gaps.append({"start_us": end, "us": nxt - end, "next_kernel": k["name"][:90],
                     "host_late_us": max(late, 0.0)})
    blocking = collections.Counter()
    blocking_us = collections.Counter()
    for e in host:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and any(b in e["name"] for b in BLOCKING):
            blocking[e["name"]] += 1
            blocking_us[e["name"]] += e.get("dur", 0)
    per = 1e3 * steps
    return {
        "window_ms_per_step": window / per, "busy_ms_per_step": busy_us / per,
        "idle_ms_per_step": (window - busy_us) / per,
        "gaps_per_step": len(gaps) / steps, "gap_ms_per_step": sum(g["us"] for g in gaps) / per,
        "host_late_ms_per_step": host_late_us / per,
        "blame_ms_per_step": [{"name": n[:110], "ms": us / per} for n, us in blame.most_common(top)],
        "blocking_calls_per_step": {n: {"calls": c / steps, "ms": blocking_us[n] / per}
                                    for n, c in blocking.most_common()},
        "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[:top],
    }


def export(prof, path: str, steps: int = 1) -> dict:
    """Write a finished torch.profiler run's chrome trace to ``path`` + ".gz" (gzipped: about a tenth of the size) and
    return ``analyse`` of it."""
    import os
    import shutil

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    return analyse(load(path + ".gz"), steps)


def report(res: dict, label: str = "") -> str:
    if "error" in res:
        return f"{label}: {res['error']}"
    lines = [f"{label}: window {res['window_ms_per_step']:.1f} ms/step, device busy {res['busy_ms_per_step']:.1f}, "
             f"idle {res['idle_ms_per_step']:.1f} in {res['gaps_per_step']:.0f} gaps; the host late for "
             f"{res['host_late_ms_per_step']:.1f} ms of them"]
    lines += [f"    blocking {n}: {v['calls']:.1f} calls, {v['ms']:.2f} ms per step"
              for n, v in res["blocking_calls_per_step"].items()]
    lines += [f"    {b['ms']:7.2f} ms  host in {b['name']}" for b in res["blame_ms_per_step"]]
    lines += [f"    gap {g['us'] / 1e3:6.2f} ms before {g['next_kernel']}" for g in res["largest_gaps"][:5]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1, help="steps in the trace: figures are per step")
    p.add_argument("--min_us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", default="")
    a = p.parse_args()
    res = analyse(load(a.trace), a.steps, a.min_us, a.top)
    print(report(res, a.trace))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
