"""Averages of the trainable weights (an exponential moving one, ``EMA``; an equal-weight one from a step on, ``SWA``),
and the one way to put them in place."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from .parallel import full_tensor


class EMA:
    """shadow <- decay_at(step) * shadow + (1 - decay_at(step)) * weights, in fp32; saved as safetensors.

    Every process keeps the average of its own parameters: whole replicas under DDP (the same on every rank), its
    shards under FSDP2 (``DTensor``: the update is elementwise, saving gathers whole tensors, loading cuts them)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().clone().float() for n, p in self.params.items()}

    def decay_at(self, step: int) -> float:
        """Warm-up: min(decay, (1 + step) / (10 + step)), so early averages do not drag in the random init
        (with 0.9999 and no warm-up, 41% of the EMA is still the init after 9000 steps)."""
        return min(self.decay, (1 + step) / (10 + step))

    def decay_reached_at(self) -> int:
        """First step at which ``decay`` itself, not the warm-up, sets the average: (1 + s) / (10 + s) >= decay."""
        return max(0, math.ceil((10 * self.decay - 1) / (1 - self.decay) - 1e-6))  # decay < 1: the settings check it

    def warmup_note(self, max_steps: int) -> str | None:
        """A line for runs that end before ``decay`` is reached (their average is the warm-up's, about the last
        step/9 steps, whatever the decay says), else None."""
        at = self.decay_reached_at()
        if max_steps >= at:
            return None
        return (f"ema: decay {self.decay:g} is reached only at step {at:,} (warm-up min(decay, (1 + step) / (10 + "
                f"step))), after the run's last step (--max_steps {max_steps:,}): the average spans about the last "
                f"step/9 steps (decay {self.decay_at(max_steps):.5f} at step {max_steps:,}), so a larger --ema_decay "
                "changes nothing")

    @torch.no_grad()
    def update(self, step: int, apply: torch.Tensor | None = None) -> None:
        """One step of the average; ``apply`` (a 0-d bool tensor on the device, never read on the host): the step
        counts only where it is true (a skipped non-finite step leaves the average as it was)."""
        names = list(self.params)
        shadow = [self.shadow[n] for n in names]
        weights = [self.params[n].detach().float() for n in names]
        if apply is None:
            torch._foreach_lerp_(shadow, weights, 1.0 - self.decay_at(step))
            return
        delta = torch._foreach_sub(weights, shadow)
        torch._foreach_mul_(delta, apply.float() * (1.0 - self.decay_at(step)))
        torch._foreach_add_(shadow, delta)

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange live and EMA weights (call twice to restore)."""
        for n, p in self.params.items():
            live = p.detach().float().clone()
            p.copy_(self.shadow[n].to(p.dtype))
            self.shadow[n] = live

    def save(self, path: Path | None) -> None:
        """Write whole tensors to ``path``; with sharded weights every process must call it (the gather is a
        collective), those that do not write with ``path`` None."""
        tensors = {n: full_tensor(t) for n, t in self.shadow.items()}
        if path is not None:
            save_file({n: t.contiguous() for n, t in tensors.items()}, str(path))

    def load(self, path: Path) -> None:
        loaded = load_file(str(path))
        for n, t in self.shadow.items():
            if hasattr(t, "device_mesh"):  # a DTensor shard: this rank's part of the whole saved tensor
                from torch.distributed.tensor import distribute_tensor

                whole = loaded[n].to(t.to_local().device)
                t.to_local().copy_(distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local())
            else:
                t.copy_(loaded[n])


class SWA(EMA):
    """Stochastic weight averaging as an ``EMA`` whose decay counts the steps: from step ``start`` on, the shadow is
    the mean of the weights of every step since (decay ``n / (n + 1)`` at the ``n``-th step after ``start``); before
    it, decay 0, so the shadow is the weights themselves and everything that reads the EMA (evaluation, the best
    weights, the saved model, checkpoints) reads the live weights until the average starts."""

    def __init__(self, model: torch.nn.Module, fraction: float, last_step: Callable[[], int]):
        super().__init__(model, 0.0)
        self.fraction, self.last_step = fraction, last_step

    @property
    def start(self) -> int:
        """The first step of the average: ``fraction`` of the schedule's length (``--fit_schedule_to_time`` fixes
        it early, long before the average starts)."""
        return int(self.fraction * self.last_step())

    def decay_at(self, step: int) -> float:
        n = step - self.start
        return n / (n + 1) if n > 0 else 0.0

    def warmup_note(self, max_steps: int) -> str | None:
        return None


@contextmanager
def ema_weights(ema: EMA | None, enabled: bool = True):
    """Inside: the model holds its EMA weights (a no-op without EMA); outside: the live weights again."""
    swap = ema is not None and enabled
    if swap:
        ema.swap()
    try:
        yield
    finally:
        if swap:
            ema.swap()
