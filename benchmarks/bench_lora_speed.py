"""GPU: LoRA and QLoRA tokens/s on the Pythia-1.4B shape, ours against stock peft, in one process (issue 12).

Stock peft is what a user following the peft / bitsandbytes docs writes (``benchmarks/bench_memory.py:stock_peft``),
here without gradient checkpointing, its fastest setting that fits 16 GB. Ours is what ``recipes/finetune_lora.py
--preset lora`` / ``qlora`` runs (``apply_tiers`` + the chunked loss), eager and with ``--compile true`` (each block
compiled). Seq 1024, micro-batch 4, accumulation 2, bf16; median of the timed steps after the warm-up ones (the first
compiles); peak memory of the timed steps. Each row prints as it finishes, so a cut call keeps the rows before it.

    python benchmarks/bench_lora_speed.py --json $OUT/lora_speed.json        # on the GPU (gpu_speed.sh lora-speed)
    python benchmarks/bench_lora_speed.py --dry_run                          # CPU smoke test, tiny GPTNeoX
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from bench_memory import GiB, pythia_dir, stock_peft, step_fn
from hf_cgpu.tiers import apply_tiers, build_optimizer, load_base_model

# (name, tier, ours, compile)
ROWS = {
    "lora-stock": ("LoRA, stock peft (eager)", "lora", False, False),
    "lora-compiled": ("LoRA, ours --compile true", "lora", True, True),
    "lora-eager": ("LoRA, ours eager", "lora", True, False),
    "qlora-stock": ("QLoRA, stock peft (eager)", "qlora", False, False),
    "qlora-compiled": ("QLoRA, ours --compile true", "qlora", True, True),
    "qlora-eager": ("QLoRA, ours eager", "qlora", True, False),
}


def build(tier: str, ours: bool, compile: bool, path: Path, device, backend: str):
    if not ours:
        model, opt = stock_peft(path, tier == "qlora", device, gradient_checkpointing=False)
        return model, opt, "stock"
    model = load_base_model(str(path), tier, device_map={"": device} if tier == "qlora" else None)
    if tier != "qlora":
        model = model.to(device)
    model = apply_tiers(model, tier, recompute=False, compile=compile, compile_backend=backend)
    return model, build_optimizer(model, tier, lr=1e-4), "neox"


def measure(key: str, args, device, path: Path) -> dict:
    name, tier, ours, compile = ROWS[key]
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t_build = time.perf_counter()
    model, opt, kind = build(tier, ours, compile, path, device, args.compile_backend)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len + 1), device=device)
    step = step_fn(model, opt, kind, ids, args.accumulation, device)
    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warm_s = time.perf_counter() - t_build
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tokens = args.batch * args.seq_len * args.accumulation
    row = {"row": key, "config": name, "tier": tier, "ours": ours, "compile": compile,
           "s_per_step": round(statistics.median(times), 4), "tok_per_s": round(tokens / statistics.median(times)),
           "build_and_warmup_s": round(warm_s, 1)}
    if device.type == "cuda":
        row["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
        row["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / GiB, 2)
    del model, opt, step
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, in order: {', '.join(ROWS)}")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--root", default="/tmp/hf_cgpu_bench")
    p.add_argument("--compile_backend", default="inductor", help="aot_eager: check the script on a CPU")
    p.add_argument("--json", default="")
    p.add_argument("--dry_run", action="store_true", help="tiny GPTNeoX, seq 64, on the CPU")
    args = p.parse_args()
    keys = [k for k in args.rows.split(",") if k]
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.dry_run:
        args.seq_len, args.steps, args.warmup = 64, 2, 1
        keys = [k for k in keys if not k.startswith("qlora")]  # bitsandbytes' 4-bit layers need a GPU
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    path = pythia_dir(root, args.dry_run)
    rows = []
    for key in keys:
        try:
            rows.append(measure(key, args, device, path))
        except Exception as err:  # one failing row must not lose the others
            rows.append({"row": key, "config": ROWS[key][0], "error": f"{type(err).__name__}: {err}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n{dev} | torch {torch.__version__} | {'tiny GPTNeoX' if args.dry_run else 'Pythia-1.4B shape'} | "
          f"seq {args.seq_len} x micro-batch {args.batch} x accumulation {args.accumulation} | median of {args.steps}")
    print("| config | s/step | tok/s | vs stock peft | peak alloc GiB |\n|---|---|---|---|---|")
    stock = {r["tier"]: r["tok_per_s"] for r in rows if "error" not in r and not r["ours"]}
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | failed: {r['error']} |")
            continue
        ratio = f"{r['tok_per_s'] / stock[r['tier']]:.2f}x" if r["tier"] in stock else "-"
        print(f"| {r['config']} | {r['s_per_step']} | {r['tok_per_s']:,} | {ratio} | {r.get('peak_alloc_GiB', '-')} |")


if __name__ == "__main__":
    main()
