"""GPU: measured peak memory (and tokens/s) of real training steps beside the ledger's prediction.

Each configuration runs the code the recipes run (``hf_cgpu.tiers``, ``hf_cgpu.optim`` + the models' losses), seq
1024, two micro-batches per optimizer step (gradients alive across accumulation, as in real runs), eager (no compile).
Peers in the same run: stock peft LoRA and stock QLoRA (prepare_model_for_kbit_training) on the same
Pythia-1.4B-shaped model (random weights: memory and speed do not depend on the values); the ledger counts them with
``peers.stock_ledger``.

    python benchmarks/memory/bench_memory.py --json $OUT/memory.json           # on the GPU
    python benchmarks/memory/bench_memory.py --dry_run                          # CPU smoke test of the harness, tiny shapes
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from hf_cgpu import budget
from hf_cgpu.commands.budget import preset_shape
from hf_cgpu.models.causal_lm_loss import causal_lm_loss_from_hidden
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.optim import build_optimizer
from hf_cgpu.settings import TrainSettings, load_preset
from hf_cgpu.tiers import apply_tiers, load_base_model
from peers import stock_ledger

GiB = 2**30
PYTHIA_SHAPE = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, intermediate_size=8192,
                    vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True,
                    tie_word_embeddings=False)
TINY_NEOX = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=512,
                 max_position_embeddings=128, rotary_pct=0.25, tie_word_embeddings=False)

# (name, model, tier, recompute, micro_batch)
CONFIGS = [
    ("gpt-124m full", "124m", "full", False, 16),
    ("gpt-124m full+recompute", "124m", "full", True, 16),
    ("gpt-350m full", "350m", "full", False, 8),
    ("gpt-350m full+recompute", "350m", "full", True, 8),
    ("gpt-350m adamw8bit", "350m", "adamw8bit", False, 8),
    ("gpt-770m full", "770m", "full", False, 4),
    ("gpt-770m full+recompute", "770m", "full", True, 8),
    ("gpt-770m adamw8bit+recompute", "770m", "adamw8bit", True, 8),
    ("pythia-1.4b lora (ours)", "pythia", "lora", True, 4),
    ("pythia-1.4b qlora (ours)", "pythia", "qlora", True, 4),
    ("pythia-1.4b lora (stock peft)", "pythia", "stock-lora", True, 4),
    ("pythia-1.4b qlora (stock peft)", "pythia", "stock-qlora", True, 4),
]


def gpt_model(preset: str, dry: bool) -> CgptForCausalLM:
    p = load_preset(preset, "gpt")
    if dry:
        p = {**p, "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512}
    cfg = CgptConfig(vocab_size=p["vocab_size"], n_positions=1024, n_embd=p["n_embd"], n_layer=p["n_layer"],
                     n_head=p["n_head"], loss_chunk_size=1024)
    return CgptForCausalLM(cfg)


def pythia_dir(root: Path, dry: bool) -> Path:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    path = root / ("tiny-neox" if dry else "pythia-1.4b-shape")
    if not (path / "config.json").is_file():
        cfg = GPTNeoXConfig(**(TINY_NEOX if dry else PYTHIA_SHAPE))
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = GPTNeoXForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(path)
        del model
    return path


def stock_peft(path: Path, quantized: bool, device, gradient_checkpointing: bool = True):
    """What a user following the peft/bitsandbytes docs would write (with gradient checkpointing: the memory rows)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw = {"dtype": torch.bfloat16}
    if quantized:
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=torch.bfloat16)
        kw["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    else:
        model = model.to(device)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            fused=device.type == "cuda")
    return model, opt


def build(model_name: str, tier: str, recompute: bool, device, root: Path, dry: bool):
    if model_name == "pythia":
        path = pythia_dir(root, dry)
        if tier.startswith("stock-"):
            model, opt = stock_peft(path, tier == "stock-qlora", device)
            return model, opt, "stock", budget.ModelShape.from_config_file(path / "config.json")
        settings = TrainSettings(tier=tier, recompute=recompute, learning_rate=1e-4, train_mode="finetune")
        model = load_base_model(str(path), tier, device_map={"": device} if tier == "qlora" else None)
        if tier != "qlora":
            model = model.to(device)
        model = apply_tiers(model, settings, compile=False)
        kind = "neox"
        shape = budget.ModelShape.from_config_file(path / "config.json")
    else:
        settings = TrainSettings(tier=tier, recompute=recompute, learning_rate=1e-4, train_mode="pretrain")
        model = apply_tiers(gpt_model(model_name, dry).to(device), settings, compile=False)
        kind = "gpt"
        shape = preset_shape(model_name) if not dry else None
    return model, build_optimizer(model, settings), kind, shape


