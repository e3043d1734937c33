"""``hf-cgpu sample DIR``: images from a saved FlowMatchPipeline, as a grid PNG and one PNG per image."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..errors import SettingsError, require_model


def image_grid(images: np.ndarray, rows: int) -> Image.Image:
    """(N, H, W, C) floats in [0, 1] -> one PIL image with ``rows`` rows and a 2-pixel white gutter."""
    n, h, w, c = images.shape
    cols = math.ceil(n / rows)
    grid = np.ones((rows * (h + 2) + 2, cols * (w + 2) + 2, c), dtype=np.float32)
    for i, img in enumerate(images):
        r, col = divmod(i, cols)
        grid[2 + r * (h + 2) : 2 + r * (h + 2) + h, 2 + col * (w + 2) : 2 + col * (w + 2) + w] = img
    return Image.fromarray((grid * 255).round().astype(np.uint8))


def parse_labels(text: str, class_names: list[str], num_classes: int | None) -> list[int] | None:
    """'3,5' or 'cat,dog' -> indices; empty -> None (unconditional / null class)."""
    if not text:
        return None
    if not num_classes:
        raise SettingsError("this pipeline is unconditional; drop --class_labels")
    out = []
    for item in text.split(","):
        item = item.strip()
        if item.isdigit() and int(item) < num_classes:
            out.append(int(item))
        elif item in class_names:
            out.append(class_names.index(item))
        else:
            raise SettingsError(f"unknown class {item!r}; use 0..{num_classes - 1} or one of {class_names}")
    return out


def main(argv: list[str] | None = None) -> int:
    from ..flow.pipeline_flow_match import FlowMatchPipeline
    from ..flow.scheduling_flow_match import FlowMatchEulerScheduler, FlowMatchHeunScheduler

    p = argparse.ArgumentParser(prog="hf-cgpu sample", description=__doc__)
    p.add_argument("model_dir")
    p.add_argument("--num_images", type=int, default=64)
    p.add_argument("--scheduler", choices=("euler", "heun"), default="heun")
    p.add_argument("--num_inference_steps", type=int, default=20)
    p.add_argument("--class_labels", default="", help="comma-separated class indices or names, cycled over images")
    p.add_argument("--guidance_scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="", help="default: MODEL_DIR/samples_cli")
    a = p.parse_args(argv)
    require_model(a.model_dir, "pipeline folder")
    pipe = FlowMatchPipeline.from_pretrained(a.model_dir)
    sched_cls = FlowMatchHeunScheduler if a.scheduler == "heun" else FlowMatchEulerScheduler
    pipe.scheduler = sched_cls.from_config(pipe.scheduler.config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe.to(device)
    names_file = Path(a.model_dir) / "class_names.txt"
    names = names_file.read_text().split() if names_file.is_file() else []
    labels = parse_labels(a.class_labels, names, pipe.unet.config.num_classes)
    if labels is not None:
        labels = torch.tensor([labels[i % len(labels)] for i in range(a.num_images)])
    gen = torch.Generator(device=device).manual_seed(a.seed)
    out = pipe(batch_size=a.num_images, num_inference_steps=a.num_inference_steps, generator=gen,
               class_labels=labels, guidance_scale=a.guidance_scale, output_type="np").images
    dest = Path(a.output_dir or Path(a.model_dir) / "samples_cli")
    dest.mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(out):
        Image.fromarray((img * 255).round().astype(np.uint8)).save(dest / f"{i:04d}.png")
    rows = max(1, int(math.sqrt(a.num_images)))
    image_grid(out, rows).save(dest / "grid.png")
    print(f"wrote {len(out)} images and grid.png to {dest}")
    return 0
