"""Measure this GPU: copy bandwidth and bf16 matmul rate, the denominators of every time and MFU estimate.

``hf-cgpu bench`` (or ``python -m hf_cgpu.bench``) prints the device, its memory and compute capability, the
read + write bandwidth of a device-to-device copy of a 256 MiB bf16 tensor, bf16 matmul TFLOP/s at square sizes from
256 to 8192 (warm-up, CUDA-event timing, median of several repeats), the host time of one eager PyTorch op and the
device time of one kernel replayed from a CUDA graph: what the time ledger (``budget.time.step_time``) prices a step
with. The result goes to
``$HF_CGPU_CACHE/bench.json`` (default ``~/.cache/hf_cgpu/bench.json``); ``load_measured_peak()`` reads it back for
the trainer's MFU and for ``hf-cgpu budget``'s hours. Datasheet numbers are upper bounds: a card reaches less than its
nominal bandwidth and matmul rate, so its own measured matmul rate is the honest MFU denominator.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ArgumentParser, SettingsError, UserError, about
from .paths import bench_file

COPY_BYTES = 256 * 1024**2
"""Size of the copied tensor: large enough to defeat the L2 cache (64-96 MB on current cards)."""
MATMUL_SIZES = (256, 512, 1024, 2048, 4096, 8192)
BENCH_FORMAT = 2
"""2: launch latencies and the matmul curve from 256 (1: three matmul sizes, no launch figures)."""
LAUNCH_OPS = 2000
"""Tiny ops timed for the launch latencies."""
WARMUP = 5
ITERS = 20
"""Calls per timed repeat: long enough that launch overhead is negligible for the small sizes."""
REPEATS = 5
"""Timed repeats; the median is reported (robust to a clock-boost or a background process)."""


@dataclass
class BenchResult:
    """One bench run; ``peak_bf16_tflops`` (the best matmul rate) is what MFU and budget hours divide by."""

    device_name: str
    total_memory_bytes: int
    capability: str
    """``sm_XY`` as CUDA names it (RTX 50 series: sm_120)."""
    copy_bandwidth_gbs: float
    """Read + write GB/s (10^9) of a device-to-device copy."""
    matmul_tflops: dict[int, float] = field(default_factory=dict)
    """bf16 square matmul TFLOP/s by matrix size."""
    torch_version: str = ""
    cuda_version: str | None = None
    measured_at: str = ""
    launch_us: float = 0.0
    """Host microseconds per eager op on a one-element tensor (Python dispatch + launch): a launch-bound step's
    rate."""
    graph_launch_us: float = 0.0
    """Device microseconds per kernel replayed from a CUDA graph."""
    host: str = ""
    """The machine's name (``platform.node()``): a bench file copied from another machine is refused."""
    format: int = BENCH_FORMAT

    @property
    def peak_bf16_tflops(self) -> float:
        return max(self.matmul_tflops.values()) if self.matmul_tflops else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["matmul_tflops"] = {str(k): v for k, v in self.matmul_tflops.items()}
        d["peak_bf16_tflops"] = self.peak_bf16_tflops
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        return cls(
            device_name=str(d["device_name"]),
            total_memory_bytes=int(d["total_memory_bytes"]),
            capability=str(d["capability"]),
            copy_bandwidth_gbs=float(d["copy_bandwidth_gbs"]),
            matmul_tflops={int(k): float(v) for k, v in d.get("matmul_tflops", {}).items()},
            torch_version=str(d.get("torch_version", "")),
            cuda_version=d.get("cuda_version"),
            measured_at=str(d.get("measured_at", "")),
            launch_us=float(d.get("launch_us", 0.0)),
            graph_launch_us=float(d.get("graph_launch_us", 0.0)),
            host=str(d.get("host", "")),
            format=int(d.get("format", 1)),
        )


