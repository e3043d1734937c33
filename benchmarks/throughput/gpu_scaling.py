"""One GPU against N: the same recipe at the same effective (global) batch, one process vs N processes (DDP or FSDP2).

    python benchmarks/throughput/gpu_scaling.py --recipe gpt --gpus 8 --config ddp --out runs/scaling -- --preset 124m ...
    python benchmarks/throughput/gpu_scaling.py --recipe flow --gpus 8 --config ddp --out runs/scaling -- --preset cifar10 ...

The one-process run takes ``gradient_accumulation_steps x N`` micro-batches per step, each of the N processes
``gradient_accumulation_steps``: the same samples and random draws every step (hf_cgpu.train.step), so the first
losses agree within bf16/fp32 rounding and the throughput ratio is the scaling factor. Written to ``--out``:
``scaling_<recipe>_<config>.json`` and ``.md`` (tokens/s or images/s of each, scaling factor and efficiency,
the first ``--losses`` losses side by side, each process's peak memory). ``--cpu`` runs the same logic with gloo
CPU processes (CI, tiny sizes); its figures say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WARMUP_STEPS = 10
"""Log windows (steps, with --log_steps 1) left out of the steady throughput: compilation and warm-up."""
RECIPES = {"gpt": "train_gpt.py", "flow": "train_flow.py", "lora": "finetune_lora.py"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_cmd(recipe: str, processes: int, config: str, cpu: bool, args: list[str]) -> list[str]:
    """``accelerate launch`` of ``recipe`` on one process (accelerate_config.yaml) or ``processes`` (CONFIG.yaml)."""
    if processes == 1:
        where = ["--cpu", "--num_processes", "1"] if cpu else ["--config_file", str(REPO / "accelerate_config.yaml")]
    else:
        where = ["--config_file", str(REPO / "recipes" / "accelerate" / f"{config}.yaml"),
                 "--num_processes", str(processes), "--main_process_port", str(_free_port())]
    if cpu:
        where += ["--mixed_precision", "no"]
    return [sys.executable, "-m", "accelerate.commands.launch", *where, str(REPO / "recipes" / RECIPES[recipe]),
            *args]


def split_option(args: list[str], name: str, default: int) -> int:
    """The last value of ``--name`` in ``args`` (the recipe's own flags), else ``default``."""
    value = default
    for i, a in enumerate(args):
        if a == f"--{name}" and i + 1 < len(args):
            value = int(args[i + 1])
        elif a.startswith(f"--{name}="):
            value = int(a.split("=", 1)[1])
    return value


def without(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == f"--{name}":
            skip = True
        elif not a.startswith(f"--{name}="):
            out.append(a)
    return out


def run_one(recipe: str, processes: int, config: str, cpu: bool, args: list[str], out: Path, log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if cpu:
        env.update(CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="true")
    cmd = launch_cmd(recipe, processes, config, cpu, [*args, "--output_dir", str(out), "--overwrite_output_dir",
                                                       "true"])
    with open(log, "w") as fh:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"error: the {processes}-process run failed (exit {done.returncode}); its log {log}:\n{tail}")
    results = json.loads((out / "all_results.json").read_text())
    history = json.loads((out / "history.json").read_text())
    unit = "tok_per_s" if "tok_per_s" in results else "img_per_s"
    return {"results": results, "losses": [h["train/loss"] for h in history if "train/loss" in h],
            "rates": [h[f"train/{unit}"] for h in history if f"train/{unit}" in h]}


def steady_rate(rates: list[float], skip: int = WARMUP_STEPS) -> float | None:
    """The median of the logged rates after the first ``skip`` log windows (compilation, allocator warm-up)."""
    import statistics

    rest = rates[skip:] or rates
    return statistics.median(rest) if rest else None


def peak_memory(results: dict) -> list[dict]:
    """Per process: the peak allocated/reserved GiB on CUDA (peak RSS on CPU)."""
    keys = ("peak_alloc_gib", "peak_reserved_gib", "peak_rss_gib")
    per = results.get("processes_peak_memory") or [{"rank": 0, **{k: results[k] for k in keys if k in results}}]
    return [{k: p[k] for k in ("rank", *keys) if k in p} for p in per]


def compare(recipe: str, gpus: int, config: str, one: dict, many: dict, n_losses: int) -> dict:
    unit = "tok_per_s" if "tok_per_s" in one["results"] else "img_per_s"
    r1, rn = steady_rate(one["rates"]), steady_rate(many["rates"])
    la, lb = one["losses"][:n_losses], many["losses"][:n_losses]
    return {
        "recipe": recipe, "config": config, "gpus": gpus, "unit": unit,
        "device": many["results"].get("device"), "mixed_precision": many["results"].get("mixed_precision"),
        "effective_batch": {
            "one": f"{one['results']['micro_batch_size']} x {one['results']['gradient_accumulation_steps']} x 1",
            "many": f"{many['results']['micro_batch_size']} x {many['results']['gradient_accumulation_steps']} x "
                    f"{many['results']['processes']}"},
        "rate_one": r1, "rate_many": rn, "scaling": rn / r1 if r1 else None,
        "rate_definition": f"median of the per-step rates after step {WARMUP_STEPS} (of all processes together)",
        "mean_rate_incl_warmup": {"one": one["results"][unit], "many": many["results"][unit]},
        "efficiency": rn / r1 / gpus if r1 else None,
        "losses_one": la, "losses_many": lb,
        "max_abs_loss_difference": max((abs(a - b) for a, b in zip(la, lb)), default=None),
        "peak_memory_one": peak_memory(one["results"]), "peak_memory_many": peak_memory(many["results"]),
        "train_seconds": {"one": one["results"].get("train_seconds"), "many": many["results"].get("train_seconds")},
    }


def markdown(r: dict) -> str:
    u = r["unit"].replace("_per_s", "/s")
    mem = lambda rows: ", ".join(f"rank {m['rank']}: " + " / ".join(f"{v:.2f}" for k, v in m.items() if k != "rank")
                                 for m in rows)
    lines = [f"## {r['recipe']}: 1 vs {r['gpus']} ({r['config']}), {r['device']}, {r['mixed_precision']}", "",
             "| | processes | micro x accumulation x processes | " + u + " | peak memory GiB per process |",
             "|---|---|---|---|---|",
             f"| one | 1 | {r['effective_batch']['one']} | {r['rate_one']:,.0f} | {mem(r['peak_memory_one'])} |",
             f"| many | {r['gpus']} | {r['effective_batch']['many']} | {r['rate_many']:,.0f} | "
             f"{mem(r['peak_memory_many'])} |", "",
             f"{u}: {r['rate_definition']}. Scaling factor {r['scaling']:.2f}x, efficiency "
             f"{r['efficiency']:.0%}; first {len(r['losses_one'])} "
             f"losses differ by at most {r['max_abs_loss_difference']:.2e}", "",
             "| step | loss, 1 process | loss, " + str(r["gpus"]) + " processes |", "|---|---|---|"]
    lines += [f"| {i} | {a:.5f} | {b:.5f} |" for i, (a, b) in enumerate(zip(r["losses_one"], r["losses_many"]), 1)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, recipe_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", choices=sorted(RECIPES), required=True)
    p.add_argument("--gpus", type=int, required=True, help="processes of the second run (one per GPU)")
    p.add_argument("--config", choices=["ddp", "fsdp2"], default="ddp")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--losses", type=int, default=50, help="first losses to compare")
    p.add_argument("--cpu", action="store_true", help="gloo CPU processes (checks the logic, not the GPUs)")
    a = p.parse_args(own)
    if a.gpus < 2:
        p.error("--gpus must be at least 2")
    accumulation = split_option(recipe_args, "gradient_accumulation_steps", 1)
    base = without(recipe_args, "gradient_accumulation_steps")
    a.out.mkdir(parents=True, exist_ok=True)
    tag = f"{a.recipe}_{a.config}"
    one = run_one(a.recipe, 1, a.config, a.cpu, [*base, "--gradient_accumulation_steps", str(accumulation * a.gpus)],
                  a.out / f"{tag}_1", a.out / f"{tag}_1.log")
    many = run_one(a.recipe, a.gpus, a.config, a.cpu, [*base, "--gradient_accumulation_steps", str(accumulation)],
                   a.out / f"{tag}_{a.gpus}", a.out / f"{tag}_{a.gpus}.log")
    report = compare(a.recipe, a.gpus, a.config, one, many, a.losses)
    (a.out / f"scaling_{tag}.json").write_text(json.dumps(report, indent=1))
    (a.out / f"scaling_{tag}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
