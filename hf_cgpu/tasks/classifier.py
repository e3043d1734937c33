"""CIFAR-10 classifier task: the feature network of ``hf-cgpu eval`` for image generators, trained by the one loop.

Data as in the flow task: the whole split decoded once to uint8 and kept on the training device; a micro-batch is
an index gather, a horizontal flip, a reflect-padded random crop and a scale to [-1, 1], all on the device.
``evaluate`` reports accuracy and cross-entropy over the whole test split (or its first ``test_limit`` images).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..data.images import (augment_on_device, check_labels, describe_source, load_image_dataset,
                           random_crop_on_device, to_device_async)
from ..errors import SettingsError
from ..evaluation.classifier import CifarResNet, ClassifierConfig, save_classifier
from ..hub.checks import check_dataset
from ..settings import TrainSettings
from ..train import Task, TaskPlan
from ..train.metrics import counted_training_flops
from .settings import ClassifierSettings


class ClassifierTask(Task):
    unit = "img"
    ledger_task = "classifier"

    def __init__(self, cfg: ClassifierSettings):
        self.cfg = cfg

    def setup(self, settings: TrainSettings, accelerator) -> TaskPlan:
        cfg = self.cfg
        check_dataset(cfg.dataset)
        with accelerator.main_process_first():
            train = load_image_dataset(cfg.dataset, split="train", image_column=cfg.image_column,
                                       label_column=cfg.label_column, limit=cfg.limit or None)
            test = load_image_dataset(cfg.dataset, split="test", image_column=cfg.image_column,
                                      label_column=cfg.label_column, limit=cfg.test_limit or None)
        if train.labels is None or test.labels is None:
            raise SettingsError(f"no label column {cfg.label_column!r} in {cfg.dataset}; pass --label_column NAME")
        check_labels(test.labels, None, describe_source(cfg.dataset, "test"), num_classes=train.num_classes)
        self.data_hashes = {"train_data": train.content_hash, "validation_data": test.content_hash}
        device = accelerator.device
        self.images, self.labels = train.images.to(device), train.labels.to(device)  # (N, 3, S, S) uint8, (N,)
        self.test_images, self.test_labels = test.images.to(device), test.labels.to(device)
        num_classes = train.num_classes
        config = ClassifierConfig(num_classes=num_classes, widths=cfg.width_list, image_size=self.images.shape[-1],
                                  class_names=train.class_names)
        model = CifarResNet(config)
        flops = counted_training_flops(model, torch.zeros(1, 3, config.image_size, config.image_size))
        model = model.to(memory_format=torch.channels_last).train()
        params = sum(p.numel() for p in model.parameters())
        effective = settings.samples_per_step(accelerator.num_processes)
        accelerator.print(
            f"CifarResNet {cfg.widths}: {params / 1e6:.2f}M parameters, {num_classes} classes; "
            f"{len(self.images):,} training images ({len(self.images) / effective:.1f} steps per epoch, "
            f"{settings.max_steps * effective / len(self.images):.1f} epochs), {len(self.test_images):,} test images"
        )
        return TaskPlan(model, flops_per_unit=flops)

    def num_train_samples(self) -> int:
        return len(self.images)

    def train_batch(self, indices, device, generator) -> dict:
        idx = to_device_async(indices, self.images.device)
        x = self.images[idx]
        if self.cfg.flip:
            x = augment_on_device(x, generator=generator)  # flipped, in [-1, 1]
        else:
            x = x.float() / 127.5 - 1.0
        x = random_crop_on_device(x, self.cfg.crop_padding, generator=generator)
        return {"x": x.contiguous(memory_format=torch.channels_last), "labels": self.labels[idx]}

    def loss(self, model, batch, generator) -> torch.Tensor:
        logits = model(batch["x"])
        return F.cross_entropy(logits.float(), batch["labels"], label_smoothing=self.cfg.label_smoothing)

    def units(self, batch) -> int:
        return batch["x"].shape[0]

    def evaluate(self, model, settings, device) -> dict[str, float]:
        """Accuracy and cross-entropy over every test image; the last batch is padded to the same shape (compile)."""
        n, bs = len(self.test_images), settings.micro_batch_size
        correct, loss_sum = 0, 0.0
        for start in range(0, n, bs):
            x = self.test_images[start : start + bs]
            y = self.test_labels[start : start + bs]
            real = len(x)
            if real < bs:  # pad with copies of the first image; their outputs are dropped
                x = torch.cat([x, x[:1].expand(bs - real, -1, -1, -1)])
            x = (x.float() / 127.5 - 1.0).contiguous(memory_format=torch.channels_last)
            logits = model(x)[:real].float()
            correct += int((logits.argmax(1) == y).sum())
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        return {"accuracy": correct / n, "val_loss": loss_sum / n}

    def save_pretrained(self, model, output_dir: Path) -> None:
        save_classifier(model, output_dir)

    def data_fingerprint(self) -> dict[str, Any]:
        return dict(self.data_hashes)
