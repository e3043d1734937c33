"""DPO of the Pythia-1.4B shape on zh-poetry preference pairs: TRL's DPOTrainer against `hf-cgpu train dpo`.

Data: benchmarks/finetune/make_preferences.py's pairs (continue a poem: its real next line chosen, a line of the same
length from another poem rejected), conversational (one chat template renders them for both), tokenized by a
byte-level BPE trained here on the poems. The model: the Pythia-1.4B config with random weights (no download), bf16,
LoRA r16 on every linear layer, a fresh adapter whose reference is the base (TRL: a peft model with ref_model=None,
the adapter disabled for the reference; ours: --require_adapter false, the reference log-probabilities computed once
before the first step), beta 0.1, the same learning rate, pairs per step and one pass over the same pairs. Rows,
each in a fresh process:

  trl          DPOTrainer with its defaults besides those (its padding, its gradient checkpointing)
  ours         hf-cgpu train dpo --packing false: a micro-batch of N pairs is 2N padded rows, as TRL's
  ours_packed  hf-cgpu train dpo --packing true: whole pairs packed into rows of 2 x --seq_len

Reported per row: pairs trained per second over the pass (and after the first optimizer step; ours also counting its
reference pass), peak memory reserved and allocated, and on the held-out pairs after the pass: the reward accuracy
(the share of pairs whose chosen answer earns the larger implicit reward) and the mean reward margin. Results go to
OUT/dpo_vs_trl.jsonl and OUT/dpo_vs_trl.md as each row ends, every row's log to OUT/dpo_rows.log. --smoke: a tiny
shape on the CPU (the TRL row needs `pip install trl`; hf_cgpu itself never imports it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sft_vs_trl import CHAT, PYTHIA, TINY, GiB, StepClock, bench_main  # noqa: E402
from make_preferences import pairs, poems, write  # noqa: E402

ROWS = ("ours", "trl", "ours_packed", "ours_low")
LOW_MEMORY = ["--recompute", "true", "--compile_mode", "default"]
"""``ours_low``: packed pairs, every block re-run in the backward, no CUDA graphs (their pool holds memory)."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--zh", default=".data/zh-poetry", help="zh-poetry folder (train.parquet, validation.parquet)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/dpo_vs_trl"))
    p.add_argument("--work", default="/tmp/dpo_vs_trl_work")
    p.add_argument("--rows", default=",".join(ROWS), help="rows to run, in this order")
    p.add_argument("--pairs", type=int, default=768, help="training pairs (one pass)")
    p.add_argument("--eval_pairs", type=int, default=200)
    p.add_argument("--seq_len", type=int, default=256, help="tokens of prompt + one answer (TRL's max_length)")
    p.add_argument("--micro", type=int, default=8, help="pairs per micro-batch")
    p.add_argument("--batch", type=int, default=16, help="pairs per optimizer step")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds from start: no row starts after it")
    p.add_argument("--compile", default="true", help="our rows' --compile (the dpo preset compiles each block)")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, few pairs")
    p.add_argument("--row", help=argparse.SUPPRESS)  # a child process: run this row, print one JSON line
    a = p.parse_args()
    unknown = sorted(set(r for r in a.rows.split(",") if r) - set(ROWS))
    if unknown:
        raise SystemExit(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    if a.smoke:
        a.pairs, a.eval_pairs, a.seq_len, a.micro, a.batch, a.compile = 32, 8, 256, 4, 8, "false"
    return a


def prepare(a) -> dict:
    """The preference pairs (train/validation jsonl, conversational), a tokenizer with the chat template, the model
    folder (random weights)."""
    import torch
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    from hf_cgpu.data.tokenizer import train_tokenizer

    work = Path(a.work)
    done = work / "prepared.json"
    if done.is_file():
        return json.loads(done.read_text())
    data = work / "data"
    train_poems = poems(Path(a.zh) / "train.parquet")
    train = pairs(train_poems, a.pairs, seed=0, conversational=True)
    val = pairs(poems(Path(a.zh) / "validation.parquet"), a.eval_pairs, seed=0, conversational=True)
    write(data, "train", train)
    write(data, "validation", val)
    texts = ["\n".join([t, au, *lines]) for t, au, lines in train_poems[: 20 * a.pairs]]
    tok = train_tokenizer(texts, vocab_size=400 if a.smoke else 8000, show_progress=False)
    tok.chat_template = CHAT
    model_dir = work / "model"
    cfg = GPTNeoXConfig(**{k: v for k, v in (TINY if a.smoke else PYTHIA).items() if k != "model_type"},
                        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # 1.4B random weights: seconds on the GPU
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    info = {"data": str(data), "model": str(model_dir), "pairs": len(train), "eval_pairs": len(val)}
    done.write_text(json.dumps(info))
    return info


def ours(a, info: dict, packing: bool, extra: tuple[str, ...] = (), label: str = "") -> dict:
    """hf-cgpu train dpo over one pass of the pairs: as many steps as the units (a pair, or a packed row of pairs)
    fill at ``a.batch``."""
    import datasets
    from transformers import AutoTokenizer

    from hf_cgpu.cli import main as cli_main
    from hf_cgpu.data.chat import prepare_chat
    from hf_cgpu.data.preference import build_pair_rows

    tok = AutoTokenizer.from_pretrained(info["model"])
    _, append = prepare_chat(tok, info["model"], lambda line: None)
    ds = datasets.load_dataset("json", data_files=str(Path(info["data"]) / "train.jsonl"), split="train")
    units = len(build_pair_rows(ds, tok, a.seq_len, append, packing=packing))
    out = Path(a.work) / (label or f"ours_{'packed' if packing else 'padded'}")
    argv = ["train", "dpo", "--preset", "lora", "--require_adapter", "false", "--model", info["model"],
            "--dataset", info["data"], "--seq_len", str(a.seq_len), "--packing", str(packing).lower(),
            "--micro_batch_size", str(a.micro), "--gradient_accumulation_steps", str(a.batch // a.micro),
            "--max_steps", str(math.ceil(units / a.batch)), "--learning_rate", str(a.lr), "--beta", str(a.beta),
            "--warmup_steps", "0", "--eval_steps", "0", "--checkpointing_steps", "0", "--progress", "false",
            "--compile", a.compile, "--lora_r", "16", "--lora_alpha", "32", "--output_dir", str(out),
            "--overwrite_output_dir", "true", *extra]
    clock = StepClock().watch_our_loop()
    code = cli_main(argv)
    r = json.loads((out / "all_results.json").read_text())
    return {"exit": code, "units": units, "steps": r.get("steps"), "pairs_seen": r.get("pairs_seen"),
            "train_seconds": r.get("train_seconds"), **clock.figures(),
            "reference_seconds": r.get("reference_seconds"), "reward_accuracy": r.get("val_reward_accuracy"),
            "reward_margin": r.get("val_reward_margin"), "eval_loss": r.get("val_loss"),
            "peak_reserved_gib": r.get("peak_reserved_gib"), "peak_alloc_gib": r.get("peak_alloc_gib")}


def trl(a, info: dict) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    def split(name: str) -> datasets.Dataset:
        return datasets.load_dataset("json", data_files=str(Path(info["data"]) / f"{name}.jsonl"), split="train")

    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(info["model"])
    model = AutoModelForCausalLM.from_pretrained(info["model"], dtype=torch.bfloat16 if cuda else torch.float32)
    cfg = DPOConfig(output_dir=str(Path(a.work) / "trl"), max_length=a.seq_len + 1, beta=a.beta,
                    per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.batch // a.micro,
                    per_device_eval_batch_size=a.micro, num_train_epochs=1, learning_rate=a.lr, warmup_steps=0,
                    lr_scheduler_type="cosine", bf16=cuda, use_cpu=not cuda, logging_steps=50, save_strategy="no",
                    report_to=[], eval_strategy="no", dataloader_num_workers=0)
    trainer = DPOTrainer(model=model, ref_model=None, args=cfg, train_dataset=split("train"),
                         eval_dataset=split("validation"), processing_class=tok,
                         peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                task_type="CAUSAL_LM"))
    clock = StepClock()
    trainer.add_callback(clock)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - t0
    peak = ({"peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
             "peak_alloc_gib": torch.cuda.max_memory_allocated() / GiB} if cuda else {})
    ev = trainer.evaluate()
    return {"steps": result.global_step, "pairs_seen": result.global_step * a.batch, "train_seconds": seconds,
            **clock.figures(), "reward_accuracy": ev.get("eval_rewards/accuracies"),
            "reward_margin": ev.get("eval_rewards/margins"), "eval_loss": ev.get("eval_loss"),
            "gradient_checkpointing": cfg.gradient_checkpointing, **peak}


def run_row(a, name: str) -> dict:
    info = prepare(a)
    if name == "trl":
        r = trl(a, info)
    elif name == "ours_low":
        r = ours(a, info, packing=True, extra=tuple(LOW_MEMORY), label=name)
    else:
        r = ours(a, info, packing=name == "ours_packed")
    if r.get("train_seconds"):
        r["pairs_per_s"] = info["pairs"] / r["train_seconds"]
        if r.get("reference_seconds") is not None:
            r["pairs_per_s_with_reference"] = info["pairs"] / (r["train_seconds"] + r["reference_seconds"])
    steps, after = r.get("timed_steps") or 0, r.get("after_first_seconds")
    if after and steps > 1:  # without the first step (compilation, CUDA warm-up), pro rata of the pairs
        r["pairs_per_s_after_first"] = info["pairs"] * (steps - 1) / steps / after
    return r


def table(results: dict[str, dict]) -> str:
    lines = ["| row | pairs/s | after 1st step | with reference pass | peak reserved GiB | peak alloc GiB | "
             "reward accuracy | reward margin | steps | s |", "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else str(v)

    for name, r in results.items():
        lines.append(f"| {name} | {f(r.get('pairs_per_s'), ',.1f')} | {f(r.get('pairs_per_s_after_first'), ',.1f')} "
                     f"| {f(r.get('pairs_per_s_with_reference'), ',.1f')} | {f(r.get('peak_reserved_gib'), '.2f')} | "
                     f"{f(r.get('peak_alloc_gib'), '.2f')} | {f(r.get('reward_accuracy'), '.3f')} | "
                     f"{f(r.get('reward_margin'), '.3f')} | {r.get('steps')} | {f(r.get('train_seconds'), '.1f')} |")
    base = results.get("trl", {})
    for name in ("ours", "ours_packed", "ours_low"):
        r = results.get(name, {})
        if base.get("pairs_per_s") and r.get("pairs_per_s"):
            line = f"\n{name} / trl: {r['pairs_per_s'] / base['pairs_per_s']:.2f}x pairs/s (target >= 2)"
            if r.get("pairs_per_s_with_reference"):
                line += f", {r['pairs_per_s_with_reference'] / base['pairs_per_s']:.2f}x with the reference pass"
            if base.get("peak_reserved_gib") and r.get("peak_reserved_gib"):
                line += f"; {r['peak_reserved_gib'] / base['peak_reserved_gib']:.2f}x peak reserved (target <= 1)"
            if base.get("reward_accuracy") is not None and r.get("reward_accuracy") is not None:
                line += (f"; reward accuracy {100 * (r['reward_accuracy'] - base['reward_accuracy']):+.1f} points "
                         "(target within 2)")
            lines.append(line)
    return "\n".join(lines)


def record(out: Path, info: dict) -> None:
    """The data's figures as the first line of dpo_vs_trl.jsonl (OUT takes 8 files)."""
    with open(out / "dpo_vs_trl.jsonl", "a") as fh:
        fh.write(json.dumps({"row": "data", **info}) + "\n")


def main() -> None:
    a = parse()
    bench_main(__file__, a, run_row, prepare, [r for r in a.rows.split(",") if r], "dpo_rows.log", "dpo_vs_trl",
               table, record)


if __name__ == "__main__":
    main()
