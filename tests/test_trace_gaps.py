"""benchmarks/tools/trace_gaps.py: the idle stretches of a profiler trace and what the host did meanwhile, on a trace
whose answer is known by construction, and the real chrome-trace format torch.profiler writes."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "tools"))
import trace_gaps  # noqa: E402


def _x(cat, name, ts, dur, tid=1, corr=None):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1 if cat != "kernel" else 0, "tid": tid,
            "args": {} if corr is None else {"correlation": corr}}


def test_gaps_and_blame_on_a_known_trace():
    """Kernels at [0, 10), [50, 60), [60, 70) and [100, 110) us: gaps of 40 and 30 us. The second kernel is launched at
    45 (host late by 35 us: 32 of them inside `slow_op`, the rest in `step`), the fourth at 80 (late by 10 us, in
    `step`); a synchronize is counted as blocking. Two profiled steps halve every per-step figure."""
    ev = [
        _x("kernel", "A", 0, 10, tid=7, corr=1), _x("kernel", "B", 50, 10, tid=7, corr=2),
        _x("kernel", "C", 60, 10, tid=7, corr=3), _x("kernel", "D", 100, 10, tid=7, corr=4),
        _x("cpu_op", "step", 0, 120), _x("cpu_op", "slow_op", 12, 32),
        _x("cuda_runtime", "cudaLaunchKernel", 45, 2, corr=2), _x("cuda_runtime", "cudaLaunchKernel", 47, 2, corr=3),
        _x("cuda_runtime", "cudaLaunchKernel", 80, 2, corr=4),
        _x("cuda_runtime", "cudaStreamSynchronize", 2, 5),
    ]
    res = trace_gaps.analyse(ev, steps=2, min_us=5)
    assert res["gaps_per_step"] == 1.0  # two gaps over two steps
    assert abs(res["gap_ms_per_step"] - 0.035) < 1e-9  # (40 + 30) us / 2
    assert abs(res["busy_ms_per_step"] - 0.020) < 1e-9  # 40 us of kernels / 2
    assert abs(res["host_late_ms_per_step"] - (35 + 10) / 2e3) < 1e-9
    blame = {b["name"]: b["ms"] for b in res["blame_ms_per_step"]}
    assert abs(blame["slow_op"] - 32 / 2e3) < 1e-9
    assert abs(blame["step"] - (3 + 10) / 2e3) < 1e-9  # [10, 12) and [44, 45) before the launch, [70, 80) after C
    assert res["blocking_calls_per_step"]["cudaStreamSynchronize"]["calls"] == 0.5
    assert [g["next_kernel"] for g in res["largest_gaps"]] == ["B", "D"]
    assert "slow_op" in trace_gaps.report(res, "known")


def test_reads_a_real_profiler_trace(tmp_path):
    """The file torch.profiler exports (gzipped, as bench_lora_recompute.py keeps it) loads; a CPU-only profile has no
    device work, which the analysis says instead of inventing figures."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    res = trace_gaps.export(prof, str(tmp_path / "t.json"))
    assert "error" in res and not (tmp_path / "t.json").exists()
    events = trace_gaps.load(str(tmp_path / "t.json.gz"))
    assert any(e.get("cat") == "cpu_op" and "mm" in e["name"] for e in events)
