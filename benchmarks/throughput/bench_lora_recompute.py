"""What recompute costs a LoRA/QLoRA step, and what it recomputes: time per step, forward calls per layer, saved bytes.

A GPTNeoX (Pythia) of random weights, frozen bf16 base (``--tier qlora``: nf4, CUDA only), LoRA r16 on the four
projections through ``hf_cgpu.tiers.apply_tiers``; the step is the fine-tuning task's:
``hf_cgpu.models.causal_lm_loss.causal_lm_loss_from_hidden`` (chunked loss) under bf16 autocast, backward, AdamW.
For each recompute setting (``--modes``: off, full, selective, each optionally ``+cpp`` or ``+graphs``, see
``measure``):

    median seconds per step over ``--steps`` steps after ``--warmup``, and the ratio to ``off``;
    forward calls of every leaf module of layer 1 in the forward and in the backward (forward hooks on the leaves;
    a full recompute shows each once more in the backward; modules are entered under ``selective`` too, their kept
    matmuls return the saved output),
    and whether the embeddings, the final norm and the head run again (they must not);
    matmul FLOPs of the forward and of the backward (FlopCounterMode: what really runs; under ``selective`` the kept
    matmuls are not run again), and the bytes the step keeps for the backward (a dispatch mode following every storage
    created in the forward; the same on any device).

GPU (the issue's shape):  python benchmarks/throughput/bench_lora_recompute.py --shape pythia-1.4b --seq 1024 --batch 4 \
                              [--tier qlora] --json $OUT/lora_recompute.json
CPU (indicative only):    python benchmarks/throughput/bench_lora_recompute.py   (4 layers, hidden 256, seq 256, batch 2)
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

SHAPES = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                 vocab_size=4096, max_position_embeddings=2048),
    "pythia-1.4b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, intermediate_size=8192,
                        vocab_size=50304, max_position_embeddings=2048),
}


def build(shape: str, tier: str, mode: str, device: torch.device, compile: bool = False,
          compile_backend: str = "inductor"):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from hf_cgpu.settings import TrainSettings
    from hf_cgpu.tiers import apply_tiers

    cfg = GPTNeoXConfig(**SHAPES[shape], tie_word_embeddings=False)
    torch.manual_seed(0)
    if tier == "qlora":
        import tempfile

        from hf_cgpu.tiers import load_base_model

        with tempfile.TemporaryDirectory() as d, torch.device(device):
            GPTNeoXForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
            model = load_base_model(d, "qlora", device_map={"": device})
    else:
        with torch.device(device):  # initialised where it trains: seconds, not minutes, at 1.4B
            model = GPTNeoXForCausalLM(cfg).to(torch.bfloat16)
    recompute, _, how = mode.partition("+")
    settings = TrainSettings(tier=tier, recompute=recompute != "off", compile=compile, train_mode="finetune",
                             recompute_policy="selective" if recompute == "selective" else "full",
                             compile_mode="reduce-overhead" if how == "graphs" else "default")
    model = apply_tiers(model, settings, backend=compile_backend)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # not zero, so every adapter is on the gradient path as after a few steps
            torch.nn.init.normal_(p, std=0.02)
    return model.to(device) if tier != "qlora" else model


class LiveBytes:
    """A dispatch mode that follows every tensor storage created inside it until its last tensor dies: after the
    forward, ``live`` is what the step keeps for the backward (activations, checkpoint inputs, kept matmul outputs,
    the loss); ``peak`` the most alive at once. An estimate (caching allocators round up), the same on every device."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        watch = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        watch.add(t)
                return out

        self.mode, self.refs, self.sizes, self.live, self.peak = Mode(), collections.Counter(), {}, 0, 0

    def add(self, t: torch.Tensor) -> None:
        import weakref

        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = st.data_ptr()
        if not key:
            return
        if key not in self.sizes:
            self.sizes[key] = st.nbytes()
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(t, self.drop, key)

    def drop(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] <= 0:
            self.live -= self.sizes.pop(key, 0)
            del self.refs[key]


