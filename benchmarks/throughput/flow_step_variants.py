"""GPU: the flow UNet's isolated training step (as ``gpu_gpt_profile.py --model flow`` builds it: base 128,
class-conditional, batch 256 of 32 x 32, channels_last, compiled, bf16 autocast, fused AdamW, clip 1.0, EMA lerp)
under several compile settings in one process, to find what takes device time off it (issue 12: the flow target
needs about 20% less device time a step).

Variants (``--variants``, comma-separated; each one after ``torch._dynamo.reset()``):
    default        the loop's compile (``tiers.compile_options``: inductor's layout optimization forced on)
    cudnn-bench    + ``torch.backends.cudnn.benchmark = True`` (cuDNN times its convolution algorithms once)
    coord          + inductor's ``coordinate_descent_tuning`` (tunes each Triton kernel's block sizes)
    autotune       mode ``max-autotune-no-cudagraphs`` (Triton convolution / matmul templates against cuDNN/cuBLAS)
    graphs         mode ``reduce-overhead`` (CUDA graphs: the preset's mode)
    split-cat      the decoder blocks take their two inputs apart instead of concatenated (``split_block``: the same
                   parameters and values; not in the model until a measurement shows a gain)
    gn-sums        the compiled group norm's channel moments from plain sums instead of var_mean's Welford
                   reduction (``channel_moments_from_sums``; also waiting for a measurement)
    a+b            several at once, e.g. ``cudnn-bench+graphs``
(A ``gn-nc`` variant was measured here too on 2026-12-02, the group norm from per-(image, channel) moments, then behind a
switch in ``flow/unet.py`` at commit 555060e; it is now that module's only compiled form.)

Each variant: the first step's seconds (compile), then ``--steps`` steps timed between two synchronisations (the
median of 5 runs of steps/5), peak allocated memory. ``--profile V1,V2``: torch.profiler over 5 more steps of
those variants: device time by kernel (top ``--top``) and by category. Rows print as they finish and the JSON is
rewritten after each.

GPU:  python benchmarks/throughput/flow_step_variants.py --variants default,cudnn-bench,graphs --profile default --json F
CPU:  python benchmarks/throughput/flow_step_variants.py --smoke   (tiny, eager: checks the script only)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # benchmarks/tools
from gpu_gpt_profile import flow_step, kernel_rows  # noqa: E402  (the same step and kernel table)

PARTS = {"default", "cudnn-bench", "coord", "autotune", "graphs", "split-cat", "gn-sums"}


def split_block(block, parts: tuple, emb: torch.Tensor) -> torch.Tensor:
    """``block(torch.cat(parts, 1), emb)`` without the concatenation: the first norm's group moments combined from
    each part's (image, channel) moments, the first convolution and the 1x1 skip as sums of convolutions over each
    part's slice of input channels. The decoder's widest convolution (u1's, 384 -> 128 at 32 x 32) then runs as two
    convolutions of usual widths (cuDNN ran its input gradient with an sm80 kernel, 0.69 ms of the 9.7 ms step,
    RESULTS.md 2026-12-02) and the concatenation is never written."""
    import torch.nn.functional as F

    xs = [p.float() for p in parts]
    moments = [block.norm1.channel_moments(x) for x in xs]
    scale, shift = block.norm1.scale_shift(torch.cat([m[0] for m in moments], 1), torch.cat([m[1] for m in moments], 1))
    h = skip = None
    start = 0
    for x, p in zip(xs, parts):
        sl = slice(start, start + x.shape[1])
        start = sl.stop
        a = F.silu(x * scale[:, sl, None, None] + shift[:, sl, None, None])
        c = F.conv2d(a, block.conv1.weight[:, sl], block.conv1.bias if h is None else None, padding=1)
        k = F.conv2d(p, block.skip.weight[:, sl], block.skip.bias if skip is None else None)
        h, skip = (c, k) if h is None else (h + c, skip + k)
    h = h + block.emb_proj(emb)[:, :, None, None]
    h = block.conv2(F.silu(block.norm2(h)))
    return h + skip


def channel_moments_from_sums(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flow.unet.GroupNorm.channel_moments`` from two plain sums, E[x] and E[x^2] (one pass, fused), instead of
    ``var_mean``'s Welford reduction, whose per-element division may be what keeps the forward's reductions under the
    memory rate; the variance by subtraction in fp32 (per channel, 1,024 pixels)."""
    mean_c = xf.mean((2, 3))
    return (xf.square().mean((2, 3)) - mean_c.square()).clamp_min(0), mean_c


def split_forward(self, sample, timestep, class_labels=None, return_dict=True):
    """``FlowUNet2DModel.forward`` with the decoder blocks on their two inputs (``split_block``)."""
    from hf_cgpu.flow.unet import FlowUNet2DOutput, upsample2x

    emb = self._embed(timestep, class_labels, sample.shape[0], sample.device)
    h1 = self.d1(self.in_conv(sample), emb)
    h2 = self.d2(self.down1(h1), emb)
    m = self.mid(self.down2(h2), emb)
    h = split_block(self.u2, (upsample2x(m), h2), emb)
    h = split_block(self.u1, (upsample2x(h), h1), emb)
    out = self.out(h)
    return FlowUNet2DOutput(sample=out) if return_dict else (out,)


def settings(variant: str) -> tuple[str | None, dict, bool]:
    """(compile mode, extra inductor options, cudnn.benchmark) of a variant."""
    parts = set(variant.split("+"))
    unknown = parts - PARTS
    if unknown:
        raise SystemExit(f"error: unknown variant part(s) {sorted(unknown)}; choose from {sorted(PARTS)}")
    mode = "reduce-overhead" if "graphs" in parts else "max-autotune-no-cudagraphs" if "autotune" in parts else None
    options = {"coordinate_descent_tuning": True} if "coord" in parts else {}
    return mode, options, "cudnn-bench" in parts


def measure(variant: str, a, dev, cuda: bool, profile: bool) -> dict:
    from hf_cgpu.flow.unet import FlowUNet2DModel, GroupNorm

    torch._dynamo.reset()
    mode, options, bench = settings(variant)
    torch.backends.cudnn.benchmark = bench
    a.compile_mode, a.inductor_options = mode, options
    torch.manual_seed(0)
    patches = {"split-cat": (FlowUNet2DModel, "forward", split_forward),
               "gn-sums": (GroupNorm, "channel_moments", staticmethod(channel_moments_from_sums))}
    with contextlib.ExitStack() as stack:  # the model's code as the variant says, restored after it
        for part in variant.split("+"):
            if part in patches:
                stack.enter_context(mock.patch.object(*patches[part]))
        step = flow_step(a, dev, cuda)
        return timed(step, variant, a, cuda, profile)


def timed(step, variant: str, a, cuda: bool, profile: bool) -> dict:
    """The first step's seconds, the median ms of 5 timed runs, peak memory, and with ``profile`` the kernel table."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(a.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(max(1, a.steps // 5)):
            loss = step()
        sync()
        runs.append((time.perf_counter() - t0) / max(1, a.steps // 5))
    ms = statistics.median(runs) * 1e3
    row = {"variant": variant, "ms_per_step": ms, "img_per_s": a.batch / ms * 1e3, "first_step_s": first,
           "runs_ms": [r * 1e3 for r in runs], "loss": loss.item(),
           "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    if profile:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                step()
            sync()
        rows, busy, shares = kernel_rows(prof, cuda)
        row["device_busy_ms"] = busy / 5
        row["by_category_ms"] = {k: v / 5 for k, v in shares.items()}
        row["top"] = [{**r, "ms": r["ms"] / 5, "calls": r["calls"] // 5} for r in rows[: a.top]]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="default,graphs")
    p.add_argument("--profile", default="default", help="variants to profile too (comma-separated, '' for none)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json", default="")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, eager")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    a.memory_format, a.compile = "channels_last", "true"
    if a.smoke:
        a.batch, a.warmup, a.steps, a.top, a.compile = 4, 1, 5, 5, "false"
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        settings(v)  # every name checked before the first compile
    profiled = {v for v in a.profile.split(",") if v}
    rows = []
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU (smoke)'} | torch {torch.__version__} | batch {a.batch}")
    for v in variants:
        row = measure(v, a, dev, cuda, v in profiled)
        rows.append(row)
        print(f"{v}: {row['ms_per_step']:.2f} ms/step, {row['img_per_s']:,.0f} img/s, first step "
              f"{row['first_step_s']:.1f} s, peak {row['peak_alloc_gib'] or 0:.2f} GiB, runs "
              + " ".join(f"{r:.2f}" for r in row["runs_ms"]), flush=True)
        if "top" in row:
            print(f"  device busy {row['device_busy_ms']:.2f} ms/step; " + ", ".join(
                f"{k} {ms:.2f}" for k, ms in row["by_category_ms"].items()))
            for r in row["top"]:
                print(f"  | {r['name'][:110]} | {r['calls']} | {r['ms']:.3f} | {r['category']} |")
        if a.json:
            Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "CPU",
                                                "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
