"""GPU: hf_cgpu GPT vs transformers GPT2LMHeadModel (the peer), same shape, same training step, same run.

12x768, 12 heads, vocab 32000, seq 1024, micro-batch 16, SDPA, torch.compile, bf16 autocast, fused AdamW.
Reports tokens/s (median of timed steps after warm-up), MFU (6N + attention FLOPs against the bf16 matmul rate
measured in this same process) and peak memory. Usage: python benchmarks/bench_gpt_throughput.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hf_cgpu.bench import measure_matmul
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.budget import ModelShape, TrainSetup, flops_per_token


VARIANTS = {  # name: (model, compile scope, loss chunk)
    "hf_cgpu-blocks": ("hf_cgpu", "blocks", 1024),
    "hf_cgpu-whole": ("hf_cgpu", "whole", 1024),
    "hf_cgpu-whole-fulllogits": ("hf_cgpu", "whole", 0),
    "transformers_gpt2": ("gpt2", "whole", 0),
}


def build(kind: str, args, chunk: int = 1024):
    if kind == "hf_cgpu":
        cfg = CgptConfig(vocab_size=32000, n_positions=args.seq, n_embd=768, n_layer=12, n_head=12,
                         loss_chunk_size=chunk)
        return CgptForCausalLM(cfg), cfg
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=32000, n_positions=args.seq, n_embd=768, n_layer=12, n_head=12,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg), CgptConfig(vocab_size=32000, n_positions=args.seq, n_embd=768, n_layer=12,
                                            n_head=12)


def run(variant: str, args, peak: float) -> dict:
    kind, scope, chunk = VARIANTS[variant]
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, shape = build(kind, args, chunk)
    model = model.cuda().train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if scope == "blocks":  # every block compiled in place, loss and head eager
        from hf_cgpu.tiers import apply_compile

        step_model = apply_compile(model, True)
    else:  # the whole forward + loss in one graph
        step_model = torch.compile(model, dynamic=False)
    x = torch.randint(0, 32000, (args.batch, args.seq + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if kind == "hf_cgpu":
                loss = step_model(input_ids=x[:, :-1], shift_labels=x[:, 1:], use_cache=False).loss
            else:
                loss = step_model(input_ids=x[:, :-1], labels=x[:, :-1], use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tok_s = args.batch * args.seq / dt
    flops = flops_per_token(ModelShape.from_config(shape), TrainSetup(seq_len=args.seq))  # 6N + 12 L T d, as the trainer
    return {
        "model": variant, "params_M": round(n_params / 1e6, 1), "tok_per_s": round(tok_s),
        "mfu": round(flops * tok_s / (peak * 1e12), 3),
        "peak_alloc_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 2),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", default="")
    p.add_argument("--variants", default="hf_cgpu-blocks,transformers_gpt2")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = measure_matmul(8192)
    rows = [run(v, args, peak) for v in args.variants.split(",")]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  measured bf16 matmul peak {peak:.0f} TFLOP/s")
    print("| model | params (M) | tok/s | MFU | peak alloc GiB | peak reserved GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params_M']} | {r['tok_per_s']:,} | {r['mfu']} | {r['peak_alloc_GiB']} | "
              f"{r['peak_reserved_GiB']} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"peak_tflops": peak, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