def measure(a, mode: str, device: torch.device, interleave: bool = False):
    """One mode's row; ``mode`` is off / full / selective, optionally ``+cpp`` (inductor's C++ wrapper launches the
    compiled kernels instead of Python) or ``+graphs`` (``compile_mode="reduce-overhead"``: CUDA graphs)."""
    torch._dynamo.reset()  # a new model of the same blocks would reuse the previous mode's compiled code
    torch._dynamo.utils.counters.clear()  # graph breaks of this mode's compile (row["graph_breaks"])
    if mode.partition("+")[2] == "cpp":
        import torch._inductor.config as inductor_config

        with inductor_config.patch(cpp_wrapper=True):
            return _measure(a, mode, device, interleave)
    return _measure(a, mode, device, interleave)


def _measure(a, mode: str, device: torch.device, interleave: bool = False):
    from hf_cgpu.models.causal_lm_loss import causal_lm_loss_from_hidden, unwrap_model

    model = build(a.shape, a.tier, mode, device, a.compile, a.compile_backend)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    lm = unwrap_model(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randint(0, lm.config.vocab_size, (a.batch, a.seq), device=device)
    counts: collections.Counter = collections.Counter()
    phase = ["forward"]
    layer = lm.gpt_neox.layers[1]
    watched = {f"layer1.{n}": m for n, m in layer.named_modules() if n and not list(m.children())}
    watched.update({"embed_in": lm.gpt_neox.embed_in, "final_layer_norm": lm.gpt_neox.final_layer_norm,
                    "head": lm.get_output_embeddings()})
    for name, mod in watched.items():
        mod.register_forward_hook(lambda m, i, o, name=name: counts.update([(phase[0], name)]))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(probe: dict | None = None):
        from torch.utils.flop_counter import FlopCounterMode

        phase[0] = "forward"
        fwd_flops, bwd_flops, live = FlopCounterMode(display=False), FlopCounterMode(display=False), LiveBytes()
        with (fwd_flops if probe is not None else _null()), (live.mode if probe is not None else _null()):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = causal_lm_loss_from_hidden(model, x, x, chunk_size=1024)
        kept = live.live
        phase[0] = "backward"
        with bwd_flops if probe is not None else _null():
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if probe is not None:
            probe.update(forward_flops=fwd_flops.get_total_flops(), backward_flops=bwd_flops.get_total_flops(),
                         kept_for_backward_bytes=kept)

    probe: dict = {}
    counts.clear()
    with torch.compiler.set_stance("force_eager"):  # FLOPs, bytes and module calls of the eager step
        step(probe)
    calls = {ph: {n: counts[(ph, n)] for n in watched if counts[(ph, n)]} for ph in ("forward", "backward")}
    for _ in range(a.warmup):  # compiled: the first one compiles
        step()
    if device.type == "cuda":  # the peak of the timed steps, not of the probe step under its dispatch modes
        sync()
        torch.cuda.reset_peak_memory_stats()

    def timed() -> float:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - t0

    row = {"mode": mode, **probe, "calls": calls, "times": [],
           "graph_breaks": dict(torch._dynamo.utils.counters["graph_break"])}
    if interleave:
        return row, timed
    row["times"] = [timed() for _ in range(a.steps)]
    row["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    if a.profile:
        row["profile"] = profile_steps(step, sync, device, a.profile,
                                       trace=f"{a.trace}/lora_{mode.replace('+', '-')}.json" if a.trace else "")
    return row, None


def profile_steps(step, sync, device: torch.device, steps: int, trace: str = "") -> dict:
    """torch.profiler over ``steps`` steps: wall and device-busy ms per step, device ms per kernel category (the
    categories of ``gpu_gpt_profile.py``) and the top kernels; on the CPU, self CPU time per op instead. ``trace``: also
    write the chrome trace there (gzipped) and add where the GPU waited for the host (``trace_gaps.py``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # benchmarks/tools
    from gpu_gpt_profile import kernel_rows

    cuda = device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync()
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    rows, busy, shares = kernel_rows(prof, cuda)
    gaps = None
    if trace and cuda:
        from trace_gaps import export

        gaps = export(prof, trace, steps)
    return {"gaps": gaps, "wall_ms_per_step": wall, "busy_ms_per_step": busy / steps if cuda else None,
            "ms_by_category": {k: ms / steps for k, ms in shares.items()},
            "top": [{"name": r["name"][:120], "ms_per_step": r["ms"] / steps} for r in rows[:10]]}


def finish(row: dict, tokens: int) -> dict:
    med = statistics.median(row["times"])
    row.update(median_s_per_step=med, tok_per_s=tokens / med, times=[round(t, 4) for t in row["times"]])
    row.setdefault("peak_alloc_gib", None)
    return row


def _null():
    import contextlib

    return contextlib.nullcontext()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=list(SHAPES))
    p.add_argument("--tier", default="lora", choices=["lora", "qlora"])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--modes", default="off,full,selective")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
    p.add_argument("--interleave", type=lambda v: v == "true", default=None,
                   help="true: time the modes round-robin, one step each (default on the CPU); false: one after "
                        "another (default on CUDA, where each mode's peak memory is measured alone)")
    p.add_argument("--compile", type=lambda v: v == "true", default=False,
                   help="true: time each mode with the blocks compiled (FLOPs, bytes and calls stay the eager step's)")
    p.add_argument("--compile_backend", default="inductor", help="aot_eager: check the script on a CPU")
    p.add_argument("--profile", type=int, default=0, help="N > 0: also profile N steps of each mode (torch.profiler): "
                   "device ms per kernel category and the top kernels, i.e. where recompute's extra time goes")
    p.add_argument("--trace", default="", help="with --profile: write each mode's chrome trace (gzipped) to this folder "
                   "and print where the GPU waited for the host (benchmarks/tools/trace_gaps.py)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    interleave = a.interleave if a.interleave is not None else device.type == "cpu"
    rows, steps = [], []
    for mode in a.modes.split(","):
        try:
            row, step = measure(a, mode, device, interleave)
        except Exception as exc:  # one variant failing (CUDA graphs, the C++ wrapper) does not cost the other rows
            print(f"{mode}: failed: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        rows.append(row)
        if row["times"]:  # each row as soon as it is measured: a timeout keeps the rows before it
            print(f"{mode}: median {statistics.median(row['times']):.4f} s/step, peak alloc "
                  f"{row['peak_alloc_gib'] or 0:.2f} GiB, graph breaks {row['graph_breaks'] or 'none'}", flush=True)
        steps.append(step)
        if device.type == "cuda" and not interleave:
            torch.cuda.empty_cache()
    if interleave:  # round-robin over the modes: a load change on a shared machine hits every mode alike
        for _ in range(a.steps):
            for row, step in zip(rows, steps):
                row["times"].append(step())
    rows = [finish(r, a.batch * a.seq) for r in rows]
    base = next((r for r in rows if r["mode"] == "off"), rows[0])
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads; " \
                                                                       "ratios indicative only)"
    print(f"{where} | {a.shape} {a.tier} | seq {a.seq} x batch {a.batch} | median of {a.steps} steps"
          + (f" | blocks compiled ({a.compile_backend})" if a.compile else " | eager"))
    print("| recompute | s/step | tok/s | vs off | backward FLOPs / forward FLOPs | kept for the backward | "
          "peak alloc GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        r["vs_off"] = r["median_s_per_step"] / base["median_s_per_step"]
        peak = f"{r['peak_alloc_gib']:.2f}" if r["peak_alloc_gib"] is not None else "n/a"
        print(f"| {r['mode']} | {r['median_s_per_step']:.4f} | {r['tok_per_s']:,.0f} | {r['vs_off'] - 1:+.0%} | "
              f"{r['backward_flops'] / r['forward_flops']:.2f} | {r['kept_for_backward_bytes'] / 2**20:,.1f} MiB | "
              f"{peak} |")
    for r in rows:
        extra = (r["backward_flops"] - base["backward_flops"]) / base["forward_flops"]
        print(f"{r['mode']}: the backward does {extra:+.2f} forwards of FLOPs more than without recompute; "
              f"modules of layer 1 entered again in the backward: {sorted(r['calls']['backward']) or 'none'}; "
              f"embeddings/final norm/head again: "
              f"{[n for n in ('embed_in', 'final_layer_norm', 'head') if n in r['calls']['backward']] or 'none'}")
    for r in rows:
        if "profile" in r:
            pr = r["profile"]
            busy = f", device busy {pr['busy_ms_per_step']:.1f}" if pr["busy_ms_per_step"] is not None else ""
            print(f"{r['mode']} profiled: {pr['wall_ms_per_step']:.1f} ms/step{busy}; "
                  + ", ".join(f"{k} {v:.1f}" for k, v in pr["ms_by_category"].items()))
            for t in pr["top"][:6]:
                print(f"    {t['ms_per_step']:8.2f} ms  {t['name'][:100]}")
            if pr.get("gaps"):
                from trace_gaps import report

                print(report(pr["gaps"], f"{r['mode']} trace"))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": where, "args": vars(a), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
