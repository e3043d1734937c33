"""Where the time of a training step goes: torch.profiler over a few steps after warm-up, for the GPT 124M step
(``--model gpt``, the default) or the flow UNet's (``--model flow``: base 128, class-conditional, batch 256 of
32 x 32, channels_last, the loop's logit-normal flow-matching loss with 10% label drop, fused AdamW, clip 1.0, the
EMA's ``_foreach_lerp_``; issue 12 asks why that UNet runs at a small share of the card's bf16 rate).

The step is the one of the issue's table (12x768, vocab 32000, seq 1024, micro-batch 16, bf16 autocast, the whole
model compiled, fused AdamW, clip 1.0); the model is ``CgptForCausalLM`` with the 124m preset's loss settings.
Prints, and writes to ``--out`` (a folder):

    top kernels by device time (name, calls, total ms, share),
    shares of the device time: matmul, attention, loss (cross-entropy / log-softmax / the logits' chunks), optimizer
    (AdamW, clipping's norms), elementwise/norm (the rest), and the gaps: wall time of the profiled steps minus the
    device busy time (launch overhead, host syncs, Python),
    profile.json (all of it) and trace.json (chrome://tracing or https://ui.perfetto.dev).

``--preset NAME`` profiles that GPT preset's own step instead (its model config, micro-batch, sequence length,
accumulation, dropout and optimizer, as ``recipes/train_gpt.py --preset NAME`` builds them; vocabulary at the preset's
size): e.g. ``zh-poetry-modern`` (rotary, q/k norm, ReLU^2, Muon) against ``zh-poetry`` (the plain GPT-2) shows
where the modern step's extra time goes.

GPU:   python benchmarks/tools/gpu_gpt_profile.py --out $OUT/gpt_profile [--batch 8|16|32] [--compile false]
       python benchmarks/tools/gpu_gpt_profile.py --preset zh-poetry-modern --out $OUT/modern_profile
       python benchmarks/tools/gpu_gpt_profile.py --model flow --batch 256 --out $OUT/flow_profile
CPU:   python benchmarks/tools/gpu_gpt_profile.py [--model flow] --smoke --out /tmp/profile   (tiny; checks the script only)
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

CATEGORIES = (  # first match wins; patterns on the lower-cased kernel / op name
    # attention first: cuDNN's SDPA kernels ("cudnn_generated_..._sdpa_..._fprop", "cudnn::fusion::compute_dot_do_o")
    # also match the convolution pattern (the preset profiles of 2026-12-01 booked them as convolution)
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product|softmax_fwd|efficient_attn|dot_do_o|convert_dq"),
    ("convolution", r"convolution|conv2d|conv_|implicit_gemm|fprop|dgrad|wgrad|cudnn"),  # not "convert_..."
    ("group norm", r"group_norm|groupnorm"),
    ("loss", r"cross_entropy|nll_loss|log_softmax|logsumexp|_softmax_backward"),
    ("optimizer", r"adam|multi_tensor|foreach|fused_adam|clip|norm_kernel|lpnorm|_amp_"),
    ("matmul", r"gemm|sm90|sm80|cutlass|cublas|matmul|aten::mm|aten::addmm|aten::bmm|xmma|nvjet|ampere_|hopper_"),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "elementwise/norm/other"


def kernel_times(prof) -> dict[str, tuple[int, float]]:
    """Device kernels of a torch.profiler run: name -> (calls, total ms), summed from the kernel events themselves (a
    triton kernel's CPU-side launcher has the kernel's name and carries its device time too, so filtering
    ``key_averages()`` by kernel name counts it twice)."""
    out: dict[str, tuple[int, float]] = {}
    for ev in prof.events():
        # "## Call CompiledFxGraph ... ##" and "Optimizer.step#AdamW.step" are user annotations that span their kernels
        # on the device timeline: counting them counts those kernels twice
        annotation = ev.name.startswith("## ") or getattr(ev, "is_user_annotation", False) or "#" in ev.name
        if ev.device_type == torch.autograd.DeviceType.CUDA and not annotation:
            calls, ms = out.get(ev.name, (0, 0.0))
            out[ev.name] = (calls + 1, ms + ev.device_time_total / 1e3)
    return out


def kernel_rows(prof, cuda: bool) -> tuple[list[dict], float, dict[str, float]]:
    """The profiled work by kernel, largest first: rows ``{name, calls, ms, category}`` of device time (on a CPU
    profile, self CPU time per op), their sum (device busy ms) and ms by category, largest first."""
    if cuda:
        rows = [{"name": k, "calls": n, "ms": ms, "category": category(k)} for k, (n, ms) in kernel_times(prof).items()]
    else:
        rows = [{"name": e.key, "calls": e.count, "ms": e.self_cpu_time_total / 1e3, "category": category(e.key)}
                for e in prof.key_averages() if e.self_cpu_time_total > 0 and not e.key.startswith("ProfilerStep")]
    rows.sort(key=lambda r: -r["ms"])
    shares: dict[str, float] = {}
    for r in rows:
        shares[r["category"]] = shares.get(r["category"], 0.0) + r["ms"]
    return rows, sum(r["ms"] for r in rows), dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def launchers(prof, kernels: list[str], steps: int) -> list[dict]:
    """Which CPU op (with its input shapes and 3 parents) launched each of ``kernels``, by device time."""
    wanted, found = set(kernels), {}
    for ev in prof.events():
        for k in getattr(ev, "kernels", []) or []:
            if k.name not in wanted:
                continue
            parents, up = [], ev.cpu_parent
            while up is not None and len(parents) < 3:
                parents.append(up.name)
                up = up.cpu_parent
            key = (k.name, ev.name, str(ev.input_shapes), tuple(parents))
            calls, ms = found.get(key, (0, 0.0))
            found[key] = (calls + 1, ms + k.duration / 1e3)
    rows = [{"kernel": key[0], "op": key[1], "shapes": key[2], "parents": list(key[3]), "calls_per_step": n // steps,
             "ms_per_step": ms / steps} for key, (n, ms) in found.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:20]


def build(args):
    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM

    if args.smoke:
        cfg = CgptConfig(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2, loss_chunk_size=0)
    else:
        cfg = CgptConfig(vocab_size=32000, n_positions=args.seq, n_embd=768, n_layer=12, n_head=12,
                         loss_chunk_size=args.loss_chunk_size)
    return CgptForCausalLM(cfg), cfg


def build_preset(a):
    """The model and optimizer ``recipes/train_gpt.py --preset a.preset`` trains (its settings, parsed the same way)."""
    from hf_cgpu.models.cgpt import CgptForCausalLM
    from hf_cgpu.settings import TrainSettings, parse_settings
    from hf_cgpu.optim import build_optimizer
    from hf_cgpu.tasks.settings import GPTSettings

    argv = ["--preset", a.preset] + (["--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--vocab_size", "512",
                                      "--seq_len", "64"] if a.smoke else [])
    gpt, train = parse_settings((GPTSettings, TrainSettings), argv, family="gpt")
    cfg = gpt.model_config(gpt.vocab_size, eos_token_id=0)
    model = CgptForCausalLM(cfg)
    a.seq = gpt.seq_len
    a.batch = 2 if a.smoke else (a.batch or train.micro_batch_size)
    a.accumulation = train.gradient_accumulation_steps
    make_opt = lambda m: build_optimizer(m, train)  # noqa: E731 - after the model moves to the device (fused AdamW)
    return model, cfg, make_opt


def gpt_step(a, dev, cuda):
    a.accumulation = 1
    if a.preset:
        model, cfg, make_opt = build_preset(a)
        model = model.to(dev).train()
        opt = make_opt(model)
    else:
        model, cfg = build(a)
        model = model.to(dev).train()
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=6e-4, weight_decay=0.1,
                                betas=(0.9, 0.95), fused=cuda)
    params = [q for q in model.parameters() if q.requires_grad]
    step_model = torch.compile(model, dynamic=False) if a.compile == "true" else model
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), device=dev)

    def step():
        for _ in range(a.accumulation):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = step_model(input_ids=x[:, :-1], shift_labels=x[:, 1:], use_cache=False).loss
            (loss / a.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def flow_step(a, dev, cuda):
    from hf_cgpu.flow.matching import FlowMatcher
    from hf_cgpu.flow.unet import FlowUNet2DModel

    size, base = (8, 32) if a.smoke else (32, 128)
    model = FlowUNet2DModel(sample_size=size, base_channels=base, num_classes=10).to(dev)
    layout = torch.channels_last if a.memory_format == "channels_last" else torch.contiguous_format
    model = model.to(memory_format=layout).train()
    params = [q for q in model.parameters() if q.requires_grad]
    ema = [q.detach().clone() for q in params]
    opt = torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.999), weight_decay=0.0, fused=cuda)
    if a.compile == "true":  # as the loop compiles it (apply_compile: channels_last kept inside inductor)
        from hf_cgpu.tiers import compile_options

        opts = compile_options(model, getattr(a, "compile_mode", None))
        if "options" in opts:
            opts["options"].update(getattr(a, "inductor_options", {}))  # flow_step_variants.py's extra knobs
        step_model = torch.compile(model, dynamic=False, **opts)
    else:
        step_model = model
    matcher = FlowMatcher(time_sampling="logit_normal")
    x1 = (torch.rand(a.batch, 3, size, size, device=dev) * 2 - 1).contiguous(memory_format=layout)
    labels = torch.randint(0, 10, (a.batch,), device=dev)
    gen = torch.Generator(dev).manual_seed(0)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = matcher.loss(lambda xt, t, y=None: step_model(xt, t, y).sample, x1, labels, cond_drop_prob=0.1,
                                null_class=10, generator=gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch._foreach_lerp_(ema, [q.detach() for q in params], 1 - 0.9999)
        return loss

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt", choices=["gpt", "flow"])
    p.add_argument("--preset", default="", help="a GPT preset: profile its step (model, batch, accumulation, "
                   "optimizer) instead of the 124M one")
    p.add_argument("--batch", type=int, default=0, help="0: 16 (gpt) or 256 (flow)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--loss_chunk_size", type=int, default=0, help="0 = full logits (the 124m preset)")
    p.add_argument("--compile", default="true", choices=["true", "false"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="profiled steps")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default="gpt_profile")
    p.add_argument("--memory_format", default="channels_last", choices=["channels_last", "contiguous"],
                   help="flow: the UNet's and the batch's memory format")
    p.add_argument("--launchers", type=int, default=0, help="also list the CPU ops (input shapes, 3 parents) that "
                   "launched the N kernels with the most device time")
    p.add_argument("--trace", action="store_true", help="also write the chrome trace (trace.json.gz) and "
                   "print where the GPU waited for the host (benchmarks/tools/trace_gaps.py)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 2 warm-up + 2 profiled steps")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    a.batch = a.batch or (0 if a.preset else 256 if a.model == "flow" else 16)  # 0: the preset's micro-batch
    if a.smoke:
        a.batch, a.seq, a.warmup, a.steps, a.compile = 2, 64, 2, 2, "false"
    torch.manual_seed(0)
    if a.model == "flow":
        step, unit = flow_step(a, dev, cuda), "img"
    else:
        step, unit = gpt_step(a, dev, cuda), "tok"

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(a.warmup):
        step()
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts, record_shapes=a.launchers > 0) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        sync()
        wall = time.perf_counter() - t0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gaps = None
    if a.trace:  # trace.json.gz, and where the GPU waited for the host (trace_gaps.py)
        from trace_gaps import export

        gaps = export(prof, str(out / "trace.json"), a.steps)

    rows, busy, shares = kernel_rows(prof, cuda)
    wall_ms = wall * 1e3
    gap = max(0.0, wall_ms - busy) if cuda else None
    units = a.batch * (a.seq if unit == "tok" else 1) * a.steps * getattr(a, "accumulation", 1)
    summary = {
        "device": torch.cuda.get_device_name() if cuda else "CPU (smoke: the script only, no figure to quote)",
        "torch": torch.__version__, "model": a.preset or a.model, "batch": a.batch,
        "accumulation": getattr(a, "accumulation", 1), "seq": a.seq if unit == "tok" else None,
        "compile": a.compile, "steps": a.steps,
        "wall_ms_per_step": wall_ms / a.steps, f"{unit}_per_s_profiled": units / wall,
        "device_busy_ms_per_step": busy / a.steps,
        "shares_of_wall": {**{k: v / wall_ms for k, v in shares.items()},
                           **({"gaps (wall - device busy)": gap / wall_ms} if gap is not None else {})},
        "top": rows[: a.top],
    }
    if gaps is not None:
        summary["host_gaps"] = gaps
    if a.launchers and cuda:
        summary["launchers"] = launchers(prof, [r["name"] for r in rows[: a.launchers]], a.steps)
    (out / "profile.json").write_text(json.dumps(summary, indent=1))
    shape = (f"batch {a.batch} x seq {a.seq} x accumulation {a.accumulation}" if unit == "tok"
             else f"batch {a.batch} images")
    print(f"{summary['device']} | torch {summary['torch']} | {summary['model']} | {shape} | compile {a.compile} | "
          f"{summary['wall_ms_per_step']:.2f} ms/step ({units / wall:,.0f} {unit}/s under the profiler)")
    print("share of wall time: " + ", ".join(f"{k} {v:.1%}" for k, v in summary["shares_of_wall"].items()))
    print(f"| kernel ({'device' if cuda else 'CPU self'} time) | calls | ms per step | share | category |")
    print("|---|---|---|---|---|")
    for r in rows[: a.top]:
        print(f"| {r['name'][:90]} | {r['calls'] // a.steps} | {r['ms'] / a.steps:.3f} | {r['ms'] / wall_ms:.1%} | "
              f"{r['category']} |")
    for r in summary.get("launchers", []):
        print(f"launcher: {r['ms_per_step']:.3f} ms/step, {r['calls_per_step']} calls/step of {r['kernel'][:60]} <- "
              f"{r['op']} {r['shapes']} <- {' <- '.join(r['parents'])}")
    if gaps is not None:
        from trace_gaps import report

        print(report(gaps, "trace"))
    print(f"wrote {out / 'profile.json'}" + (f" and {out / 'trace.json.gz'}" if a.trace else ""))


if __name__ == "__main__":
    main()
