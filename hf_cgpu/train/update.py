"""Applying step k: the optimizer step and the EMA update, or neither when the step's loss or gradient norm is not
finite; then step k's figures (``Outcome``) for the guards, the counters and the logs.

Where the optimizer can skip on the device, the host never waits for the GPU between steps: torch's fused
Adam/AdamW take a ``found_inf`` tensor (GradScaler's flag: no update, no moment or step-count change), the EMA update
is scaled by the same flag, and step k's figures travel to pinned host memory behind a non-blocking copy and an event
while step k+1 is queued, so the loop reads them one step late (the first step of a process, and every step after
a non-finite one until a finite one, at once). Everywhere else (8-bit AdamW, Muon, fp16's GradScaler, which sets
``found_inf`` itself, FSDP2 shards) the figures are read at once and a non-finite step is skipped on the host. Both
paths skip the same steps: those whose loss or gradient norm is not finite. ``HF_CGPU_SYNC_STEPS=1`` takes the second
path everywhere (a step-by-step A/B of what the wait costs,
``benchmarks/throughput/gpu_flow_speed.sh``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .parallel import is_sharded


@dataclass(frozen=True)
class Outcome:
    """What step ``step`` did, read on the host."""

    step: int
    """The step's index (its data is ``order.indices(step, ...)``)."""
    lr: float
    loss: float
    """Mean loss over the micro-batches of every process."""
    grad_norm: float
    """Global gradient norm before clipping."""
    units: int
    """Throughput units all processes trained on (tokens, images)."""

    @property
    def finite(self) -> bool:
        """False: the optimizer and the EMA left this step out."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def skips_on_device(accelerator, optimizer) -> bool:
    """True when a non-finite step can be skipped without reading it on the host (see the module docstring)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    return (os.environ.get("HF_CGPU_SYNC_STEPS", "0") != "1" and type(inner) in (torch.optim.Adam, torch.optim.AdamW)
            and all(group.get("fused") for group in inner.param_groups)
            and getattr(accelerator, "scaler", None) is None and not is_sharded(accelerator))


@dataclass
class _Readout:
    """Step ``step``'s (loss, grad norm, units) on their way to the host; ``event`` None: already there."""

    step: int
    lr: float
    values: torch.Tensor
    """loss, grad norm (and units when the processes summed them on the device), float64."""
    units: int | None
    """Units known on the host (one process), else None."""
    event: object | None


class Updater:
    """``apply`` step k and get back the outcomes now readable (k's, or k-1's one step late); ``flush`` the rest
    before anything that needs every step accounted for (evaluation, a checkpoint, the end)."""

    def __init__(self, accelerator, optimizer, ema=None, deferred: bool | None = None):
        self.optimizer, self.ema = optimizer, ema
        self.inner = getattr(optimizer, "optimizer", optimizer)
        self.deferred = skips_on_device(accelerator, optimizer) if deferred is None else deferred
        cuda = accelerator.device.type == "cuda"
        # two pinned buffers, used in turn: step k's copy lands while step k-1's is read
        self.buffers = [torch.empty(3, dtype=torch.float64, pin_memory=True) for _ in range(2)] if cuda else None
        self.turn = 0
        self.pending: _Readout | None = None
        self.started = False
        self.read_now = False
        """True: read each step before the next is queued (the first step of a process, so its time is exact; a
        run of non-finite steps, so a stop happens at the step the host-side skip stops at, nothing applied after)."""

    def apply(self, step: int, lr: float, result) -> list[Outcome]:
        """Step (or skip) the optimizer and the EMA for step ``step`` (``result``: the ``StepResult`` of its
        forward/backward), clear the gradients."""
        on_host = not torch.is_tensor(result.units)
        values = torch.stack([t.detach().double() for t in
                              (result.loss, result.grad_norm, *(() if on_host else (result.units,)))])
        units = int(result.units) if on_host else None
        if not self.deferred:
            outcome = self._outcome(_Readout(step, lr, values, units, None))
            if outcome.finite:
                self.optimizer.step()
                if self.ema is not None:
                    self.ema.update(step)
            self.optimizer.zero_grad(set_to_none=True)
            return [outcome]
        finite = torch.isfinite(values[:2]).all()
        self.inner.found_inf = (~finite).float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(step, apply=finite)
        readout = self._send(step, lr, values, units)
        if not self.started or self.read_now:
            self.started = True
            return [*self.flush(), self._outcome(readout)]
        previous, self.pending = self.pending, readout
        return [self._outcome(previous)] if previous is not None else []

    def flush(self) -> list[Outcome]:
        """The step still on its way, read now (waits for the device)."""
        previous, self.pending = self.pending, None
        return [self._outcome(previous)] if previous is not None else []

    def _send(self, step: int, lr: float, values: torch.Tensor, units: int | None) -> _Readout:
        if self.buffers is None:  # on the CPU the values are computed by the time they are read
            return _Readout(step, lr, values, units, None)
        buffer, self.turn = self.buffers[self.turn][: len(values)], 1 - self.turn
        buffer.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Readout(step, lr, buffer, units, event)

    @staticmethod
    def _outcome(readout: _Readout) -> Outcome:
        if readout.event is not None:
            readout.event.synchronize()
        loss, grad_norm, *summed = readout.values.tolist()
        return Outcome(readout.step, readout.lr, loss, grad_norm, readout.units if not summed else int(summed[0]))
