"""GPU: hf_cgpu GPT vs nanoGPT and transformers GPT2LMHeadModel (the peers), same shape, same step, same run.

12x768, 12 heads, vocab 32000, seq 1024, micro-batch 16, no biases, SDPA, torch.compile, bf16 autocast, fused
AdamW, gradient clipping at 1.0 (issue 12's identical step). nanoGPT is its own model.py, vendored unchanged in
benchmarks/third_party/nanogpt (MIT). Reports tokens/s (median of timed steps after warm-up), MFU (6N + attention
FLOPs against the bf16 matmul rate measured in this same process) and peak memory.

GPU:  python benchmarks/throughput/bench_gpt_throughput.py --variants hf_cgpu-whole-fulllogits,nanogpt,transformers_gpt2 \
          [--batch 8|16|32] --json $OUT/gpt_throughput.json
      more of ours in --variants (VARIANTS below): cuDNN attention, cut_cross_entropy's fused head + loss, a compiled
      clip + optimizer, compile modes reduce-overhead / max-autotune, torchao float8; nanogpt-cudnn for the peer
CPU:  python benchmarks/throughput/bench_gpt_throughput.py --smoke     (tiny shapes, eager: checks the script, no figure)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_cgpu.bench import measure_matmul
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.budget import ModelShape, TrainSetup, flops_per_token



def _v(model="hf_cgpu", scope="whole", chunk=0, mode=None, attn=None, loss="model", fp8=False, opt="fused",
       tune=False):
    return dict(model=model, scope=scope, chunk=chunk, mode=mode, attn=attn, loss=loss, fp8=fp8, opt=opt, tune=tune)


# name: how the step is built. chunk: the model's loss_chunk_size; mode: torch.compile's mode; attn "cudnn": SDPA
# pinned to cuDNN's attention (flash otherwise); loss "cce": the head + loss through cut_cross_entropy's fused kernel
# (never builds the logits); fp8: torchao float8 training of the blocks' linears (not the identical step: its own
# row); opt "compiled": clipping + AdamW (foreach) in one compiled function instead of fused AdamW; tune: inductor's
# coordinate descent tuning of the Triton kernels' block sizes (+2.7% on the flow UNet's step, RESULTS.md 2026-12-02).
VARIANTS = {
    "hf_cgpu-blocks": _v(scope="blocks", chunk=1024),
    "hf_cgpu-whole": _v(chunk=1024),
    "hf_cgpu-whole-fulllogits": _v(),
    "hf_cgpu-cudnn": _v(attn="cudnn"),
    "hf_cgpu-cce": _v(loss="cce"),
    "hf_cgpu-cudnn-cce": _v(attn="cudnn", loss="cce"),
    "hf_cgpu-compiled-opt": _v(opt="compiled"),
    "hf_cgpu-cudnn-cce-compiled-opt": _v(attn="cudnn", loss="cce", opt="compiled"),
    "hf_cgpu-fulllogits-cudagraphs": _v(mode="reduce-overhead"),
    "hf_cgpu-fulllogits-autotune": _v(mode="max-autotune-no-cudagraphs"),
    "hf_cgpu-fp8": _v(fp8=True),
    "hf_cgpu-cudnn-cce-fp8": _v(attn="cudnn", loss="cce", fp8=True),
    "nanogpt-cudnn": _v(model="nanogpt", attn="cudnn"),
    "nanogpt-autotune": _v(model="nanogpt", mode="max-autotune-no-cudagraphs"),
    "hf_cgpu-fulllogits-tune": _v(tune=True),
    "nanogpt-tune": _v(model="nanogpt", tune=True),
    "transformers_gpt2": _v(model="gpt2"),
    "nanogpt": _v(model="nanogpt"),
}
NANOGPT = Path(__file__).resolve().parents[1] / "third_party" / "nanogpt" / "model.py"


def nanogpt_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("nanogpt_model", NANOGPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(kind: str, args, chunk: int = 1024):
    dims = dict(n_embd=args.width, n_layer=args.layers, n_head=args.heads)
    shape = CgptConfig(vocab_size=args.vocab, n_positions=args.seq, **dims)
    if kind == "hf_cgpu":
        cfg = CgptConfig(vocab_size=args.vocab, n_positions=args.seq, **dims, loss_chunk_size=chunk)
        return CgptForCausalLM(cfg), cfg
    if kind == "nanogpt":
        nano = nanogpt_module()
        cfg = nano.GPTConfig(block_size=args.seq, vocab_size=args.vocab, dropout=0.0, bias=False, **dims)
        return nano.GPT(cfg), shape
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, **dims, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg), shape


def attention_backends(attn):
    """Context pinning SDPA's backend (picked when the graph is traced, so it wraps warm-up and timing)."""
    from contextlib import nullcontext

    if attn is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[attn]])


