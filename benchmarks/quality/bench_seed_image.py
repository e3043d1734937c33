"""The seed's CIFAR-10 flow-matching recipe as a plain script, for a fixed number of minutes, saved as a pipeline.

What the seed's train_image.py does, kept as it is (the point is to measure it, not to improve it):
    unconditional UNet, base 128 (the package's FlowUNet2DModel with num_classes=None: the same shape, 6.1M),
    channels_last + torch.compile, batch 256, AdamW lr 2e-4 (no weight decay, fused), bf16 autocast, clip 1.0,
    EMA 0.999 with torch.optim.swa_utils.AveragedModel, t ~ U(0, 1), x_t = (1 - t) x0 + t x1, target x1 - x0,
    per-image transforms (PIL image -> random flip -> tensor in [-1, 1]) in a DataLoader with 8 workers,
    and ``loss.item()`` after every step.
The images sit in memory as uint8 HWC arrays, as torchvision's CIFAR10 holds them (decoded once here, with the
package's image cache); each item is turned into a PIL image in the worker, as torchvision does.
The clock starts before the first batch (worker start-up and compile count, as in the loop's --max_minutes).
Sampling is left to ``hf-cgpu eval`` (the seed's sampler is Euler, 50 steps, no guidance):

    python benchmarks/quality/bench_seed_image.py --dataset .data/cifar10 --minutes 4 --output_dir /tmp/seed_flow
    hf-cgpu eval /tmp/seed_flow --classifier /tmp/clf --dataset .data/cifar10 --scheduler euler \
        --num_inference_steps 50 --guidance_scale 1
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset


class FlipToTensor(Dataset):
    """uint8 HWC images -> (3, 32, 32) float in [-1, 1], randomly flipped, one image at a time (in the workers)."""

    def __init__(self, images_hwc: np.ndarray):
        self.images = images_hwc

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        img = Image.fromarray(self.images[i])
        if random.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1)  # (3, H, W) in 0..255
        return x / 127.5 - 1.0


def seed_step(model, opt, ema, x1: torch.Tensor, dev: torch.device) -> float:
    """One step of the seed's loop: uniform t, the straight path, MSE on the velocity in bf16 autocast (on CUDA),
    clip 1.0, AdamW, AveragedModel EMA, and ``loss.item()`` (the seed's per-step host sync)."""
    x1 = x1.to(dev, non_blocking=True).to(memory_format=torch.channels_last)
    x0 = torch.randn_like(x1)
    t = torch.rand(x1.shape[0], device=dev)
    tb = t[:, None, None, None]
    xt = (1 - tb) * x0 + tb * x1
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        loss = ((model(xt, t).sample - (x1 - x0)) ** 2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    ema.update_parameters(model)
    return loss.item()


def main() -> None:
    from hf_cgpu.data.images import load_image_dataset
    from hf_cgpu.flow.pipeline_flow_match import FlowMatchPipeline, save_for_remote_code
    from hf_cgpu.flow.scheduling_flow_match import FlowMatchEulerScheduler
    from hf_cgpu.flow.unet import FlowUNet2DModel

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="../shared/data/cifar10", help="folder with train.parquet")
    p.add_argument("--output_dir", default="runs/seed_flow")
    p.add_argument("--minutes", type=float, default=4.0, help="training wall-clock budget")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    torch.manual_seed(a.seed)
    random.seed(a.seed)
    dev = torch.device("cuda")
    torch.set_float32_matmul_precision("high")
    data = load_image_dataset(a.dataset, split="train")  # same cache entry as the flow recipe
    images = data.images.permute(0, 2, 3, 1).contiguous().numpy()  # (N, 32, 32, 3) uint8
    loader = DataLoader(FlipToTensor(images), batch_size=a.batch_size, shuffle=True, num_workers=a.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    unet = FlowUNet2DModel(sample_size=32, base_channels=128, num_classes=None).to(dev)
    unet = unet.to(memory_format=torch.channels_last)
    ema = torch.optim.swa_utils.AveragedModel(unet, avg_fn=lambda avg, new, n: 0.999 * avg + 0.001 * new)
    model = torch.compile(unet)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0, fused=True)
    print(f"seed recipe: {sum(p.numel() for p in unet.parameters()) / 1e6:.2f}M parameters, "
          f"{len(images)} images, batch {a.batch_size}, {a.minutes} minutes", flush=True)

    start = time.perf_counter()
    deadline = start + 60 * a.minutes
    steps, epoch, done, last = 0, 0, False, float("nan")
    while not done:
        t0, total, n = time.perf_counter(), 0.0, 0
        for x1 in loader:
            last = seed_step(model, opt, ema, x1, dev)
            total, n, steps = total + last, n + 1, steps + 1
            if time.perf_counter() > deadline:
                done = True
                break
        print(f"epoch {epoch} loss {total / max(1, n):.4f} {n * a.batch_size / (time.perf_counter() - t0):.0f} img/s "
              f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
        epoch += 1
    seconds = time.perf_counter() - start

    out = Path(a.output_dir)
    pipe = FlowMatchPipeline(unet=ema.module.to(memory_format=torch.contiguous_format), scheduler=FlowMatchEulerScheduler())
    save_for_remote_code(pipe, out)
    summary = {"recipe": "seed train_image.py", "steps": steps, "images_seen": steps * a.batch_size,
               "epochs": steps * a.batch_size / len(images), "seconds": seconds,
               "img_per_s": steps * a.batch_size / seconds, "last_loss": last,
               "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30, "ema_decay": 0.999}
    (out / "bench_seed.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
