"""Instruction fine-tuning of the Pythia-1.4B shape on real text of natural lengths: TRL's SFTTrainer against ours.

Data: zh-poetry turned into instructions (the title and author ask, the poem answers), tokenized by a byte-level BPE
trained here on the same poems, rendered with one chat template for every row. The model: the Pythia-1.4B config,
random weights (no download), LoRA r16 on every linear layer, bf16, the same sequence length, learning rate, rows
per step and one pass over the same examples for every row. Rows, each in a fresh process:

  trl_padded   SFTTrainer with its defaults (padding to the longest of each batch, its gradient checkpointing)
  trl_packed   SFTTrainer with packing=True (best-fit decreasing, padding-free position_ids)
  ours_padded  hf-cgpu train lora --packing false (one example per row, padded to --seq_len)
  ours_packed  hf-cgpu train lora --packing true
  ours_packed_recompute  the same with --recompute true --compile_mode default (the low-memory rung: the memory
               target against trl_padded is at most half its peak)
  ours_qlora   hf-cgpu train lora --preset qlora --packing true (a 4-bit nf4 base: the memory lever)
  ours_qlora_recompute  the same with --recompute true --compile_mode default (the least memory)
  long16k      hf-cgpu train lora at 16,384 tokens per sequence under set_per_process_memory_fraction(16 GiB),
               with the ledger's prediction beside the measured peak

Reported per row: response tokens trained per second (the responses' tokens of the pass / training seconds), the same
after the first optimizer step (compile, warm-up), peak memory reserved and allocated, held-out response loss after the
pass. Every training row's steps are timed by one clock (``StepClock``: the loop's start, then each optimizer step's
end after a CUDA sync), so ours and TRL's "after 1st step" figures are measured the same way. Results go to OUT/sft_vs_trl.jsonl and
OUT/sft_vs_trl.md as each row ends, every row's log to OUT/rows.log. --smoke runs a tiny shape on the CPU (the
TRL rows need `pip install trl`; hf_cgpu itself never imports it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PYTHIA = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=2048, num_hidden_layers=24,
              num_attention_heads=16, intermediate_size=8192, vocab_size=50304, tie_word_embeddings=False,
              max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True)
TINY = dict(PYTHIA, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
ROWS = ("ours_packed", "trl_padded", "trl_packed", "long16k", "ours_padded", "ours_packed_recompute", "ours_qlora",
        "ours_qlora_recompute")  # most telling first
GiB = 2**30


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--zh", default=".data/zh-poetry", help="zh-poetry folder (train.parquet, validation.parquet)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/sft_vs_trl"))
    p.add_argument("--work", default="/tmp/sft_vs_trl_work")
    p.add_argument("--rows", default=",".join(ROWS), help="rows to run, in this order")
    p.add_argument("--first", default="", help="rows moved to the front of --rows, in this order (the rest keep theirs)")
    p.add_argument("--examples", type=int, default=3000, help="training examples (one pass)")
    p.add_argument("--eval_examples", type=int, default=256)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="rows per optimizer step (micro-batch 4 x accumulation 2)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--long_seq", type=int, default=16384)
    p.add_argument("--long_steps", type=int, default=4)
    p.add_argument("--cap_gib", type=float, default=16.0)
    p.add_argument("--deadline", type=float, default=480.0, help="seconds from start: no row starts after it")
    p.add_argument("--compile", default="true", help="our rows' --compile (the lora preset compiles each block)")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, few examples")
    p.add_argument("--row", help=argparse.SUPPRESS)  # a child process: run this row, print one JSON line
    a = p.parse_args()
    a.order = row_order(a.rows, a.first)
    if a.smoke:
        a.examples, a.eval_examples, a.seq_len, a.batch, a.long_seq, a.long_steps = 48, 8, 512, 4, 1024, 1
        a.compile = "false"
    return a


def row_order(rows: str, first: str) -> list[str]:
    """``rows`` with the rows named in ``first`` moved to the front; an unknown name stops the call at once."""
    names, front = [r for r in rows.split(",") if r], [r for r in first.split(",") if r]
    unknown = sorted(set(names + front) - set(ROWS))
    if unknown:
        raise SystemExit(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    return front + [r for r in names if r not in front]


# ---------------------------------------------------------------------------------------------- data and the model


def prepare(a) -> dict:
    """Instruction jsonl (train/validation), a tokenizer with the chat template, the model folder; the count of
    response tokens of the training pass (the same for every row: same examples, tokenizer and template)."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    from hf_cgpu.data.instruct import encode
    from hf_cgpu.data.tokenizer import train_tokenizer

    work = Path(a.work)
    done = work / "prepared.json"
    if done.is_file():
        return json.loads(done.read_text())
    (work / "data").mkdir(parents=True, exist_ok=True)

    def rows(split: str, n: int) -> list[dict]:
        out = []
        for text in pq.read_table(Path(a.zh) / f"{split}.parquet", columns=["text"]).column("text").to_pylist():
            head = text.split("\n", 2)
            if len(head) == 3 and head[2].strip():
                out.append({"instruction": f"{head[0].strip()}\n{head[1].strip()}", "output": head[2].strip()})
            if len(out) == n:
                break
        return out

    train, val = rows("train", a.examples), rows("validation", a.eval_examples)
    for name, data in (("train", train), ("validation", val)):
        (work / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data))
    tok = train_tokenizer([r["instruction"] + "\n" + r["output"] for r in train],
                          vocab_size=400 if a.smoke else 8000, show_progress=False)
    tok.chat_template = CHAT
    model_dir = work / "model"
    cfg = GPTNeoXConfig(**{k: v for k, v in (TINY if a.smoke else PYTHIA).items() if k != "model_type"},
                        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # 1.4B random weights: seconds on the GPU
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    long_dir = work / "model_long"  # the same weights with 16k positions (rotary: nothing else changes)
    if not long_dir.exists():
        long_dir.mkdir()
        for f in model_dir.iterdir():
            (long_dir / f.name).symlink_to(f.resolve())
        (long_dir / "config.json").unlink()
        cfg.max_position_embeddings = a.long_seq
        cfg.save_pretrained(long_dir)
    msgs = [[{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}]
            for r in train]
    lengths, response = [], 0
    for m in msgs:
        ids, flags, _ = encode(tok, m)
        lengths.append(len(ids))
        response += sum(flags[1 : a.seq_len + 1])
    info = {"data": str(work / "data"), "model": str(model_dir), "model_long": str(long_dir),
            "response_tokens": response, "examples": len(train), "mean_len": sum(lengths) / len(lengths),
            "max_len": max(lengths)}
    done.write_text(json.dumps(info))
    return info


# ------------------------------------------------------------------------------------------------------ the rows


def ours(a, info: dict, packing: bool, recompute: bool = False, tier: str = "lora") -> dict:
    """hf-cgpu train lora over one pass of the examples: as many steps as the (packed) rows fill at ``a.batch``;
    ``recompute``: --recompute true --compile_mode default (the preset's own otherwise); ``tier``: the preset."""
    import datasets
    from transformers import AutoTokenizer

    from hf_cgpu.cli import main as cli_main
    from hf_cgpu.data.instruct import build_rows

    tok = AutoTokenizer.from_pretrained(info["model"])
    ds = datasets.load_dataset("json", data_files=str(Path(info["data"]) / "train.jsonl"), split="train")
    n_rows = len(build_rows(ds, tok, a.seq_len, "instruction", packing=packing))
    micro = min(4, a.batch)
    out = Path(a.work) / f"ours_{tier}_{'packed' if packing else 'padded'}{'_recompute' if recompute else ''}"
    argv = ["train", "lora", "--preset", tier, "--model", info["model"], "--dataset", info["data"],
            "--seq_len", str(a.seq_len), "--packing", str(packing).lower(), "--micro_batch_size", str(micro),
            "--gradient_accumulation_steps", str(a.batch // micro), "--max_steps", str(math.ceil(n_rows / a.batch)),
            "--learning_rate", str(a.lr), "--warmup_steps", "0", "--eval_steps", "0", "--checkpointing_steps", "0",
            "--progress", "false", "--compile", a.compile, "--lora_r", "16", "--output_dir", str(out),
            "--overwrite_output_dir", "true"]
    if recompute:
        argv += ["--recompute", "true", "--compile_mode", "default"]
    clock = StepClock().watch_our_loop()
    code = cli_main(argv)
    r = json.loads((out / "all_results.json").read_text())
    return {"exit": code, "rows": n_rows, "steps": r.get("steps"), "train_seconds": r.get("train_seconds"),
            **clock.figures(), "eval_loss": r.get("val_loss"),
            "peak_reserved_gib": r.get("peak_reserved_gib"),
            "peak_alloc_gib": r.get("peak_alloc_gib")}


class StepClock:
    """One clock for every row: the training loop's start, then each optimizer step's end (after a CUDA sync, so the
    step's kernels are done). A TrainerCallback for TRL (duck-typed: Trainer calls the hooks it finds:
    ``on_train_begin`` once set up, ``on_step_end`` after each optimizer step); for ours, ``watch_our_loop`` wraps the
    loop's own hooks (``Metrics.progress`` opens the loop, ``Metrics.record`` follows each optimizer step)."""

    def __init__(self):
        self.start, self.ends = None, []

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    @staticmethod
    def _now() -> float:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, *args, **kwargs):
        self.start = self._now()

    def on_step_end(self, *args, **kwargs):
        self.ends.append(self._now())

    def watch_our_loop(self) -> StepClock:
        from hf_cgpu.train.metrics import Metrics

        progress, record = Metrics.progress, Metrics.record

        def timed_progress(metrics, *args, **kwargs):
            self.on_train_begin()
            return progress(metrics, *args, **kwargs)

        def timed_record(metrics, *args, **kwargs):
            self.on_step_end()
            return record(metrics, *args, **kwargs)

        Metrics.progress, Metrics.record = timed_progress, timed_record
        return self

    def figures(self) -> dict:
        """``first_step_seconds``: loop start to the first step's end; ``after_first_seconds``: first step's end to
        the last's."""
        if self.start is None or not self.ends:
            return {}
        return {"first_step_seconds": self.ends[0] - self.start, "after_first_seconds": self.ends[-1] - self.ends[0],
                "timed_steps": len(self.ends)}


def trl(a, info: dict, packing: bool) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    def convo(split: str) -> datasets.Dataset:
        ds = datasets.load_dataset("json", data_files=str(Path(info["data"]) / f"{split}.jsonl"), split="train")
        return ds.map(lambda r: {"prompt": [{"role": "user", "content": r["instruction"]}],
                                 "completion": [{"role": "assistant", "content": r["output"]}]},
                      remove_columns=ds.column_names)

    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(info["model"])
    model = AutoModelForCausalLM.from_pretrained(info["model"], dtype=torch.bfloat16 if cuda else torch.float32)
    micro = min(4, a.batch)
    cfg = SFTConfig(output_dir=str(Path(a.work) / f"trl_{packing}"), max_length=a.seq_len, packing=packing,
                    per_device_train_batch_size=micro, gradient_accumulation_steps=a.batch // micro,
                    per_device_eval_batch_size=micro, num_train_epochs=1, learning_rate=a.lr, warmup_steps=0,
                    lr_scheduler_type="cosine", bf16=cuda, use_cpu=not cuda, logging_steps=50, save_strategy="no",
                    report_to=[], eval_strategy="no", dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=convo("train"), eval_dataset=convo("validation"),
                         processing_class=tok,
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
    return {"steps": result.global_step, "train_seconds": seconds, **clock.figures(),
            "eval_loss": ev.get("eval_loss"),
            "gradient_checkpointing": cfg.gradient_checkpointing, "padding_free": trainer.padding_free,
            "attention": model.config._attn_implementation, **peak}


def long16k(a, info: dict) -> dict:
    """A few steps of LoRA at ``long_seq`` tokens per sequence (text windows: every row a full sequence) under the
    memory cap, recompute and the chunked loss on, micro-batch 1; the ledger's peak for the same run beside it."""
    import torch

    from hf_cgpu.cli import main as cli_main

    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(a.cap_gib * GiB / torch.cuda.get_device_properties(0).total_memory)
    text = Path(a.work) / "long_text"
    text.mkdir(exist_ok=True)
    poems = [json.loads(line)["output"] for line in (Path(info["data"]) / "train.jsonl").read_text().splitlines()]
    (text / "train.txt").write_text("\n\n".join(poems * 4))
    (text / "validation.txt").write_text("\n\n".join(poems[:200] * 8))
    out = Path(a.work) / "long16k"
    argv = ["train", "lora", "--preset", "lora", "--model", info["model_long"], "--dataset", str(text),
            "--data_format", "text", "--packing", "false", "--seq_len", str(a.long_seq), "--micro_batch_size", "1",
            "--gradient_accumulation_steps", "1", "--max_steps", str(a.long_steps), "--recompute", "true",
            "--loss_chunk_size", "1024", "--learning_rate", str(a.lr), "--warmup_steps", "0", "--eval_steps", "0",
            "--eval_batches", "1", "--checkpointing_steps", "0", "--progress", "false", "--compile", a.compile,
            "--lora_r", "16", "--output_dir", str(out), "--overwrite_output_dir", "true"]
    code = cli_main(argv)
    r = json.loads((out / "all_results.json").read_text())
    led = predicted(argv)
    tokens = a.long_seq * a.long_steps
    return {"exit": code, "steps": r.get("steps"), "train_seconds": r.get("train_seconds"),
            "tokens_per_s": tokens / r["train_seconds"] if r.get("train_seconds") else None,
            "peak_reserved_gib": r.get("peak_reserved_gib"), "peak_alloc_gib": r.get("peak_alloc_gib"),
            "ledger_reserved_gib": led.reserved / GiB, "ledger_alloc_gib": led.allocated / GiB,
            "cap_gib": a.cap_gib}


def predicted(argv: list[str]):
    """The ledger of the run ``argv`` (``hf-cgpu train lora ...``) as ``hf-cgpu budget`` prices it: the same flags,
    the model's config.json in place of --model (the lora preset is budget's default for a config)."""
    from hf_cgpu.budget.memory import ledger
    from hf_cgpu.commands.budget import describe_run

    args, it = [], iter(argv[2:])
    for flag in it:
        value = next(it)
        if flag == "--model":
            args += ["--config", str(Path(value) / "config.json")]
        elif flag != "--preset":
            args += [flag, value]
    run_shape, train, _ = describe_run(args)
    return ledger(run_shape.model, run_shape.setup(train))


def run_row(a, name: str) -> dict:
    info = prepare(a)
    if name == "long16k":
        return long16k(a, info)
    if name.startswith("ours"):
        r = ours(a, info, name != "ours_padded", recompute=name.endswith("recompute"),
                 tier="qlora" if "qlora" in name else "lora")
    else:
        r = trl(a, info, name.endswith("packed"))
    if r.get("train_seconds"):
        r["response_tok_s"] = info["response_tokens"] / r["train_seconds"]
    steps, after = r.get("timed_steps") or 0, r.get("after_first_seconds")
    if after and steps > 1:  # without the first step (compilation, CUDA warm-up), pro rata of the examples
        r["response_tok_s_after_first"] = info["response_tokens"] * (steps - 1) / steps / after
    return r


# ------------------------------------------------------------------------------------------------- the parent


def table(results: dict[str, dict]) -> str:
    lines = ["| row | response tok/s | after 1st step | peak reserved GiB | peak alloc GiB | held-out response loss "
             "| steps | s |", "|---|---|---|---|---|---|---|---|"]

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else str(v)

    for name, r in results.items():
        rate = r.get("response_tok_s", r.get("tokens_per_s"))
        lines.append(f"| {name} | {f(rate, ',.0f')} | {f(r.get('response_tok_s_after_first'), ',.0f')} | "
                     f"{f(r.get('peak_reserved_gib'), '.2f')} | "
                     f"{f(r.get('peak_alloc_gib'), '.2f')} | {f(r.get('eval_loss'), '.4f')} | {r.get('steps')} | "
                     f"{f(r.get('train_seconds'), '.1f')} |")
    base = results.get("trl_padded", {}).get("response_tok_s")
    ours_rate = results.get("ours_packed", {}).get("response_tok_s")
    if base and ours_rate:
        lines.append(f"\nours_packed / trl_padded: {ours_rate / base:.2f}x tokens/s")
    packed = results.get("trl_packed", {}).get("response_tok_s")
    if packed and ours_rate:
        lines.append(f"ours_packed / trl_packed: {ours_rate / packed:.2f}x tokens/s")
    low, padded_peak = (results.get(k, {}).get("peak_reserved_gib") for k in ("ours_packed_recompute", "trl_padded"))
    if low and padded_peak:
        lines.append(f"ours_packed_recompute / trl_padded: {low / padded_peak:.2f}x peak reserved (target <= 0.5)")
    padded = results.get("trl_padded", {})
    for name in ("ours_qlora", "ours_qlora_recompute"):
        r = results.get(name, {})
        if padded.get("response_tok_s") and r.get("response_tok_s") and r.get("peak_reserved_gib"):
            lines.append(f"{name} / trl_padded: {r['peak_reserved_gib'] / padded['peak_reserved_gib']:.2f}x peak "
                         f"reserved (target <= 0.5) at {r['response_tok_s'] / padded['response_tok_s']:.2f}x "
                         "response tokens/s (target >= 2)")
    long = results.get("long16k")
    if long and long.get("peak_reserved_gib"):
        lines.append(f"long16k: peak reserved {long['peak_reserved_gib']:.2f} GiB (ledger "
                     f"{long['ledger_reserved_gib']:.2f} GiB) under a {long['cap_gib']:g} GiB cap, "
                     f"{long['tokens_per_s']:,.0f} tokens/s")
    return "\n".join(lines)


def run_rows(script: str, names, seconds: float, out: Path, log_name: str, stem: str, table) -> dict[str, dict]:
    """Each row of ``names`` as ``script --row NAME`` in a fresh process (its peak memory its own) within ``seconds``
    in all; every row's log appended to ``out/log_name``, its figures to ``out/stem.jsonl`` and the table so far to
    ``out/stem.md`` as each row ends (a deadline keeps the finished rows). Returns the rows by name."""
    start = time.monotonic()
    results: dict[str, dict] = {}
    for name in names:
        left = seconds - (time.monotonic() - start)
        if left < 30:
            results[name] = {"skipped": "deadline"}
            continue
        cmd = [sys.executable, script, "--row", name, *sys.argv[1:]]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            log = proc.stdout + proc.stderr
            row = next((json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")),
                       {"error": log.strip().splitlines()[-1] if log.strip() else f"exit {proc.returncode}"})
        except subprocess.TimeoutExpired as e:  # its output comes as bytes
            log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                          for x in (e.stdout, e.stderr))
            row = {"error": "deadline"}
        with open(out / log_name, "a") as fh:  # one file for every row's log (OUT takes 8 files)
            fh.write(f"===== {name}\n{log[-100_000:]}\n")
        row["wall_s"] = time.monotonic() - t0
        results[name] = row
        print(f"{name}: {row}", flush=True)
        with open(out / f"{stem}.jsonl", "a") as fh:
            fh.write(json.dumps({"row": name, **row}) + "\n")
        (out / f"{stem}.md").write_text(table(results) + "\n")
    return results


def bench_main(script: str, a, run_row, prepare, names, log_name: str, stem: str, table, record) -> None:
    """A bench's entry point: with ``--row NAME``, that row in this process, its figures on a ``ROW`` line (what
    ``run_rows`` reads); else the data once (``prepare``, kept by ``record(out, info)``), then every row of ``names`` in
    its own process within ``a.deadline`` seconds of the start, and the table."""
    if a.row:
        print("ROW " + json.dumps(run_row(a, a.row)), flush=True)
        return
    start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = prepare(a)
    record(out, info)
    print(f"prepared in {time.monotonic() - start:.0f} s: {info}", flush=True)
    results = run_rows(script, names, a.deadline - (time.monotonic() - start), out, log_name, stem, table)
    print(table(results))


def main() -> None:
    a = parse()
    bench_main(__file__, a, run_row, prepare, a.order, "rows.log", "sft_vs_trl", table,
               lambda out, info: (out / "data.json").write_text(json.dumps(info, indent=2)))


if __name__ == "__main__":
    main()