def save_result(result: BenchResult, path: str | Path | None = None) -> Path:
    path = Path(path) if path else bench_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def load_result(path: str | Path | None = None) -> BenchResult | None:
    """The saved bench result, or None when there is none or it cannot be read."""
    path = Path(path) if path else bench_file()
    try:
        return BenchResult.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_checked(path: str | Path | None = None) -> BenchResult | None:
    """The saved bench of this machine for the time ledger, None when there is none; a file of an older format or
    from another machine is one line naming the fix."""
    import platform

    path = Path(path) if path else bench_file()
    if not path.is_file():
        return None
    result = load_result(path)
    if result is None:
        raise SettingsError(f"{path} is not a bench result hf_cgpu can read: run `hf-cgpu bench` again (it rewrites "
                            "it) or delete it")
    if result.format < BENCH_FORMAT:
        raise SettingsError(f"{path} was written by an older hf-cgpu bench (format {result.format}, no launch "
                            "figures): run `hf-cgpu bench` again, or name the card with --card")
    if result.host and result.host != platform.node():
        raise SettingsError(f"{path} was measured on another machine ({result.host}, {result.device_name}): run "
                            "`hf-cgpu bench` here, or name the card with --card")
    return result


def load_measured_peak(path: str | Path | None = None) -> float | None:
    """Measured bf16 peak in TFLOP/s from the last ``hf-cgpu bench``, or None if never measured."""
    result = load_result(path)
    peak = result.peak_bf16_tflops if result else 0.0
    return peak if peak > 0 else None


# ---- measurement (CUDA only) --------------------------------------------------------------------------------------


def time_cuda(fn: Callable[[], Any], warmup: int = WARMUP, iters: int = ITERS, repeats: int = REPEATS) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` CUDA-event-timed runs of ``iters`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / iters)
    return statistics.median(times)


def measure_copy_bandwidth(nbytes: int = COPY_BYTES, **timing: int) -> float:
    """GB/s moved by ``b.copy_(a)``: every byte is read once and written once."""
    import torch

    a = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    dt = time_cuda(lambda: b.copy_(a), **timing)
    del a, b
    return 2 * nbytes / dt / 1e9


def measure_matmul(size: int, **timing: int) -> float:
    """bf16 TFLOP/s of a ``size`` x ``size`` by ``size`` x ``size`` matmul (2 n^3 FLOPs)."""
    import torch

    x = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(size, size, dtype=torch.bfloat16, device="cuda")
    dt = time_cuda(lambda: torch.mm(x, y, out=out), **timing)
    del x, y, out
    torch.cuda.empty_cache()
    return 2 * size**3 / dt / 1e12


