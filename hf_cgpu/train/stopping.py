"""Stopping before ``max_steps``: the ``--max_minutes`` deadline (finish as usual) and SIGTERM (checkpoint, stop).

Signals reach training whichever process receives them. ``accelerate launch`` runs the script as a child and does
not forward SIGTERM: killing the launcher alone would leave the child training on, orphaned. Inside ``Stopping`` the
training process asks the kernel (Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``) for a SIGTERM when its parent dies,
so a killed launcher (or a closed terminal, SIGHUP) ends in the same checkpoint-and-stop as a SIGTERM to the
child itself. With several processes the flags are agreed by an all-reduce every step, so every rank stops at
the same step and checkpoints together.

Early stopping on validation is the best-weights keeper's (``validation.BestKeeper.should_stop``).
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
import time
from collections.abc import Callable

PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2


def now() -> float:
    """The clock of the deadline (monotonic seconds)."""
    return time.monotonic()


def _prctl(option: int, arg) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, arg, 0, 0, 0)


def parent_death_signal(sig: int) -> int | None:
    """Linux: have the kernel send ``sig`` to this process when its parent exits; returns the previous setting
    (None where unsupported). Sent at once if the parent already died between start and this call."""
    if sys.platform != "linux":
        return None
    try:
        previous = ctypes.c_int(0)
        _prctl(PR_GET_PDEATHSIG, ctypes.byref(previous))
        parent = os.getppid()
        if _prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    if sig and os.getppid() != parent:  # the parent died before the request was in place
        os.kill(os.getpid(), sig)
    return previous.value


class Stopping:
    """A context: inside, SIGTERM (and SIGHUP unless ignored) is caught, the parent's death sends SIGTERM, and the
    deadline runs from entry; ``clock``: ``now``."""

    def __init__(self, max_minutes: float, catch_signals: bool = True, clock: Callable[[], float] | None = None):
        self.max_minutes, self.catch_signals = max_minutes, catch_signals
        self.clock = clock if clock is not None else now
        self.deadline = math.inf
        self.signalled = False
        self.signal_name = ""
        self._previous: dict[int, object] = {}
        self._pdeathsig: int | None = None

    def __enter__(self) -> Stopping:
        if self.max_minutes > 0:
            self.deadline = self.clock() + 60 * self.max_minutes
        if self.catch_signals:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_term)
            if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:  # nohup: left ignored
                self._previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_term)
            self._pdeathsig = parent_death_signal(signal.SIGTERM)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._pdeathsig is not None:
            parent_death_signal(self._pdeathsig)
            self._pdeathsig = None

    def _on_term(self, signum, frame) -> None:  # a scheduler, `kill`, the launcher's death: checkpoint, then stop
        self.signalled = True
        self.signal_name = signal.Signals(signum).name

    def poll(self, accelerator=None) -> tuple[bool, bool]:
        """(signalled, out of time), the same on every process (any rank's signal or deadline counts)."""
        flags = (self.signalled, self.out_of_time())
        if accelerator is None or accelerator.num_processes == 1:
            return flags
        import torch

        t = torch.tensor([int(f) for f in flags], device=accelerator.device)
        t = accelerator.reduce(t, reduction="sum")
        if t[0] and not self.signal_name:
            self.signal_name = "SIGTERM (another process)"
        return bool(t[0]), bool(t[1])

    def out_of_time(self) -> bool:
        return self.clock() > self.deadline
