"""One optimizer step's forward/backward: the accumulation window over this process's samples, then clipping."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .schedule import step_seed


@dataclass(frozen=True)
class StepResult:
    loss: float
    """Mean loss over the micro-batches."""
    grad_norm: float
    """Global gradient norm before clipping."""
    units: int
    """Throughput units this process trained on (tokens, images)."""


def clip_gradients(accelerator, params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm to ``max_norm`` (0 = no clipping) and return the norm before clipping."""
    if max_norm > 0:
        return float(accelerator.clip_grad_norm_(params, max_norm))
    norms = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


class Stepper:
    """Forward/backward of step ``k``: its samples from ``order``, every random draw seeded by ``(seed, k)``."""

    def __init__(self, task, model, accelerator, order, seed: int, max_grad_norm: float):
        self.task, self.model, self.accelerator, self.order = task, model, accelerator, order
        self.seed, self.max_grad_norm = seed, max_grad_norm
        self.trainable = [p for p in model.parameters() if p.requires_grad]

    def run(self, step: int, micro_batch_size: int, accumulation: int) -> StepResult:
        acc, device = self.accelerator, self.accelerator.device
        effective = micro_batch_size * accumulation
        idx = self.order.indices(step, effective * acc.num_processes)
        idx = idx[acc.process_index * effective : (acc.process_index + 1) * effective]
        torch.manual_seed(step_seed(self.seed, step))  # dropout and any other global draw
        gen = torch.Generator(device=device).manual_seed(step_seed(self.seed, step))
        loss_sum = torch.zeros((), device=device)
        units = 0
        for k in range(accumulation):
            batch = self.task.train_batch(idx[k * micro_batch_size : (k + 1) * micro_batch_size], device, gen)
            with acc.no_sync(self.model) if k < accumulation - 1 else nullcontext():
                loss = self.task.loss(self.model, batch, gen)
                acc.backward(loss / accumulation)
            loss_sum += loss.detach().float()
            units += self.task.units(batch)
        grad_norm = clip_gradients(acc, self.trainable, self.max_grad_norm)
        return StepResult((loss_sum / accumulation).item(), grad_norm, units)