def measure_launch(ops: int = LAUNCH_OPS) -> tuple[float, float]:
    """(host us per eager op, device us per kernel in a CUDA graph) of an in-place add on a one-element tensor."""
    import torch

    x = torch.zeros(1, device="cuda")
    for _ in range(50):
        x.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(ops):
        x.add_(1)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / ops * 1e6
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(200):
            x.add_(1)
    replay = time_cuda(graph.replay, warmup=2, iters=max(1, ops // 200), repeats=3)
    return eager, replay / 200 * 1e6


def run_bench(sizes: Sequence[int] = MATMUL_SIZES, copy_bytes: int = COPY_BYTES, **timing: int) -> BenchResult:
    import torch

    import platform

    props = torch.cuda.get_device_properties(0)
    major, minor = torch.cuda.get_device_capability(0)
    launch, graph = measure_launch()
    return BenchResult(
        device_name=torch.cuda.get_device_name(0),
        total_memory_bytes=int(props.total_memory),
        capability=f"sm_{major}{minor}",
        copy_bandwidth_gbs=measure_copy_bandwidth(copy_bytes, **timing),
        matmul_tflops={m: measure_matmul(m, **timing) for m in sizes},
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        launch_us=launch,
        graph_launch_us=graph,
        host=platform.node(),
    )


QUICK = {"sizes": (4096, 8192), "copy_bytes": 64 * 1024**2, "warmup": 2, "iters": 5, "repeats": 3}
"""The bench a training run does by itself when no peak is stored: a few seconds on any current GPU."""


def quick_bench() -> BenchResult:
    """``run_bench`` shortened to a few seconds (two matmul sizes, fewer repeats): the MFU denominator of a run
    that found no stored bench; ``hf-cgpu bench`` measures more carefully."""
    q = dict(QUICK)
    return run_bench(q.pop("sizes"), q.pop("copy_bytes"), **q)


def training_peak(explicit: float, device, log=print, measure: Callable[[], BenchResult] | None = None,
                  path: str | Path | None = None) -> tuple[float, str]:
    """The bf16 peak a training run's MFU divides by, and where it came from; the log says which.

    ``--peak_tflops`` when given; else the stored ``hf-cgpu bench`` of this GPU (``bench.json``); else, on CUDA,
    ``measure()`` (default ``quick_bench``) now, stored where ``hf-cgpu bench`` stores it, so the next run reuses it.
    A stored bench of another GPU model is measured again. On the CPU there is no MFU.
    """
    if explicit > 0:
        peak, source = explicit, "--peak_tflops"
    elif getattr(device, "type", str(device)) != "cuda":
        return 0.0, "none (MFU is reported for CUDA runs)"
    else:
        import torch

        name = torch.cuda.get_device_name(device)
        stored = load_result(path)
        if stored is not None and stored.peak_bf16_tflops > 0 and stored.device_name == name:
            peak, source = stored.peak_bf16_tflops, f"hf-cgpu bench of {stored.measured_at or 'an earlier run'}"
        else:
            log(f"MFU: no stored bf16 peak for {name}; measuring it now (a few seconds)")
            result = (measure or quick_bench)()
            saved = save_result(result, path)
            peak, source = result.peak_bf16_tflops, f"measured at the start of this run, stored in {saved}"
    log(f"MFU denominator: {peak:,.1f} TFLOP/s bf16 ({source})")
    return peak, source


def format_result(r: BenchResult) -> str:
    lines = [
        f"{r.device_name} | {r.total_memory_bytes / 1024**3:.1f} GiB | {r.capability} | torch {r.torch_version}"
        f" (CUDA {r.cuda_version})",
        f"  copy bandwidth (read + write)  {r.copy_bandwidth_gbs:8,.0f} GB/s",
    ]
    for m, tflops in sorted(r.matmul_tflops.items()):
        lines.append(f"  bf16 matmul {m:>5} x {m:<5}       {tflops:8,.1f} TFLOP/s")
    lines.append(f"  peak used for MFU and budget    {r.peak_bf16_tflops:8,.1f} TFLOP/s")
    if r.launch_us:
        lines.append(f"  eager op (host)                {r.launch_us:8,.1f} us")
        lines.append(f"  kernel in a CUDA graph         {r.graph_launch_us:8,.1f} us")
    return "\n".join(lines)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="hf-cgpu bench", description=about(__doc__.splitlines()[0], "hf-cgpu bench"))
    p.add_argument("--sizes", default=",".join(map(str, MATMUL_SIZES)), help="matmul sizes, comma separated")
    p.add_argument("--copy_mib", type=int, default=COPY_BYTES // 1024**2, help="copied tensor size in MiB")
    p.add_argument("--iters", type=int, default=ITERS, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed repeats (median reported)")
    p.add_argument("--output", default=None, help=f"result JSON (default {bench_file()})")
    p.add_argument("--no_save", action="store_true", help="print only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``hf-cgpu bench``; without a CUDA device a ``UserError`` (one line, exit 2 via ``run_main``)."""
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise UserError("no CUDA device visible (torch.cuda.is_available() is False): run `hf-cgpu bench` on the "
                        "machine with the GPU, with a CUDA build of torch")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise SettingsError(f"--sizes {args.sizes!r} must be integers, e.g. 2048,4096,8192") from None
    major, minor = torch.cuda.get_device_capability(0)
    arch = f"sm_{major}{minor}"
    if arch not in torch.cuda.get_arch_list():
        print(f"warning: this torch build has no {arch} kernels ({', '.join(torch.cuda.get_arch_list())}); "
              "install a wheel built for it (RTX 50: cu128 or newer)", file=sys.stderr)
    result = run_bench(sizes, args.copy_mib * 1024**2, iters=args.iters, repeats=args.repeats)
    print(format_result(result))
    if not args.no_save:
        print(f"  saved to {save_result(result, args.output)}")
    return 0


if __name__ == "__main__":
    from .errors import run_main

    sys.exit(run_main(main))
