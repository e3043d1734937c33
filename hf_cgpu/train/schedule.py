"""What optimizer step ``k`` uses, as functions of ``(seed, k)`` only: its learning rate, its random seed, its samples.

That is what makes resume exact: a run restarted from a checkpoint at step ``k`` replays what the uninterrupted run
did from there. ``--fit_schedule_to_time`` measures the schedule's length once (``TimeFit``) and the checkpoint keeps
it, so the learning rate stays a function of ``k`` and that saved length.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import DataError


def lr_at(step: int, s, total: int = 0, warmup: int | None = None) -> float:
    """Linear warmup to ``learning_rate`` over ``warmup`` steps (None: ``warmup_steps``), then cosine to
    ``min_lr_ratio * learning_rate`` at ``total`` steps (0: ``max_steps``)."""
    warmup = s.warmup_steps if warmup is None else warmup
    if step < warmup:
        return s.learning_rate * (step + 1) / warmup
    total = total or s.max_steps
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = s.min_lr_ratio * s.learning_rate
    return floor + 0.5 * (s.learning_rate - floor) * (1 + math.cos(math.pi * progress))


def weight_decay_factor(step: int, s, total: int = 0) -> float:
    """The multiple of every group's weight decay at ``step``: 1 until ``weight_decay_hold`` of the ``total`` steps
    (0: ``max_steps``), then linear to ``weight_decay_end`` at ``total``."""
    if s.weight_decay_end == 1.0:
        return 1.0
    total = total or s.max_steps
    hold = s.weight_decay_hold * total
    progress = min(1.0, max(0.0, (step - hold) / max(1.0, total - hold)))
    return 1.0 + (s.weight_decay_end - 1.0) * progress


def calibration_step(s) -> int:
    """The step at which ``--fit_schedule_to_time`` fixes the schedule: the end of warmup (the steps before it do not
    depend on the length), after the first evaluation (so its cost is in the timing) and at least 10 steps in."""
    return min(s.max_steps, max(s.warmup_steps, s.eval_steps + 1 if s.eval_steps else 0, 10))


def fitted_length(step: int, seconds_per_step: float, seconds_left: float, max_steps: int,
                  margin: float = 0.03, annealed: tuple[float, float] | None = None) -> int:
    """The last step of a schedule that ends inside ``seconds_left`` (less ``margin`` of it) at the measured
    ``seconds_per_step``, counted from ``step``; between ``step + 1`` and ``max_steps`` (``max_steps`` itself when
    the timing ends there: a run never goes past its --max_steps). ``annealed``: (share, ratio) of an extra loss
    that runs in the timed steps and stops at ``share`` of the schedule (--mtp_anneal, --distill_anneal), the steps
    after it costing ``ratio`` of a timed one, so a length L holds (share L - step) timed steps and (1 - share) L
    cheaper ones."""
    budget = (1 - margin) * max(0.0, seconds_left) / max(seconds_per_step, 1e-9)  # in timed steps
    share, ratio = annealed or (1.0, 1.0)
    if share >= 1 or ratio >= 1:
        more = int(budget)
    elif (length := (budget + step) / (share + ratio * (1 - share))) * share >= step:
        more = int(length) - step
    else:  # the extra loss has stopped before this step: every step left is a cheaper one
        more = int(budget / ratio)
    return min(max_steps, max(step + 1, step + more))


def fitted_warmup(step: int, length: int, warmup: int) -> int:
    """The warmup of a schedule fixed at ``step`` with ``length`` steps: ``warmup`` while the decay keeps at least as
    many steps, else cut to end at half the length (never before ``step``, whose learning rate is already used)."""
    return warmup if length - warmup >= warmup else min(warmup, max(step, length // 2))


def fix_length(state, settings, step: int, length: int) -> int:
    """Fix the schedule's length at ``step`` to ``length`` steps in ``state`` (kept by the checkpoint), with the warmup
    ``fitted_warmup`` allows; returns the warmup where it was cut, else 0."""
    warmup = fitted_warmup(step, length, settings.warmup_steps)
    state.schedule_steps = length
    state.schedule_warmup = warmup if warmup != settings.warmup_steps else 0
    return state.schedule_warmup


class TimeFit:
    """``--fit_schedule_to_time``: times the steps of this process from the end of its first one (compilation is not
    a step's cost) to ``calibration_step``, then fixes ``state.schedule_steps`` (the same on every process).

    When the steps so far say the calibration step would come after half the minutes left (a slow machine, a long
    warmup), the schedule is fixed at once from them, and a warmup the fitted length cannot hold is shortened
    (``fitted_warmup``), so the learning rate still decays to its end by the deadline."""

    def __init__(self, settings, state, clock: Callable[[], float], annealed: tuple[float, float] | None = None):
        self.settings, self.clock, self.annealed = settings, clock, annealed
        self.enabled = bool(settings.fit_schedule_to_time) and not state.schedule_steps
        self.at = calibration_step(settings)
        self.t0: float | None = None
        self.step0 = 0

    def after_step(self, step: int, state, deadline: float, accelerator=None) -> str | None:
        """Call after each optimizer step; returns the message once the schedule is fixed."""
        if not self.enabled:
            return None
        t = self.clock()
        if self.t0 is None:
            self.t0, self.step0 = t, step
            return None
        timed = step >= max(self.at, self.step0 + 3) or step >= self.settings.max_steps
        early = step < self.at
        if early and not timed:  # every process must take the same decision at the same step: rank 0's
            per_step = (t - self.t0) / (step - self.step0)
            early = _share(accelerator, (self.at - step) * per_step > 0.5 * (deadline - t))
        if not (timed or early):
            return None
        per_step = (t - self.t0) / (step - self.step0)
        length = _share(accelerator, fitted_length(step, per_step, deadline - t, self.settings.max_steps,
                                                   annealed=self.annealed))
        warmup = fix_length(state, self.settings, step, length)
        self.enabled = False
        why = (f" (step {self.at:,}, the end of the timing, would come after half of them)"
               if step < min(self.at, self.settings.max_steps) else "")
        cheaper = (f", the steps after {self.annealed[0]:g} of the schedule at {self.annealed[1]:.2f} of that (the "
                   "annealed loss stopped; the ledger's ratio)" if self.annealed else "")
        return (f"schedule fitted to --max_minutes {self.settings.max_minutes:g}{why}: {per_step:.3f} s per step "
                f"over steps {self.step0}-{step}{cheaper}, {deadline - t:,.0f} s left -> the cosine ends at step "
                f"{length:,}"
                + (f" (max_steps {self.settings.max_steps:,})" if length < self.settings.max_steps else "")
                + (f", warmup cut to {warmup:,} steps" if warmup else ""))

    def unfitted(self) -> str:
        """The note for a deadline that came before any step was timed ('' when the schedule was fixed)."""
        if not self.enabled:
            return ""
        return ("; the schedule was never fitted (the deadline came before a second step was timed), so the "
                "learning rate did not decay: raise --max_minutes")


def _share(accelerator, value):
    """Rank 0's ``value`` on every process."""
    if accelerator is None or accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def set_lr(optimizer: torch.optim.Optimizer, lr: float, weight_decay_factor: float = 1.0) -> None:
    """Every group gets ``lr``; a group with ``lr_scale`` (Muon's: its peak over ``learning_rate``) that multiple.
    ``weight_decay_factor`` other than 1 scales each group's weight decay as the optimizer was built with it (kept in
    the group, so a checkpoint's optimizer state carries it)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr
        if weight_decay_factor != 1.0 or "initial_weight_decay" in group:
            base = group.setdefault("initial_weight_decay", group["weight_decay"])
            group["weight_decay"] = base * weight_decay_factor


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
