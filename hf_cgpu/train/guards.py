"""Guards on every step: non-finite loss or gradient norm (skip, then stop), gradient-norm spikes, a label leak in
the first step, and CUDA out-of-memory in the first steps (halve the micro-batch, keep the effective batch).

The guards take a step's index (0 for the first optimizer step) and name it as the logs and checkpoints do, from 1:
index k is step k + 1."""

from __future__ import annotations

import enum
import gc
import math
import statistics
from collections import deque

import torch

from ..errors import TrainingStopped
from .checkpoint import TrainState

SPIKE_WINDOW = 200
"""Gradient norms the spike guard's running median looks back over."""
SPIKE_MIN_HISTORY = 20
"""Steps before the spike guard says anything."""
OOM_RETRY_STEPS = 3
"""OOM is retried only in the first steps of a (resumed) run: later it is no batch-size problem."""


class Verdict(enum.Enum):
    OK = "ok"
    SKIP = "skip"
    """The step's loss or gradient norm is not finite: no optimizer step, its data is consumed."""
    STOP = "stop"
    """Too many non-finite steps in a row: checkpoint the last good state and stop."""


class NonFiniteGuard:
    def __init__(self, patience: int):
        self.patience, self.in_row = patience, 0

    def check(self, step: int, loss: float, grad_norm: float, log=print) -> Verdict:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_row = 0
            return Verdict.OK
        self.in_row += 1
        log(f"step {step + 1}: non-finite loss/grad_norm ({loss}, {grad_norm}); optimizer step skipped "
            f"({self.in_row}/{self.patience} in a row)")
        return Verdict.STOP if self.in_row >= self.patience else Verdict.SKIP


def _where(saved, good, on_disk=()) -> str:
    earlier = [p.name for p in on_disk if saved is None or p.name != saved.name]
    before = (f" Earlier checkpoints, kept (pick one from before the divergence with --resume_from_checkpoint "
              f"PATH): {', '.join(earlier)}." if earlier else "")
    if saved is not None:
        return f"The last state (finite) is checkpointed as {saved.name}.{before}"
    last = f"the newest finite checkpoint is {good.name}" if good is not None else "no checkpoint was written yet"
    return f"The weights are no longer finite, so nothing was checkpointed; {last}."


def diagnosis(step: int, lr: float, saved=None, good=None, on_disk=()) -> str:
    return (
        f"training stopped at step {step}: loss or gradient norm kept coming out non-finite. Check, in this order: "
        f"(1) numerics - rerun a few steps with --mixed_precision no; (2) learning rate - cut it tenfold "
        f"(now {lr:.2e}) or lengthen warmup; (3) data - look for extremely long or single-token samples in the "
        f"batches of this step; (4) clipping - keep --max_grad_norm 1.0. {_where(saved, good, on_disk)}"
    )


def diverged(step: int, lr: float, good=None) -> str:
    """The weights themselves went non-finite (found at a checkpoint)."""
    return (f"training stopped at step {step}: the weights or optimizer state are no longer finite (learning rate "
            f"{lr:.2e}: cut it tenfold or lengthen warmup, keep --max_grad_norm 1.0). {_where(None, good)}")


class SpikeGuard:
    """Warn when a gradient norm exceeds ``factor`` times its running median (loss blow-ups often follow)."""

    def __init__(self, factor: float):
        self.factor = factor
        self.norms: deque[float] = deque(maxlen=SPIKE_WINDOW)

    def observe(self, step: int, grad_norm: float, log=print) -> bool:
        median = statistics.median(self.norms) if len(self.norms) >= SPIKE_MIN_HISTORY else None
        self.norms.append(grad_norm)
        if median is not None and grad_norm > self.factor * median:
            log(f"warning: step {step + 1} grad_norm {grad_norm:.2f} is {grad_norm / median:.0f}x its running median; "
                "loss blow-ups often follow within tens of steps (consider lower LR)")
            return True
        return False


class LabelLeakGuard:
    """The very first loss of a from-scratch LM should be about ln(vocab); far below it, targets leak into inputs."""

    def __init__(self, expected_initial_loss: float | None):
        self.expected = expected_initial_loss

    def check(self, step: int, first_step: int, loss: float, log=print) -> bool:
        if step == first_step == 0 and self.expected and loss < 0.5 * self.expected:
            log(f"warning: first loss {loss:.3f} is far below ln(vocab)={self.expected:.3f}: "
                "targets may not be shifted (label leak)")
            return True
        return False


class OOMGuard:
    """CUDA OOM in the first ``OOM_RETRY_STEPS`` steps: halve the micro-batch and double accumulation, down to 1.

    One process only: with several, the others wait in a collective of the step the failing one left, so a retry
    cannot be agreed; the error ends the run (the launcher stops every process) with the ladder's advice."""

    def __init__(self, enabled: bool, first_step: int, advice: str):
        self.enabled, self.first_step, self.advice = enabled, first_step, advice

    def may_retry(self, step: int) -> bool:
        return self.enabled and step - self.first_step < OOM_RETRY_STEPS

    def halve(self, state: TrainState, step: int, log=print) -> None:
        """Same effective batch, half the micro-batch; at micro-batch 1 the run stops with the ladder's next rung."""
        if state.micro_batch_size == 1:
            raise TrainingStopped(self.advice)
        state.micro_batch_size //= 2
        state.gradient_accumulation_steps *= 2
        state.record_batch(step, "CUDA out of memory")
        log(f"CUDA out of memory at step {step + 1}: retrying with micro_batch_size {state.micro_batch_size} "
            f"x accumulation {state.gradient_accumulation_steps} (same effective batch)")


def free_after_oom(optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Guards:
    """The per-step checks in their order: label leak (first step), non-finite, spike (finite steps only)."""

    def __init__(self, settings, expected_initial_loss: float | None, first_step: int, oom_advice: str, log=print,
                 processes: int = 1):
        self.first_step, self.log = first_step, log
        self.label_leak = LabelLeakGuard(expected_initial_loss)
        self.finite = NonFiniteGuard(settings.nan_patience)
        self.spike = SpikeGuard(settings.spike_factor)
        self.oom = OOMGuard(settings.oom_retry and processes == 1, first_step, oom_advice)

    @property
    def skipping(self) -> bool:
        """The last step checked was non-finite (a run of them may be a divergence under way)."""
        return self.finite.in_row > 0

    def check(self, step: int, loss: float, grad_norm: float) -> Verdict:
        self.label_leak.check(step, self.first_step, loss, self.log)
        verdict = self.finite.check(step, loss, grad_norm, self.log)
        if verdict is Verdict.OK:
            self.spike.observe(step, grad_norm, self.log)
        return verdict
