"""GPU: every configuration of a set, each in a fresh process under a 16 GiB cap (``measure_one.py``), into one JSON.

    python benchmarks/ledger/run_all.py --set A --out $OUT/ledger_A.json      # on the GPU (gpu_ledger.sh)
    python benchmarks/ledger/run_all.py --set A --dry_run --out /tmp/l.json   # CPU: tiny shapes, checks the harness

Set A calibrates the time ledger's constants; set B is predicted before it runs (``compare.py`` prints both). Each
record holds the command, the measured peaks, the median step time, the device time by kind of kernel and the steps
a --max_minutes run held; ``compare.py`` puts the ledger's prediction beside each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ZH, CIFAR = ".data/zh-poetry", ".data/cifar10"
QUIET = ["--eval_steps", "0", "--checkpointing_steps", "0", "--save_best", "false", "--progress", "false",
         "--log_steps", "10"]
"""The measured window holds training steps only (evaluation and checkpoints are priced as their own rows)."""


def gpt(preset: str, steps: int, *extra: str) -> list[str]:
    return ["train", "gpt", "--preset", preset, "--dataset", ZH, "--max_steps", str(steps), "--max_minutes", "0",
            "--fit_schedule_to_time", "false", "--warmup_steps", "5", "--load_best_at_end", "false",
            "--early_stopping_patience", "0", "--prompts", "床", "--max_new_tokens", "4", *QUIET, *extra]


def lora(base: str, preset: str, steps: int, *extra: str) -> list[str]:
    return ["train", "lora", "--preset", preset, "--model", base, "--dataset", ZH, "--max_steps", str(steps),
            "--warmup_steps", "5", *QUIET, *extra]


def flow(steps: int, *extra: str) -> list[str]:
    return ["train", "flow", "--preset", "cifar10", "--dataset", CIFAR, "--max_steps", str(steps),
            "--max_minutes", "0", "--sample_every_epochs", "0", "--warmup_steps", "5", *QUIET, *extra]


SETS: dict[str, list[tuple[str, list[str], int]]] = {
    # (name, command, steps to skip before the timed window)
    "A": [
        ("gpt-124m", gpt("124m", 45, "--micro_batch_size", "16", "--gradient_accumulation_steps", "1"), 20),
        ("gpt-350m-eager", gpt("350m", 30, "--micro_batch_size", "8", "--gradient_accumulation_steps", "1",
                               "--compile", "false"), 10),
        ("gpt-30m-eager", gpt("30m", 60, "--compile", "false"), 20),
        ("zh-modern", gpt("zh-poetry-modern", 40, "--gradient_accumulation_steps", "1"), 20),
        ("pythia-lora-recompute", lora("BASE_PYTHIA", "lora", 25, "--recompute", "true", "--compile", "false",
                                       "--gradient_accumulation_steps", "1"), 10),
        ("smol-lora-4x256", lora("BASE_SMOL", "lora", 40, "--seq_len", "256", "--micro_batch_size", "4",
                                 "--gradient_accumulation_steps", "2", "--compile", "false", "--packing", "false"), 15),
        ("flow-cifar10", flow(200), 80),
    ],
    "B": [
        ("gpt-124m-recompute", gpt("124m", 45, "--micro_batch_size", "16", "--gradient_accumulation_steps", "1",
                                   "--recompute", "true"), 20),
        ("gpt-124m-eager-acc4", gpt("124m", 20, "--micro_batch_size", "8", "--gradient_accumulation_steps", "4",
                                    "--compile", "false"), 8),
        ("gpt-770m-recompute", gpt("770m", 20, "--micro_batch_size", "8", "--gradient_accumulation_steps", "1",
                                   "--recompute", "true"), 8),
        ("gpt-770m-8bit", gpt("770m", 20, "--micro_batch_size", "4", "--gradient_accumulation_steps", "1",
                              "--tier", "adamw8bit", "--compile", "false"), 8),
        ("pythia-qlora", lora("BASE_PYTHIA", "qlora", 20, "--gradient_accumulation_steps", "1"), 8),
        ("pythia-lora-16k", lora("BASE_PYTHIA", "lora", 8, "--seq_len", "16384", "--micro_batch_size", "1",
                                 "--gradient_accumulation_steps", "1", "--recompute", "true", "--compile", "false"),
         3),
        ("flow-base192", flow(150, "--base_channels", "192", "--compile_mode", "default"), 60),
        ("flow-distill", ["train", "flow-distill", "--preset", "cifar10", "--teacher", "TEACHER", "--dataset", CIFAR,
                          "--max_steps", "120", "--max_minutes", "0", "--sample_every_epochs", "0", *QUIET], 50),
        ("classifier", ["train", "classifier", "--preset", "cifar10", "--dataset", CIFAR, "--max_steps", "60",
                        "--warmup_steps", "5", *QUIET], 25),
    ],
}
"""Set B's flow-distill distills set B's flow-base192 run (a teacher trained in the same call)."""

DRY = {"124m": "tiny", "350m": "tiny", "770m": "tiny", "30m": "tiny", "zh-poetry-modern": "tiny"}


def dry(cmd: list[str]) -> list[str]:
    """The same command at tiny shapes and a few steps (a CPU check of the harness)."""
    out, i = [], 0
    while i < len(cmd):
        w = cmd[i]
        if w == "--preset" and cmd[i + 1] in DRY:
            out += [w, DRY[cmd[i + 1]]]
            i += 2
            continue
        if w in ("--micro_batch_size", "--seq_len", "--base_channels", "--max_steps"):
            out += [w, {"--micro_batch_size": "2", "--seq_len": "64", "--base_channels": "32",
                        "--max_steps": "6"}[w]]
            i += 2
            continue
        if w == "--compile":
            out += [w, "false"]
            i += 2
            continue
        out.append(w)
        i += 1
    if "flow" in cmd or "classifier" in cmd or "flow-distill" in cmd:
        out += ["--limit", "64"]
    return out + ["--cpu", "true"] if "--cpu" not in out else out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="A", choices=sorted(SETS))
    p.add_argument("--out", required=True)
    p.add_argument("--cap_gib", type=float, default=16.0)
    p.add_argument("--bases", default="/tmp/ledger_bases", help="folder of the random LoRA bases (make_bases.py)")
    p.add_argument("--runs", default="/tmp/ledger_runs")
    p.add_argument("--timeout", type=int, default=240, help="seconds per configuration")
    p.add_argument("--only", default="", help="comma-separated names")
    p.add_argument("--dry_run", action="store_true")
    a = p.parse_args()
    subs = {"BASE_PYTHIA": f"{a.bases}/pythia", "BASE_SMOL": f"{a.bases}/smol", "TEACHER": f"{a.runs}/flow-base192"}
    records = []
    out = Path(a.out)
    for name, cmd, skip in SETS[a.set]:
        if a.only and name not in a.only.split(","):
            continue
        cmd = [subs.get(w, w) for w in cmd] + ["--output_dir", f"{a.runs}/{name}", "--overwrite_output_dir", "true"]
        if a.dry_run:
            cmd, skip = dry(cmd), 2
        args = [sys.executable, str(HERE / "measure_one.py"), "--cap_gib", str(a.cap_gib), "--skip", str(skip),
                "--active", "2" if a.dry_run else "5", "--out", f"/tmp/ledger_{name}.json", "--", *cmd]
        t0 = time.perf_counter()
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        try:
            proc = subprocess.run(args, timeout=a.timeout, capture_output=True, text=True, env=os.environ)
            rec = json.loads(Path(f"/tmp/ledger_{name}.json").read_text()) if proc.returncode == 0 else {
                "exit": f"measure_one exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            rec = {"exit": f"timeout after {a.timeout} s"}
        rec.update(name=name, set=a.set, seconds=time.perf_counter() - t0)
        print(json.dumps({k: rec.get(k) for k in ("name", "exit", "steps", "wall_s_per_step", "peak_alloc_gib",
                                                  "peak_reserved_gib", "seconds")}), flush=True)
        records.append(rec)
        out.write_text(json.dumps(records, indent=1, default=str))  # what is done is kept if the call is cut off


if __name__ == "__main__":
    main()
