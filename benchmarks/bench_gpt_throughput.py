"""GPU: hf_cgpu GPT vs nanoGPT and transformers GPT2LMHeadModel (the peers), same shape, same step, same run.

12x768, 12 heads, vocab 32000, seq 1024, micro-batch 16, no biases, SDPA, torch.compile, bf16 autocast, fused
AdamW, gradient clipping at 1.0 (issue 12's identical step). nanoGPT is its own model.py, vendored unchanged in
benchmarks/third_party/nanogpt (MIT). Reports tokens/s (median of timed steps after warm-up), MFU (6N + attention
FLOPs against the bf16 matmul rate measured in this same process) and peak memory.

GPU:  python benchmarks/bench_gpt_throughput.py --variants hf_cgpu-whole-fulllogits,nanogpt,transformers_gpt2 \
          [--batch 8|16|32] --json $OUT/gpt_throughput.json
      add hf_cgpu-fulllogits-cudagraphs / hf_cgpu-fulllogits-autotune to --variants for ours under
      --compile_mode reduce-overhead / max-autotune-no-cudagraphs (the peers stay on torch.compile's default)
CPU:  python benchmarks/bench_gpt_throughput.py --smoke     (tiny shapes, eager: checks the script, no figure)
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


VARIANTS = {  # name: (model, compile scope, loss chunk, torch.compile mode)
    "hf_cgpu-blocks": ("hf_cgpu", "blocks", 1024, None),
    "hf_cgpu-whole": ("hf_cgpu", "whole", 1024, None),
    "hf_cgpu-whole-fulllogits": ("hf_cgpu", "whole", 0, None),
    "hf_cgpu-fulllogits-cudagraphs": ("hf_cgpu", "whole", 0, "reduce-overhead"),  # --compile_mode reduce-overhead
    "hf_cgpu-fulllogits-autotune": ("hf_cgpu", "whole", 0, "max-autotune-no-cudagraphs"),
    "transformers_gpt2": ("gpt2", "whole", 0, None),
    "nanogpt": ("nanogpt", "whole", 0, None),
}
NANOGPT = Path(__file__).resolve().parent / "third_party" / "nanogpt" / "model.py"


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


def run(variant: str, args, peak: float) -> dict:
    kind, scope, chunk, mode = VARIANTS[variant]
    cuda = not args.smoke
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, shape = build(kind, args, chunk)
    model = model.to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    if not cuda:
        step_model = model
    elif scope == "blocks":  # every block compiled in place, loss and head eager
        from hf_cgpu.tiers import apply_compile

        step_model = apply_compile(model, True)
    else:  # the whole forward + loss in one graph
        step_model = torch.compile(model, dynamic=False, mode=mode)
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=dev)
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()  # nanoGPT views its targets

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            if kind == "hf_cgpu":
                loss = step_model(input_ids=inputs, shift_labels=targets, use_cache=False).loss
            elif kind == "nanogpt":
                loss = step_model(inputs, targets)[1]
            else:  # transformers shifts the labels itself
                loss = step_model(input_ids=inputs, labels=inputs, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tok_s = args.batch * args.seq / dt
    flops = flops_per_token(ModelShape.from_config(shape), TrainSetup(seq_len=args.seq))  # 6N + 12 L T d, as the trainer
    return {
        "model": variant, "params_M": round(n_params / 1e6, 1), "tok_per_s": round(tok_s),
        "mfu": round(flops * tok_s / (peak * 1e12), 3),
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
    rows = [run(v, args, peak) for v in args.variants.split(",")]
    where = torch.cuda.get_device_name() if not args.smoke else "CPU (smoke: the script only, no figure)"
    print(f"{where}  torch {torch.__version__}  measured bf16 matmul peak {peak:.0f} TFLOP/s")
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
