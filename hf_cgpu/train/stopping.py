"""Stopping before ``max_steps``: the ``--max_minutes`` deadline (finish as usual) and SIGTERM (checkpoint, stop).

Early stopping on validation is the best-weights keeper's (``validation.BestKeeper.should_stop``).
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable


def now() -> float:
    """The clock of the deadline (monotonic seconds)."""
    return time.monotonic()


class Stopping:
    """A context: inside, SIGTERM is caught (main process) and the deadline runs from entry; ``clock``: ``now``."""

    def __init__(self, max_minutes: float, catch_signals: bool = True, clock: Callable[[], float] | None = None):
        self.max_minutes, self.catch_signals = max_minutes, catch_signals
        self.clock = clock if clock is not None else now
        self.deadline = math.inf
        self.signalled = False
        self._previous = None

    def __enter__(self) -> Stopping:
        if self.max_minutes > 0:
            self.deadline = self.clock() + 60 * self.max_minutes
        if self.catch_signals:
            self._previous = signal.signal(signal.SIGTERM, self._on_term)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_term(self, signum, frame) -> None:  # a scheduler or `kill`: the loop checkpoints, then stops
        self.signalled = True

    def out_of_time(self) -> bool:
        return self.clock() > self.deadline
