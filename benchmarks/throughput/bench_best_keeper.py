"""What one improvement of the best weights costs the loop: the eager write into output_dir/best (the keeper before
it kept the weights in host memory: ``save_pretrained`` into a temp folder, a SHA-256 manifest, ``replace_dir``) vs
the copy into host memory an improvement now costs, and the deferred write (``BestKeeper.flush``, once per checkpoint
and at the end).

The model is the `--preset zh-poetry-modern` GPT (12x768, vocab 8192, 3 value tables, rotary, relu2), fp32 weights
on the training device as the loop holds them; the write goes to ``--dir`` (a local disk; not $OUT). Per row: the
median seconds over ``--repeats`` (the first host copy, which allocates the pinned buffers, is its own row).

GPU:  source benchmarks/gpu_env.sh --gpu && python benchmarks/throughput/bench_best_keeper.py --json $OUT/best_keeper.json
      (carry .whl: the device has no hf_cgpu install and no datasets)
CPU:  SMOKE=1 python benchmarks/throughput/bench_best_keeper.py      (a tiny GPT: checks the script)
      python benchmarks/throughput/bench_best_keeper.py --device cpu  (the real shape on this machine's CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

DEADLINE_S = 480.0  # a device call is 10 minutes in all, pip installs included


def zh_poetry_modern(smoke: bool):
    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
    from hf_cgpu.settings import load_preset
    from hf_cgpu.tasks.settings import GPTSettings

    preset = load_preset("zh-poetry-modern", "gpt")
    if smoke:
        preset.update(n_layer=6, n_embd=64, n_head=2, vocab_size=512, seq_len=64)
    names = {f.name for f in dataclasses.fields(GPTSettings)}
    gpt = GPTSettings(**{k: v for k, v in preset.items() if k in names})
    torch.manual_seed(0)
    return CgptForCausalLM(CgptConfig(**gpt.model_config_kwargs(gpt.vocab_size, 0)))


def eager_write(model, folder: Path, step: int, metrics: dict) -> None:
    """The write each improvement made before the weights were kept in host memory (the same calls, in order)."""
    from hf_cgpu.integrity import build_manifest, replace_dir, write_manifest

    tmp = folder.with_name(f".{folder.name}-tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    (tmp / "best.json").write_text(json.dumps({"step": step, **metrics}, indent=1))
    write_manifest(tmp, build_manifest(tmp, "best", step=step))
    replace_dir(tmp, folder)


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", default="", help="where best/ is written (default: a temp folder, removed after)")
    p.add_argument("--json", default="")
    p.add_argument("--smoke", action="store_true", default=os.environ.get("SMOKE") == "1")
    a = p.parse_args()
    started = time.perf_counter()

    from hf_cgpu.train import BestKeeper

    dev = torch.device(a.device)
    model = zh_poetry_modern(a.smoke).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    root = Path(a.dir or tempfile.mkdtemp(prefix="bench-best-"))
    folder = root / "best"
    keeper = BestKeeper("val_loss", folder, write=lambda m, f: m.save_pretrained(str(f)))
    params = sum(t.numel() for t in keeper.held.changing(model).values())
    env = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU ({os.cpu_count()} cores)",
           "torch": torch.__version__, "smoke": a.smoke, "parameters": params}
    rows: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)
        if a.json:  # the table so far, should the call be cut off
            Path(a.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))

    print(f"| {env['device']}, {params / 1e6:.1f}M parameters | median s | repeats |\n|---|---|---|", flush=True)
    record("host copy, first (allocates the buffers)", timed(lambda: keeper.observe({"val_loss": 10.0}, 0, model), sync))
    for i in range(a.repeats):
        if time.perf_counter() - started > DEADLINE_S:
            print(f"deadline: stopped after {i} repeats")
            break
        step, m = i + 1, {"val_loss": 9.0 - i}
        record("eager write (before: every improvement)",
               timed(lambda step=step, m=m: eager_write(model, folder, step, m), sync))
        record("host copy (now: every improvement)", timed(lambda step=step, m=m: keeper.observe(m, step, model), sync))
        record("flush (now: each checkpoint and the end)", timed(keeper.flush, sync))
    size = sum(f.stat().st_size for f in folder.iterdir())
    for name, xs in rows.items():
        print(f"| {name} | {statistics.median(xs):.4f} | {len(xs)} |", flush=True)
    print(json.dumps({**env, "best_folder_mb": round(size / 1e6, 1)}))
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