def step_fn(model, opt, kind: str, ids: torch.Tensor, accumulation: int, device, cuda_graphs: bool = False):
    """One optimizer step over ``accumulation`` micro-batches of ``ids``; ``cuda_graphs``: the model runs under CUDA
    graphs, so each micro-batch is prepared as the trainer's loop does (``before_graphed_micro_batch``)."""
    from hf_cgpu.train.step import before_graphed_micro_batch

    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        for k in range(accumulation):
            if cuda_graphs:
                before_graphed_micro_batch(params, k, accumulation)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                if kind == "gpt":
                    loss = model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], use_cache=False).loss
                elif kind == "neox":
                    loss = causal_lm_loss_from_hidden(model, ids[:, :-1], ids[:, :-1])
                else:
                    loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1], use_cache=False).loss
            (loss / accumulation).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed_steps(step, n: int, device) -> list[float]:
    """Wall seconds of each of ``n`` calls of ``step``, the device synchronised after each."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def measure(name, model_name, tier, recompute, mb, args, device, root) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    seq = 64 if args.dry_run else args.seq_len
    model, opt, kind, shape = build(model_name, tier, recompute, device, root, args.dry_run)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (mb, seq + 1), device=device)
    step = step_fn(model, opt, kind, ids, args.accumulation, device)
    times = timed_steps(step, args.steps, device)
    row = {"config": name, "tier": tier, "recompute": recompute, "micro_batch": mb, "seq_len": seq,
           "accumulation": args.accumulation,
           "tok_per_s": round(mb * seq * args.accumulation / statistics.median(times[2:] or times))}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        row["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
        row["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / GiB, 2)
        row["context_GiB"] = round((total - free - torch.cuda.memory_reserved()) / GiB, 2)
    if shape is not None:
        stock = tier.startswith("stock-")
        setup = budget.TrainSetup(seq_len=seq, micro_batch_size=mb, gradient_accumulation_steps=args.accumulation,
                                  tier=tier.replace("stock-", ""), recompute=recompute,
                                  loss_chunk_size=0 if stock else 1024)
        led = stock_ledger(shape, setup) if stock else budget.ledger(shape, setup)
        row["ledger_alloc_GiB"] = round(led.allocated / GiB, 2)
        row["ledger_total_GiB"] = round(led.total / GiB, 2)
        if "peak_alloc_GiB" in row:
            row["error_pct"] = round(100 * (led.allocated / GiB - row["peak_alloc_GiB"]) / row["peak_alloc_GiB"], 1)
    del model, opt, step
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", default="", help="comma-separated substrings of config names to run")
    p.add_argument("--root", default="/tmp/hf_cgpu_bench")
    p.add_argument("--json", default="")
    p.add_argument("--dry_run", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    configs = [c for c in CONFIGS if not args.only or any(s in c[0] for s in args.only.split(","))]
    if any(c[1] == "pythia" for c in configs):
        pythia_dir(root, args.dry_run)  # create the random checkpoint before any peak is measured
    rows = []
    for cfg in configs:
        try:
            rows.append(measure(*cfg, args=args, device=device, root=root))
        except Exception as err:  # keep going: one failing config must not lose the others' numbers
            rows.append({"config": cfg[0], "error": f"{type(err).__name__}: {err}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n{name}  torch {torch.__version__}  seq {args.seq_len}, accumulation {args.accumulation}, eager")
    print("| config | micro-batch | tok/s | peak alloc GiB | ledger alloc GiB | error | peak reserved GiB | "
          "ledger total GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | failed: {r['error']} |")
            continue
        print(f"| {r['config']} | {r['micro_batch']} | {r['tok_per_s']:,} | {r.get('peak_alloc_GiB', '-')} | "
              f"{r.get('ledger_alloc_GiB', '-')} | {r.get('error_pct', '-')}% | {r.get('peak_reserved_GiB', '-')} | "
              f"{r.get('ledger_total_GiB', '-')} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
