"""GPU: measure the image tasks as the image ledger prices them (``hf_cgpu/budget/images.py``), on a CIFAR-10-shaped
synthetic data set (50,000 train + 10,000 test random 32x32 images, ten labels), each configuration in a fresh process
under a 16 GiB cap (``measure_one.py``): peak allocated and reserved, the median step, kernels per step.

    source benchmarks/gpu_env.sh --gpu || exit 1
    python benchmarks/ledger/image_check.py --out $OUT/image_check.json [--budget_s 420]

Configurations (in this order, until ``--budget_s`` is spent): each task eager (the ledger's activation count is
the eager step's) and as its preset ships (compiled; the flow preset with CUDA graphs), flow-distill distilling the
eager flow run. ``--dry_run`` runs tiny versions on the CPU (a check of the harness). The ledger's figures for the
same command lines are printed by ``python benchmarks/ledger/image_check.py --predict FILE`` on any machine.
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
COMMON = ["--max_minutes", "0", "--warmup_steps", "5", "--log_steps", "10", "--checkpointing_steps", "0",
          "--save_best", "false", "--progress", "false", "--overwrite_output_dir", "true"]
CONFIGS: list[tuple[str, list[str], int, int]] = [  # (name, command, steps, steps skipped before the timed window)
    ("flow-eager", ["train", "flow", "--preset", "cifar10", "--compile", "false"], 25, 12),
    ("flow", ["train", "flow", "--preset", "cifar10"], 45, 30),
    ("distill-eager", ["train", "flow-distill", "--preset", "cifar10", "--teacher", "TEACHER", "--compile", "false"],
     20, 8),
    ("classifier-eager", ["train", "classifier", "--preset", "cifar10", "--compile", "false"], 25, 12),
    ("classifier", ["train", "classifier", "--preset", "cifar10"], 40, 25),
    ("flow-compile-default", ["train", "flow", "--preset", "cifar10", "--compile_mode", "default"], 40, 25),
    ("distill", ["train", "flow-distill", "--preset", "cifar10", "--teacher", "TEACHER"], 30, 18),
]


def synthetic_cifar(folder: Path, train: int, test: int) -> None:
    """Random 32x32 RGB images with labels 0..9 as train.parquet / test.parquet (datasets' Image feature)."""
    import numpy as np
    from datasets import ClassLabel, Dataset, Features
    from datasets import Image as ImageFeature
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    features = Features({"img": ImageFeature(), "label": ClassLabel(names=[f"c{k}" for k in range(10)])})
    for split, n in (("train", train), ("test", test)):
        if (folder / f"{split}.parquet").is_file():
            continue
        pixels = np.random.default_rng(len(split)).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        images = [Image.fromarray(p) for p in pixels]
        Dataset.from_dict({"img": images, "label": [i % 10 for i in range(n)]}, features=features).to_parquet(
            folder / f"{split}.parquet")


def command(name: str, cmd: list[str], steps: int, data: Path, runs: Path, dry: bool) -> list[str]:
    cmd = [str(runs / "flow-eager") if w == "TEACHER" else w for w in cmd]
    out = [*cmd, "--dataset", str(data), "--output_dir", str(runs / name), "--max_steps", str(steps), *COMMON]
    if dry:
        out += ["--limit", "64", "--micro_batch_size", "8", "--compile", "false", "--cpu", "true"]
        out += ["--base_channels", "16"] if cmd[1] == "flow" else []
    return out


def measure(a: argparse.Namespace) -> None:
    data, runs, out = Path(a.work) / "cifar", Path(a.work) / "runs", Path(a.out)
    synthetic_cifar(data, 256 if a.dry_run else 50_000, 128 if a.dry_run else 10_000)
    records, started = [], time.perf_counter()
    for name, cmd, steps, skip in CONFIGS:
        if time.perf_counter() - started > a.budget_s:
            print(f"== {name}: skipped (budget spent)", flush=True)
            continue
        cmd = command(name, cmd, 6 if a.dry_run else steps, data, runs, a.dry_run)
        args = [sys.executable, str(HERE / "measure_one.py"), "--cap_gib", "16", "--skip",
                str(2 if a.dry_run else skip), "--active", "2" if a.dry_run else "3", "--out",
                f"/tmp/image_{name}.json", "--", *cmd]
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(args, timeout=a.timeout, capture_output=True, text=True, env=os.environ)
            rec = json.loads(Path(f"/tmp/image_{name}.json").read_text()) if proc.returncode == 0 else {
                "exit": f"measure_one exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            rec = {"exit": f"timeout after {a.timeout} s"}
        rec.update(name=name, argv=cmd, seconds=time.perf_counter() - t0)
        print(json.dumps({k: rec.get(k) for k in ("name", "exit", "steps", "wall_s_per_step", "peak_alloc_gib",
                                                  "peak_reserved_gib", "seconds")}), flush=True)
        if rec.get("profile"):
            prof = rec["profile"]
            print(f"   kernels/step {prof['kernels_per_step']:.0f}, busy {prof['busy_ms_per_step']:.1f} ms/step",
                  flush=True)
        records.append(rec)
        out.write_text(json.dumps(records, indent=1, default=str))


def predict(path: str) -> None:
    """The ledger beside each measured record of ``path``."""
    from hf_cgpu.budget.card import CARDS
    from hf_cgpu.budget.images import image_ledger, image_step_work, read_pipeline
    from hf_cgpu.budget.time import step_time
    from hf_cgpu.options import CUDA_GRAPH_MODES
    from hf_cgpu.settings import TrainSettings, parse_settings
    from hf_cgpu.tasks.settings import ClassifierSettings, FlowDistillSettings, FlowSettings

    classes = {"flow": FlowSettings, "flow-distill": FlowDistillSettings, "classifier": ClassifierSettings}
    card = CARDS["H100 SXM"]
    print(f"{'config':22}{'alloc GiB':>18}{'reserved GiB':>18}  {'moment':16}{'step ms':>16}{'kernels':>14}")
    for rec in json.loads(Path(path).read_text()):
        argv = rec["argv"]
        task = argv[1]
        cls = classes[task]
        pairs = list(zip(argv[2::2], argv[3::2]))  # flag, value
        teacher = dict(pairs).get("--teacher")
        flags = [w for f, v in pairs if f not in ("--teacher", "--cpu") for w in (f, v)]  # no settings of the task
        cfg, train = parse_settings((cls, TrainSettings), flags, family=task, fixed={"train_mode": cls.train_mode})
        extra = {}
        if teacher and Path(teacher).is_dir():
            info = read_pipeline(teacher)
            extra = dict(teacher_config=info.unet, guide=info.guide, guidance_scale=info.guidance_scale)
        led = image_ledger(task, cfg, train, **extra)
        work = image_step_work(task, cfg, train, **extra)
        graphs = train.compile and train.compile_mode in CUDA_GRAPH_MODES
        st = step_time(work, card, cuda_graphs=graphs)
        meas = rec.get("profile") or {}

        def pair(p, m):
            return f"{p:8.2f} / {m:6.2f}" if isinstance(m, (int, float)) else f"{p:8.2f} /    ---"

        print(f"{rec['name']:22}{pair(led.allocated / 2**30, rec.get('peak_alloc_gib'))}"
              f"{pair(led.reserved / 2**30, rec.get('peak_reserved_gib'))}  {led.peak_phase:16}"
              f"{pair(st.seconds * 1e3, (rec.get('wall_s_per_step') or 0) * 1e3)}"
              f"{work.kernels:7.0f}/{meas.get('kernels_per_step', 0):5.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/image_check.json")
    p.add_argument("--work", default="/tmp/image_check")
    p.add_argument("--budget_s", type=float, default=420.0, help="start no configuration after this many seconds")
    p.add_argument("--timeout", type=int, default=180, help="seconds per configuration")
    p.add_argument("--predict", default="", help="print the ledger beside the records of this JSON file")
    p.add_argument("--dry_run", action="store_true")
    a = p.parse_args()
    if a.predict:
        predict(a.predict)
    else:
        measure(a)


if __name__ == "__main__":
    main()