def run(variant: str, args, peak: float) -> dict:
    v = VARIANTS[variant]
    kind = v["model"]
    cuda = not args.smoke
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, shape = build(kind, args, v["chunk"])
    model = model.to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())
    if v["fp8"]:  # torchao float8 training: the blocks' linears (the tied head stays bf16)
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model.transformer, module_filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear))
    compiled_opt = v["opt"] == "compiled"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda and not compiled_opt,
                            foreach=True if compiled_opt else None)
    cce = v["loss"] == "cce"
    if cce:
        assert kind == "hf_cgpu", "the cce loss is wired for hf_cgpu's model"
        from cut_cross_entropy import linear_cross_entropy
    target = model.transformer if cce else model  # cce: the trunk compiled, the fused head + loss outside
    if not cuda:
        step_model = target
    elif v["scope"] == "blocks":  # every block compiled in place, loss and head eager
        from hf_cgpu.tiers import apply_compile

        step_model = apply_compile(target, True)
    elif v["tune"]:
        step_model = torch.compile(target, dynamic=False, options={"coordinate_descent_tuning": True})
    else:  # the whole forward + loss in one graph
        step_model = torch.compile(target, dynamic=False, mode=v["mode"])
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=dev)
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()  # nanoGPT views its targets

    def clip_and_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    update = torch.compile(clip_and_step) if compiled_opt and cuda else clip_and_step

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            if cce:
                hidden = step_model(input_ids=inputs, use_cache=False).last_hidden_state
                loss = linear_cross_entropy(hidden.to(torch.bfloat16), model.lm_head.weight.to(torch.bfloat16),
                                            targets)
            elif kind == "hf_cgpu":
                loss = step_model(input_ids=inputs, shift_labels=targets, use_cache=False).loss
            elif kind == "nanogpt":
                loss = step_model(inputs, targets)[1]
            else:  # transformers shifts the labels itself
                loss = step_model(input_ids=inputs, labels=inputs, use_cache=False).loss
        loss.backward()
        update()
        opt.zero_grad(set_to_none=True)
        return loss

    with attention_backends(v["attn"]):
        for _ in range(args.warmup):
            loss = step()
        sync()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = step()
            sync()
            times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tok_s = args.batch * args.seq / dt
    flops = flops_per_token(ModelShape.from_config(shape), TrainSetup(seq_len=args.seq))  # 6N + 12 L T d, as the trainer
    return {
        "model": variant, "params_M": round(n_params / 1e6, 1), "tok_per_s": round(tok_s),
        "mfu": round(flops * tok_s / (peak * 1e12), 3), "last_loss": round(float(loss), 4),
        "peak_alloc_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", default="")
    p.add_argument("--variants", default="hf_cgpu-whole-fulllogits,nanogpt,transformers_gpt2")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager: checks the script only")
    args = p.parse_args()
    args.vocab, args.width, args.layers, args.heads = (32000, 768, 12, 12) if not args.smoke else (256, 32, 2, 2)
    if args.smoke:
        args.batch, args.seq, args.warmup, args.steps = 2, 32, 1, 2
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = measure_matmul(8192) if not args.smoke else 1.0
    where = torch.cuda.get_device_name() if not args.smoke else "CPU (smoke: the script only, no figure)"
    print(f"{where}  torch {torch.__version__}  measured bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    print("| model | params (M) | tok/s | MFU | loss after the steps | peak alloc GiB | peak reserved GiB |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for name in args.variants.split(","):  # each row printed and saved when done: a timeout keeps the rows before it
        try:
            r = run(name, args, peak)
        except Exception as exc:  # one variant's library failing (cce, torchao) does not cost the others
            r = {"model": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"| {name} | failed: {r['error']} |", flush=True)
        else:
            print(f"| {r['model']} | {r['params_M']} | {r['tok_per_s']:,} | {r['mfu']} | {r['last_loss']} | "
                  f"{r['peak_alloc_GiB']} | {r['peak_reserved_GiB']} |", flush=True)
        rows.append(r)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"peak_tflops": peak, "device": where, "torch": torch.__version__, "rows": rows}, fh,
                          indent=1)


if __name__ == "__main__":
    main()
