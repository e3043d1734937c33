"""The longest row that fits a memory cap: LoRA and QLoRA of the Pythia-1.4B shape at growing sequence lengths.

The base: the Pythia-1.4B config with random weights (no download), saved once in bf16 by a child process and loaded
per row as a fine-tuning run loads it (``tiers.load_base_model``: bf16 for LoRA, nf4 through bitsandbytes for QLoRA),
then ``tiers.apply_tiers`` (LoRA r16 on every linear, recompute with the row's policy, eager) and the fine-tuning
task's chunked loss (``causal_lm_loss_from_hidden``, 1,024-token chunks: the full logits never exist). Micro-batch 1,
one row of random tokens, AdamW on the adapters. Rows (config x sequence length, doubling from 8,192):

  lora_full       --tier lora  --recompute true --recompute_policy full
  lora_offload    --tier lora  --recompute true --recompute_policy offload
  qlora_offload   --tier qlora --recompute true --recompute_policy offload

Each row runs --steps training steps in a fresh process under ``torch.cuda.set_per_process_memory_fraction`` for
--cap_gib (an out-of-memory ends only that row, and the config's longer rows are skipped), and records whether it fit,
peak allocated and reserved (and the process's peak resident host memory), the median step seconds after the first,
tokens/s, and the ledger's allocated, reserved and pinned host bytes for the same run (``budget.memory.ledger``).
The rows go shortest first, the configs interleaved, within
--deadline seconds in all (each row bounded by what is left and by --row_limit). Writes OUT/long_context.md (the
table), OUT/long_context.json and OUT/rows.log. --smoke: a tiny shape on the CPU, the same chain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PYTHIA = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=2048, num_hidden_layers=24,
              num_attention_heads=16, intermediate_size=8192, vocab_size=50304, tie_word_embeddings=False,
              max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True)
TINY = dict(PYTHIA, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=1024)
CONFIGS = {"lora_full": ("lora", "full"), "lora_offload": ("lora", "offload"), "qlora_offload": ("qlora", "offload")}
GiB = 2**30
LOSS_CHUNK = 1024


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out")
    p.add_argument("--base", default="/tmp/long_context_base", help="where the random base is saved once")
    p.add_argument("--deadline", type=float, default=240.0, help="seconds for every row in all")
    p.add_argument("--row_limit", type=float, default=120.0, help="seconds at most for one row")
    p.add_argument("--cap_gib", type=float, default=16.0)
    p.add_argument("--seqs", default="8192,16384,32768,65536,131072")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=2, help="training steps per row (the first is not timed)")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, short rows")
    p.add_argument("--row", default="", help="(internal) run one row CONFIG:SEQ and print its figures")
    p.add_argument("--make_base", action="store_true", help="(internal) save the random base and exit")
    a = p.parse_args()
    if a.smoke and a.seqs == p.get_default("seqs"):
        a.seqs = "64,128"
    return a


def make_base(a) -> None:
    """The random base in bf16 with save_pretrained (made on the GPU where there is one: a 1.4B init is slow on a
    CPU)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(**{k: v for k, v in (TINY if a.smoke else PYTHIA).items() if k != "model_type"})
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = GPTNeoXForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(a.base)


def run_row(a, config: str, seq: int) -> dict:
    """A few training steps of one row under the cap; out-of-memory is a result, not an error."""
    import torch

    from hf_cgpu.models.causal_lm_loss import causal_lm_loss_from_hidden
    from hf_cgpu.settings import TrainSettings
    from hf_cgpu.tiers import apply_tiers, load_base_model

    tier, policy = CONFIGS[config]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.set_per_process_memory_fraction(a.cap_gib * GiB / torch.cuda.get_device_properties(0).total_memory)
    settings = TrainSettings(tier=tier, train_mode="finetune", recompute=True, recompute_policy=policy,
                             lora_r=16, lora_alpha=32, compile=False)
    t0 = time.monotonic()
    model = load_base_model(a.base, tier, device_map={"": device} if tier == "qlora" and cuda else None,
                            device=device)
    model = apply_tiers(model, settings, compile=False)
    if tier != "qlora":
        model = model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
    load_s = time.monotonic() - t0
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq), device=device, generator=torch.Generator(device).manual_seed(0))
    seconds, losses = [], []
    try:
        for _ in range(a.steps):
            start = time.monotonic()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = causal_lm_loss_from_hidden(model, ids, ids, chunk_size=LOSS_CHUNK)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.monotonic() - start)
            losses.append(loss.item())
    except torch.OutOfMemoryError as e:
        return {"fits": False, "oom": str(e).splitlines()[0][:200], "steps_done": len(seconds), **_peaks(cuda)}
    timed = seconds[1:] or seconds
    step_s = statistics.median(timed)
    return {"fits": True, "steps_done": len(seconds), "step_s": step_s, "tokens_per_s": seq / step_s,
            "first_step_s": seconds[0], "load_s": load_s, "loss": losses[-1], **_peaks(cuda)}


def _peaks(cuda: bool) -> dict:
    """Peak device memory, and the process's peak resident host memory (pinned offload buffers, the loaded base,
    the CUDA libraries)."""
    import resource

    import torch

    rss = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB}
    if not cuda:
        return rss
    return {"peak_alloc_gib": torch.cuda.max_memory_allocated() / GiB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB, **rss}


