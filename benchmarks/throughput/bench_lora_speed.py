"""GPU: LoRA and QLoRA tokens/s, ours against stock peft (and Unsloth), in one call (issues 12 and 17).

Stock peft is what a user following the peft / bitsandbytes docs writes (``benchmarks/memory/bench_memory.py:stock_peft``),
here without gradient checkpointing, its fastest setting that fits 16 GB. Ours is what ``recipes/finetune_lora.py
--preset lora`` / ``qlora`` runs (``apply_tiers`` + the chunked loss), eager and with ``--compile true`` (each block
compiled), and with recompute (the low-memory rung) eager and compiled. Unsloth is
``FastLanguageModel.from_pretrained`` + ``get_peft_model`` with the same rank, alpha and target modules, without
gradient checkpointing; its rows must run in a process of their own (Unsloth patches transformers and peft when
imported), so pass them alone: ``--rows unsloth-lora,unsloth-qlora``.

Shapes, random weights (speed and memory do not depend on the values), saved once under ``--root`` with a small
tokenizer: ``pythia-1.4b`` (GPTNeoX) and ``tinyllama-1.1b`` (Llama: 22 x 2048, 32 heads, 4 KV heads, the
architecture Unsloth targets). Seq 1024, micro-batch 4, accumulation 2, bf16; median of the timed steps after the
warm-up ones (the first compiles); peak memory of the timed steps. Rows print as they finish, and the JSON file is
rewritten after each, so a cut call keeps the rows before it.

    python benchmarks/throughput/bench_lora_speed.py --json $OUT/lora_speed.json        # on the GPU (gpu_speed.sh lora-speed)
    python benchmarks/throughput/bench_lora_speed.py --shape tinyllama-1.1b --rows unsloth-lora --json $OUT/unsloth.json
    python benchmarks/throughput/bench_lora_speed.py --dry_run                          # CPU smoke test, tiny shapes
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "memory"))  # bench_memory: benchmarks/memory

# (name, tier, whose, compile, recompute); whose: ours, stock (peft), unsloth
ROWS = {
    "lora-stock": ("LoRA, stock peft (eager)", "lora", "stock", False, False),
    "lora-compiled": ("LoRA, ours --compile true", "lora", "ours", True, False),
    "lora-eager": ("LoRA, ours eager", "lora", "ours", False, False),
    "qlora-stock": ("QLoRA, stock peft (eager)", "qlora", "stock", False, False),
    "qlora-compiled": ("QLoRA, ours --compile true", "qlora", "ours", True, False),
    "qlora-eager": ("QLoRA, ours eager", "qlora", "ours", False, False),
    "lora-graphs": ("LoRA, ours --compile true --compile_mode reduce-overhead", "lora", "ours", True, False),
    "qlora-graphs": ("QLoRA, ours --compile true --compile_mode reduce-overhead", "qlora", "ours", True, False),
    "lora-recompute-graphs": ("LoRA, ours --recompute true --compile_mode reduce-overhead", "lora", "ours", True, True),
    "lora-recompute-eager": ("LoRA, ours --recompute true, eager", "lora", "ours", False, True),
    "lora-recompute-compiled": ("LoRA, ours --recompute true --compile true", "lora", "ours", True, True),
    "unsloth-lora": ("LoRA, Unsloth", "lora", "unsloth", False, False),
    "unsloth-qlora": ("QLoRA, Unsloth (4-bit)", "qlora", "unsloth", False, False),
}
DEFAULT_ROWS = [k for k, v in ROWS.items() if v[2] != "unsloth" and not v[4]]
"""The recompute rows (the low-memory rung, eager vs compiled in one harness) run when named in --rows."""
TINYLLAMA = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=512, max_position_embeddings=128, tie_word_embeddings=False)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def checkpoint_dir(root: Path, shape: str, dry: bool) -> Path:
    """The random-weight checkpoint of ``shape`` (made once), with a small tokenizer beside it for loaders that
    want one (Unsloth); the ids fed to the model are random anyway."""
    import torch

    if shape == "pythia-1.4b":
        from bench_memory import pythia_dir

        path = pythia_dir(root, dry)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        path = root / ("tiny-llama" if dry else "tinyllama-1.1b-shape")
        if not (path / "config.json").is_file():
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = LlamaForCausalLM(LlamaConfig(**(TINY_LLAMA if dry else TINYLLAMA))).to(torch.bfloat16)
            model.save_pretrained(path)
            del model
    if not (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
        tok.train_from_iterator(["a random-weight checkpoint for speed and memory only"] * 4,
                                trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                pad_token="<unk>").save_pretrained(path)
    return path


def unsloth_peft(path: Path, quantized: bool, seq_len: int, device):
    import torch
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(str(path), max_seq_length=seq_len, dtype=torch.bfloat16,
                                                 load_in_4bit=quantized, fix_tokenizer=False, local_files_only=True)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                                             target_modules=LLAMA_TARGETS, use_gradient_checkpointing=False)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=device.type == "cuda")
    return model, opt


def build(tier: str, whose: str, compile: bool, recompute: bool, path: Path, device, args, mode: str | None = None):
    from bench_memory import stock_peft
    from hf_cgpu.optim import build_optimizer
    from hf_cgpu.settings import TrainSettings
    from hf_cgpu.tiers import apply_tiers, load_base_model

    if whose == "stock":
        model, opt = stock_peft(path, tier == "qlora", device, gradient_checkpointing=False)
        return model, opt, "stock"
    if whose == "unsloth":
        model, opt = unsloth_peft(path, tier == "qlora", args.seq_len, device)
        return model, opt, "stock"  # the same call as stock peft: model(input_ids, labels).loss
    model = load_base_model(str(path), tier, device_map={"": device} if tier == "qlora" else None)
    if tier != "qlora":
        model = model.to(device)
    settings = TrainSettings(tier=tier, recompute=recompute, compile=compile, compile_mode=mode or "default",
                             learning_rate=1e-4, train_mode="finetune")
    model = apply_tiers(model, settings, backend=args.compile_backend)
    return model, build_optimizer(model, settings), "neox"


def measure(key: str, args, device, path: Path) -> dict:
    import torch
    from bench_memory import GiB, step_fn, timed_steps

    name, tier, whose, compile, recompute = ROWS[key]
    mode = "reduce-overhead" if key.endswith("-graphs") else None  # CUDA graphs: peak_reserved_GiB holds their pool
    torch._dynamo.reset()  # the same blocks in another row must compile again, not reuse this process's graphs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t_build = time.perf_counter()
    model, opt, kind = build(tier, whose, compile, recompute, path, device, args, mode)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len + 1), device=device)
    step = step_fn(model, opt, kind, ids, args.accumulation, device, cuda_graphs=mode is not None)
    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warm_s = time.perf_counter() - t_build
    times = timed_steps(step, args.steps, device)
    tokens = args.batch * args.seq_len * args.accumulation
    row = {"row": key, "config": name, "shape": args.shape, "tier": tier, "whose": whose, "compile": compile,
           "recompute": recompute,
           "s_per_step": round(statistics.median(times), 4), "tok_per_s": round(tokens / statistics.median(times)),
           "build_and_warmup_s": round(warm_s, 1)}
    if device.type == "cuda":
        row["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
        row["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / GiB, 2)
    del model, opt, step
    return row


def table(rows: list[dict], stock: dict[str, int]) -> str:
    """Markdown rows; ``stock``: stock peft's tok/s by tier (from this run or ``--stock_json``)."""
    out = ["| config | s/step | tok/s | vs stock peft | peak alloc GiB | peak reserved GiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['config']} | failed: {r['error']} |")
            continue
        ratio = f"{r['tok_per_s'] / stock[r['tier']]:.2f}x" if r["tier"] in stock else "-"
        out.append(f"| {r['config']} | {r['s_per_step']} | {r['tok_per_s']:,} | {ratio} | "
                   f"{r.get('peak_alloc_GiB', '-')} | {r.get('peak_reserved_GiB', '-')} |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, in order: {', '.join(ROWS)}")
    p.add_argument("--shape", default="pythia-1.4b", choices=["pythia-1.4b", "tinyllama-1.1b"])
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--root", default="/tmp/hf_cgpu_bench")
    p.add_argument("--compile_backend", default="inductor", help="aot_eager: check the script on a CPU")
    p.add_argument("--stock_json", default="", help="a JSON of this script with the stock rows, for the ratios")
    p.add_argument("--json", default="")
    p.add_argument("--dry_run", action="store_true", help="tiny shapes, seq 64, on the CPU (no 4-bit, no Unsloth)")
    args = p.parse_args()
    keys = [k for k in args.rows.split(",") if k]
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    if any(ROWS[k][2] == "unsloth" for k in keys):
        if any(ROWS[k][2] != "unsloth" for k in keys):
            raise SystemExit("Unsloth patches transformers and peft when imported: run its rows in a process of "
                             "their own (--rows unsloth-lora,unsloth-qlora)")
        if args.shape == "pythia-1.4b":
            raise SystemExit("Unsloth rows need a Llama shape: --shape tinyllama-1.1b")
        import unsloth  # noqa: F401  (first, before transformers, as Unsloth requires)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.dry_run:
        args.seq_len, args.steps, args.warmup = 64, 2, 1
        keys = [k for k in keys if ROWS[k][1] != "qlora" and ROWS[k][2] != "unsloth"]  # those need a GPU
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    path = checkpoint_dir(root, args.shape, args.dry_run)
    rows = []
    for key in keys:
        try:
            rows.append(measure(key, args, device, path))
        except Exception as err:  # one failing row must not lose the others
            rows.append({"row": key, "config": ROWS[key][0], "error": f"{type(err).__name__}: {err}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    found = rows + (json.loads(Path(args.stock_json).read_text()) if args.stock_json else [])
    stock = {r["tier"]: r["tok_per_s"] for r in found if "error" not in r and r["whose"] == "stock"}
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n{dev} | torch {torch.__version__} | {args.shape}{' (tiny)' if args.dry_run else ''} shape | "
          f"seq {args.seq_len} x micro-batch {args.batch} x accumulation {args.accumulation} | median of {args.steps}")
    print(table(rows, stock))


if __name__ == "__main__":
    main()
