"""What optimizer step ``k`` uses, as functions of ``(seed, k)`` only: its learning rate, its random seed, its samples.

That is what makes resume exact: a run restarted from a checkpoint at step ``k`` replays what the uninterrupted run
did from there.
"""

from __future__ import annotations

import math

import torch

from ..errors import DataError


def lr_at(step: int, s) -> float:
    """Linear warmup to ``learning_rate``, then cosine to ``min_lr_ratio * learning_rate`` at ``max_steps``."""
    if step < s.warmup_steps:
        return s.learning_rate * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, s.max_steps - s.warmup_steps))
    floor = s.min_lr_ratio * s.learning_rate
    return floor + 0.5 * (s.learning_rate - floor) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group gets ``lr``; a group with ``lr_scale`` (Muon's: its peak over ``learning_rate``) that multiple."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr


def step_seed(seed: int, step: int) -> int:
    """The seed of every random draw of step ``step`` (dropout, noise, augmentation)."""
    return (seed * 1_000_003 + step * 7919 + 17) % (2**62)


def micro_batch_seed(seed: int, step: int, micro_batch: int) -> int:
    """The seed of micro-batch ``micro_batch`` of step ``step`` (counted over all processes); micro-batch 0 draws
    with ``step_seed``."""
    return (step_seed(seed, step) + micro_batch * 1_000_000_007) % (2**62)


class SampleOrder:
    """Sample indices of optimizer step ``k``: a fresh permutation each epoch, a function of (seed, k) alone."""

    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise DataError("the training set is empty; point --dataset at data with at least one full sample")
        self.n, self.seed = num_samples, seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _perm_of(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 7_777 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    def indices(self, step: int, batch: int) -> torch.Tensor:
        out, pos = [], step * batch
        while len(out) < batch:
            epoch, offset = divmod(pos, self.n)
            take = min(batch - len(out), self.n - offset)
            out.extend(self._perm_of(epoch)[offset : offset + take].tolist())
            pos += take
        return torch.tensor(out, dtype=torch.long)

    def epoch_of(self, step: int, batch: int) -> float:
        return step * batch / self.n