def predicted(a, config: str, seq: int) -> dict:
    """The ledger's figures for the row: the same shape, tier, policy, sequence, micro-batch 1 and loss chunks."""
    from hf_cgpu.budget import ModelShape, TrainSetup
    from hf_cgpu.budget.memory import ledger

    tier, policy = CONFIGS[config]
    shape = ModelShape.from_config_file(Path(a.base) / "config.json")
    setup = TrainSetup(tier=tier, train_mode="finetune", recompute=True, recompute_policy=policy, lora_r=16,
                       lora_alpha=32, seq_len=seq, micro_batch_size=1, gradient_accumulation_steps=1,
                       loss_chunk_size=LOSS_CHUNK, loss_in_forward=False, packed=False)
    led = ledger(shape, setup, memory_cap=a.cap_gib * GiB)
    return {"ledger_alloc_gib": led.allocated / GiB, "ledger_reserved_gib": led.reserved / GiB,
            "ledger_host_gib": led.host_pinned / GiB, "ledger_fits": led.reserved <= a.cap_gib * GiB}


def child(a, args: list[str], seconds: float) -> tuple[dict | None, str]:
    """``this script ARGS`` in a fresh process within ``seconds``: its ROW line, and its log."""
    cmd = [sys.executable, __file__, *args, *sys.argv[1:]]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, seconds))
    except subprocess.TimeoutExpired as e:
        log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        return {"error": f"row limit ({seconds:.0f} s)"}, log
    log = proc.stdout + proc.stderr
    row = next((json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")), None)
    if row is None:
        last = log.strip().splitlines()[-1] if log.strip() else ""
        row = {"error": f"exit {proc.returncode}: {last[:200]}"}
        if "out of memory" in log.lower():
            row = {"fits": False, "oom": last[:200]}
    return row, log


def table(results: list[dict], cap_gib: float) -> str:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else ("" if v is None else
                                                                                                str(v))

    lines = [f"Pythia-1.4B shape, micro-batch 1, LoRA r16 on every linear, loss chunks of {LOSS_CHUNK}, cap "
             f"{cap_gib:g} GiB (set_per_process_memory_fraction)", "",
             "| config | seq | fits | peak alloc GiB | peak reserved GiB | ledger alloc GiB | ledger reserved GiB | "
             "ledger host GiB | peak RSS GiB | reserved / ledger | step s | tokens/s | note |", "|---" * 13 + "|"]
    for r in results:
        fits = {True: "yes", False: "OOM"}.get(r.get("fits"), "-")
        ratio = (r["peak_reserved_gib"] / r["ledger_reserved_gib"]
                 if r.get("peak_reserved_gib") and r.get("ledger_reserved_gib") else None)
        note = r.get("error") or r.get("skipped") or ""
        lines.append(f"| {r['config']} | {r['seq']:,} | {fits} | {f(r.get('peak_alloc_gib'), '.2f')} | "
                     f"{f(r.get('peak_reserved_gib'), '.2f')} | {f(r.get('ledger_alloc_gib'), '.2f')} | "
                     f"{f(r.get('ledger_reserved_gib'), '.2f')} | {f(r.get('ledger_host_gib'), '.2f')} | "
                     f"{f(r.get('peak_rss_gib'), '.2f')} | "
                     f"{f(ratio, '.3f')} | {f(r.get('step_s'), '.2f')} | {f(r.get('tokens_per_s'), ',.0f')} | {note} |")
    lines.append("")
    for config in dict.fromkeys(r["config"] for r in results):
        fit = [r["seq"] for r in results if r["config"] == config and r.get("fits") is True]
        lines.append(f"- {config}: longest row that fit {max(fit):,} tokens" if fit else f"- {config}: none fit")
    return "\n".join(lines) + "\n"


def main() -> None:
    a = parse()
    if a.make_base:
        make_base(a)
        print("ROW {}", flush=True)
        return
    if a.row:
        config, seq = a.row.split(":")
        print("ROW " + json.dumps(run_row(a, config, int(seq))), flush=True)
        return
    start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "rows.log", "a")
    if not (Path(a.base) / "config.json").is_file():
        row, text = child(a, ["--make_base"], a.deadline)
        log.write(f"===== make_base\n{text[-20_000:]}\n")
        if row and row.get("error"):
            raise SystemExit(f"make_base: {row['error']}")
    print(f"base ready in {time.monotonic() - start:.0f} s", flush=True)
    configs = [c for c in a.configs.split(",") if c]
    failed: set[str] = set()
    results: list[dict] = []
    for seq in [int(s) for s in a.seqs.split(",")]:
        for config in configs:
            r = {"config": config, "seq": seq, **predicted(a, config, seq)}
            left = a.deadline - (time.monotonic() - start)
            if config in failed:
                r["skipped"] = "a shorter row did not fit or finish"
            elif left < 15:
                r["skipped"] = "deadline"
            else:
                t0 = time.monotonic()
                row, text = child(a, ["--row", f"{config}:{seq}"], min(left, a.row_limit))
                r.update(row or {})
                r["wall_s"] = time.monotonic() - t0
                log.write(f"===== {config} {seq}\n{text[-20_000:]}\n")
                log.flush()
                if r.get("fits") is not True:
                    failed.add(config)
            results.append(r)
            print(json.dumps(r), flush=True)
            (out / "long_context.json").write_text(json.dumps(results, indent=1))
            (out / "long_context.md").write_text(table(results, a.cap_gib))
    print(table(results, a.cap_gib))
    print(f"done in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
