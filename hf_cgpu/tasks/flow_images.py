"""Flow-matching image task: CIFAR-10-style data decoded once to uint8, augmented on the device, UNet velocity field.

The data never goes through a DataLoader: the whole uint8 set (150 MB for CIFAR-10) sits on the training device,
each micro-batch is an index gather + flip + scale, so a GPU training this UNet at >10k images/s is not starved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..data.images import augment_on_device, check_labels, describe_source, load_image_dataset, to_device_async
from ..errors import SettingsError
from ..flow.matching import FlowMatcher
from ..flow.pipeline_flow_match import FlowMatchPipeline, save_for_remote_code
from ..flow.sample import check_guidance_interval, image_grid
from ..flow.samplers import parse_interval, sampler_class
from ..flow.unet import FlowUNet2DModel
from ..hub.checks import check_dataset
from ..integrity import atomic_output
from ..settings import TrainSettings
from ..train import Task, TaskPlan
from ..train.metrics import counted_training_flops
from .settings import FlowSettings


def grid_cadence(eval_steps: int, max_steps: int) -> str:
    """When the run draws its sample grids (with its validation loss): every ``eval_steps`` and at the end."""
    if 0 < eval_steps < max_steps:
        return f"sample grid every {eval_steps:,} steps and at the end"
    return "sample grid at the end"


class FlowMatchingTask(Task):
    unit = "img"
    card = "flow"
    ledger_task = "flow"

    def __init__(self, cfg: FlowSettings):
        self.cfg = cfg

    def load_data(self, accelerator, labels: bool) -> None:
        """Both splits of ``cfg.dataset`` as uint8 on the training device (with their labels when ``labels``)."""
        cfg = self.cfg
        check_dataset(cfg.dataset)
        with accelerator.main_process_first():
            train = load_image_dataset(cfg.dataset, split="train", image_column=cfg.image_column,
                                       label_column=cfg.label_column if labels else None, limit=cfg.limit or None)
            val = load_image_dataset(cfg.dataset, split="test", image_column=cfg.image_column,
                                     label_column=cfg.label_column if labels else None,
                                     limit=min(1024, cfg.limit or 1024))
        if train.labels is not None and val.labels is not None:
            check_labels(val.labels, None, describe_source(cfg.dataset, "test"), num_classes=train.num_classes)
        self.data_hashes = {"train_data": train.content_hash, "validation_data": val.content_hash}
        device = accelerator.device
        self.images = train.images.to(device)  # (N, 3, 32, 32) uint8 on the training device
        self.labels = train.labels.to(device) if train.labels is not None else None
        self.val_images = val.images.to(device)
        self.val_labels = val.labels.to(device) if val.labels is not None else None
        self.class_names = train.class_names

    def eval_steps(self, settings: TrainSettings, accelerator) -> int:
        """Optimizer steps between evaluations: ``sample_every_epochs`` epochs, or ``eval_steps`` where it is 0."""
        if self.cfg.sample_every_epochs <= 0:
            return settings.eval_steps
        effective = settings.samples_per_step(accelerator.num_processes)
        return max(1, round(self.cfg.sample_every_epochs * len(self.images) / effective))

    def setup(self, settings: TrainSettings, accelerator) -> TaskPlan:
        cfg = self.cfg
        sampler_class(cfg.sampler)  # the registry checks the sampler of the grids and the saved pipeline now
        self.load_data(accelerator, labels=cfg.class_conditional)
        num_classes = None
        if cfg.class_conditional:
            if self.labels is None:
                raise SettingsError(f"no label column {cfg.label_column!r}; pass --class_conditional false "
                                    "or --label_column NAME")
            num_classes = len(self.class_names) if self.class_names else int(self.labels.max()) + 1
        self.matcher = FlowMatcher(time_sampling=cfg.time_sampling)
        model = FlowUNet2DModel(sample_size=self.images.shape[-1], base_channels=cfg.base_channels,
                                num_classes=num_classes)
        pipe = self.pipeline(model)  # the sample grids' and the saved folder's sampling, refused before a step
        check_guidance_interval(pipe, {k: pipe.config[k] for k in ("num_inference_steps", "guidance_scale",
                                                                   "guidance_interval")},
                                flags=("--guidance_interval", "--sample_steps"))
        size = self.images.shape[-1]
        labels = torch.zeros(1, dtype=torch.long) if num_classes is not None else None
        flops = counted_training_flops(model, torch.zeros(1, 3, size, size), torch.zeros(1), labels)
        if not getattr(accelerator, "is_fsdp2", False):  # FSDP2 shards contiguous parameters only
            model = model.to(memory_format=torch.channels_last)
        model = model.train()
        effective = settings.samples_per_step(accelerator.num_processes)
        eval_steps = self.eval_steps(settings, accelerator)
        params = sum(p.numel() for p in model.parameters())
        self.show_progress, self.last_grid = settings.progress and accelerator.is_local_main_process, None
        accelerator.print(
            f"FlowUNet2DModel base {cfg.base_channels}: {params / 1e6:.2f}M parameters, "
            f"{'class-conditional (' + str(num_classes) + ' classes)' if num_classes else 'unconditional'}; "
            f"{len(self.images):,} training images ({effective} per step, "
            f"{len(self.images) / effective:.1f} steps per epoch); {grid_cadence(eval_steps, settings.max_steps)}"
        )
        return TaskPlan(model, eval_steps=eval_steps, flops_per_unit=flops)

    def num_train_samples(self) -> int:
        return len(self.images)

    def train_batch(self, indices, device, generator) -> dict:
        idx = to_device_async(indices, self.images.device)
        x = augment_on_device(self.images[idx], generator=generator)  # (B, 3, H, W) in [-1, 1]
        batch = {"x1": x.contiguous(memory_format=torch.channels_last)}
        if self.labels is not None:  # loaded only for a class-conditional model
            batch["labels"] = self.labels[idx]
        return batch

    @staticmethod
    def _null_class(model) -> int | None:
        return (model.module if hasattr(model, "module") else model).config.num_classes  # DDP wraps in .module

    def loss(self, model, batch, generator) -> torch.Tensor:
        def velocity(xt, t, labels=None):
            return model(xt, t, labels).sample

        return self.matcher.loss(velocity, batch["x1"], batch.get("labels"), cond_drop_prob=self.cfg.cond_drop_prob,
                                 null_class=self._null_class(model), generator=generator)

    def units(self, batch) -> int:
        return batch["x1"].shape[0]

    def evaluate(self, model, settings, device) -> dict[str, float]:
        """Flow-matching loss on held-out images with fixed noise and times (comparable across steps)."""
        gen = torch.Generator(device=device).manual_seed(1234)
        n, bs, total = len(self.val_images), settings.micro_batch_size, 0.0
        for start in range(0, n, bs):
            x1 = self.val_images[start : start + bs].float() / 127.5 - 1.0
            labels = self.val_labels[start : start + bs] if self.val_labels is not None else None
            batch = {"x1": x1.contiguous(memory_format=torch.channels_last)}
            if labels is not None:
                batch["labels"] = labels
            t, xt, ut = self.matcher.sample_location_and_conditional_flow(batch["x1"], generator=gen)
            v = model(xt, t, batch.get("labels")).sample
            total += torch.nn.functional.mse_loss(v.float(), ut.float(), reduction="sum").item()
        return {"val_loss": total / (n * self.val_images[0].numel())}

    def pipeline(self, model):
        """The pipeline as saved: the run's sampler, and its grid settings as the folder's sampling defaults."""
        cfg, conditional = self.cfg, bool(model.config.num_classes)
        return FlowMatchPipeline(unet=model, scheduler=sampler_class(cfg.sampler)(),
                                 num_inference_steps=cfg.sample_steps, guidance_scale=cfg.guidance_scale if conditional else 1.0,
                                 guidance_interval=parse_interval(cfg.guidance_interval) if conditional else None)

    def on_evaluate(self, model, step: int, output_dir: Path) -> None:
        pipe = self.pipeline(model)
        pipe.set_progress_bar_config(disable=not getattr(self, "show_progress", False), leave=False,
                                     desc=f"sample grid, step {step}")
        n_classes = model.config.num_classes
        if n_classes:
            labels = torch.arange(n_classes).repeat_interleave(8)  # one row per class
            rows = n_classes
        else:
            labels, rows = None, 8
        gen = torch.Generator(device=self.images.device).manual_seed(0)
        out = pipe(batch_size=len(labels) if labels is not None else 64, generator=gen, class_labels=labels,
                   output_type="np")  # the saved defaults: sample_steps, guidance_scale and guidance_interval
        path = output_dir / "samples" / f"step_{step:07d}.png"
        with atomic_output(path) as tmp:  # the card shows it and the push uploads it: never half a PNG
            image_grid(out.images, rows).save(tmp, format="PNG")
        self.last_grid = path

    def on_saved(self, model, output_dir: Path, log=print) -> dict[str, Any]:
        """The card shows the last sample grid (the final evaluation's, with the saved weights)."""
        grid = getattr(self, "last_grid", None)
        return {"sample_grid": grid.relative_to(output_dir).as_posix()} if grid is not None and grid.is_file() else {}

    def save_pretrained(self, model, output_dir: Path) -> None:
        model = model.to(memory_format=torch.contiguous_format)
        save_for_remote_code(self.pipeline(model), output_dir)
        if self.class_names:
            (output_dir / "class_names.txt").write_text("\n".join(self.class_names) + "\n")
        model.to(memory_format=torch.channels_last)

    def data_fingerprint(self) -> dict[str, Any]:
        return dict(self.data_hashes)
