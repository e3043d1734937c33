"""The seed's flow-matching training pipeline, timed: images/s in steady state over a fixed number of steps.

The same pipeline as ``bench_seed_image.py`` (the seed's ``train_image.py``), kept as the seed wrote it: per-image
transforms (uint8 HWC -> PIL -> random flip -> tensor in [-1, 1]) in a torch DataLoader with 8 workers (pinned,
persistent), unconditional ``FlowUNet2DModel`` base 128 (the seed's UNet: the same layers and parameters),
channels_last + torch.compile, batch 256, bf16 autocast, fused AdamW lr 2e-4, clip 1.0, EMA 0.999 through
``torch.optim.swa_utils.AveragedModel``, ``loss.item()`` after every step. The loader cycles over epochs (a new
shuffle, as the seed's epoch loop).

``--unet seed`` (the default) runs that UNet with the layers the seed's ``unet.py`` uses, ``nn.GroupNorm`` and
nearest ``nn.Upsample``, compiled as they are; ``--unet ours`` with hf_cgpu's compiled forms of the two (the group
norm from channel moments and the upsampling that keep channels_last, ``flow/unet.py``), which issue 12's work made
faster: from 2026-12-02 on, that speed-up reached this baseline too, so both are reported.

Timed: ``--warmup`` steps (compile, worker start-up) are run first, then ``--steps`` steps between two
synchronisations; images/s = steps x batch / seconds. Also the seconds from the start to the end of the first step.
Writes one JSON line (and ``--json``).

GPU:  python benchmarks/throughput/bench_seed_flow_speed.py --dataset .data/cifar10 --steps 300 --json $OUT/seed_speed.json
CPU:  python benchmarks/throughput/bench_seed_flow_speed.py --dataset DIR --smoke   (base 32, batch 16, 2 workers, 3 steps:
      checks the script only)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quality"))  # benchmarks/quality
from bench_seed_image import FlipToTensor, seed_step  # noqa: E402  (the seed's transform and step, one definition)


def cycle(loader):
    while True:
        yield from loader


def seed_layers() -> None:
    """This process's ``FlowUNet2DModel`` with the seed's layers: torch's group norm and nearest upsampling in every
    mode (hf_cgpu's compiled forms off)."""
    import torch.nn as nn
    import torch.nn.functional as F

    from hf_cgpu.flow import unet

    unet.GroupNorm.forward = nn.GroupNorm.forward
    unet.upsample2x = lambda x: F.interpolate(x, scale_factor=2.0, mode="nearest")


def main() -> None:
    start = time.perf_counter()
    from hf_cgpu.data.images import load_image_dataset
    from hf_cgpu.flow.unet import FlowUNet2DModel

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default=".data/cifar10", help="folder with train.parquet")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--base_channels", type=int, default=128)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--warmup", type=int, default=30, help="untimed steps first (compile, workers)")
    p.add_argument("--steps", type=int, default=300, help="timed steps")
    p.add_argument("--compile", default="true", choices=["true", "false"])
    p.add_argument("--unet", default="seed", choices=["seed", "ours"],
                   help="seed: nn.GroupNorm and nn.Upsample as the seed's unet.py; ours: hf_cgpu's compiled forms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny: checks that the script runs")
    a = p.parse_args()
    if a.smoke:
        a.batch_size, a.base_channels, a.workers, a.warmup, a.steps, a.compile = 16, 32, 2, 1, 3, "false"
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    torch.set_float32_matmul_precision("high")
    data = load_image_dataset(a.dataset, split="train")
    images = data.images.permute(0, 2, 3, 1).contiguous().numpy()  # (N, 32, 32, 3) uint8
    loader = DataLoader(FlipToTensor(images), batch_size=a.batch_size, shuffle=True, num_workers=a.workers,
                        pin_memory=cuda, drop_last=True, persistent_workers=a.workers > 0)
    if a.unet == "seed":
        seed_layers()
    unet = FlowUNet2DModel(sample_size=32, base_channels=a.base_channels, num_classes=None).to(dev)
    unet = unet.to(memory_format=torch.channels_last)
    ema = torch.optim.swa_utils.AveragedModel(unet, avg_fn=lambda avg, new, n: 0.999 * avg + 0.001 * new)
    model = torch.compile(unet) if a.compile == "true" else unet
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0, fused=cuda)
    batches = cycle(loader)

    def step() -> float:
        return seed_step(model, opt, ema, next(batches), dev)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    last = step()
    first = time.perf_counter() - start
    for _ in range(a.warmup - 1):
        last = step()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        last = step()
    sync()
    seconds = time.perf_counter() - t0
    summary = {"pipeline": "seed train_image.py (DataLoader x%d workers, per-image transforms, loss.item(), "
                           "AveragedModel EMA)" % a.workers,
               "device": torch.cuda.get_device_name() if cuda else "CPU (smoke: no figure to quote)",
               "batch": a.batch_size, "base_channels": a.base_channels, "compile": a.compile, "unet": a.unet,
               "warmup_steps": a.warmup, "timed_steps": a.steps, "seconds": seconds,
               "img_per_s": a.steps * a.batch_size / seconds, "seconds_to_first_step": first, "last_loss": last,
               "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    print(json.dumps(summary), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
