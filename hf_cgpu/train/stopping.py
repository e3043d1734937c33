"""Stopping before ``max_steps``: the ``--max_minutes`` deadline (finish as usual), SIGTERM and Ctrl-C (checkpoint,
stop, name the command that resumes: ``resume_command``).

Ctrl-C (SIGINT) ends the step under way, so the checkpoint holds a whole step (an interrupt in the middle of the
optimizer's update would save half-updated weights); a second Ctrl-C stops at once, keeping the newest checkpoint.

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
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

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
    """A context: inside, SIGTERM (and SIGHUP, SIGINT unless ignored) is caught, the parent's death sends SIGTERM,
    and the deadline runs from entry; ``clock``: ``now``. The first signal names the stop (``signal_name``)."""

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
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a background job: left ignored
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)
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
        if not self.signalled:  # accelerate's launcher answers Ctrl-C with a SIGTERM: the Ctrl-C names the stop
            self.signal_name = signal.Signals(signum).name
        self.signalled = True

    def _on_interrupt(self, signum, frame) -> None:
        """The first Ctrl-C: end this step, checkpoint, stop; the next one raises ``KeyboardInterrupt`` at once. It
        names the stop even where the SIGTERM accelerate's launcher sends at once was handled first, or runs between
        two lines of this handler (hence ``signalled`` before the name)."""
        self.signalled = True
        self.signal_name = "SIGINT"
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.write(2, b"\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again stops at once)\n")

    def poll(self, accelerator=None) -> tuple[bool, bool]:
        """(signalled, out of time), the same on every process (any rank's signal or deadline counts). A Ctrl-C on
        any rank names the stop on all of them: a launcher passes the terminal's Ctrl-C on to each process, and a rank
        whose own signal had not arrived when they agreed must not call it another process's SIGTERM."""
        flags = (self.signalled, self.out_of_time(), self.signal_name == "SIGINT")
        if accelerator is None or accelerator.num_processes == 1:
            return flags[:2]
        import torch

        t = torch.tensor([int(f) for f in flags], device=accelerator.device)
        t = accelerator.reduce(t, reduction="sum")
        if t[2]:
            self.signal_name = "SIGINT"
        elif t[0] and not self.signal_name:
            self.signal_name = "SIGTERM (another process)"
        return bool(t[0]), bool(t[1])

    def out_of_time(self) -> bool:
        return self.clock() > self.deadline


RESUME_FLAG = "--resume_from_checkpoint"
LAUNCHERS = ("accelerate", "torchrun", "hf-cgpu", "accelerate.commands.launch", "accelerate.commands.accelerate_cli",
             "torch.distributed.run", "hf_cgpu.cli")
"""Programs (console scripts or ``python -m`` modules) that start training processes as their children."""


def resume_command(argv: Sequence[str] | None = None) -> str:
    """The command that started this run, as typed (``hf-cgpu ...``, ``python recipes/x.py ...``; the launcher's
    where accelerate, torchrun or ``hf-cgpu --num_processes`` started this process), with ``RESUME_FLAG latest``
    in place of any value it had. ``argv``: a process's full command line (``sys.orig_argv`` by default)."""
    words = as_typed(list(argv) if argv is not None else launcher_argv() or list(sys.orig_argv))
    out: list[str] = []
    skip = False
    for word in words:
        if skip or word.startswith(RESUME_FLAG + "="):
            skip = False
            continue
        skip = word == RESUME_FLAG
        if not skip:
            out.append(word)
    return shlex.join([*out, RESUME_FLAG, "latest"])


def as_typed(argv: list[str]) -> list[str]:
    """A Python process's command line as a user types it: ``python -m mod ...``, a console script by its name
    (``hf-cgpu``, ``accelerate``: the interpreter the kernel added from its first line dropped), or
    ``python script.py ...``."""
    if not argv or not Path(argv[0]).name.startswith("python"):
        return argv
    rest = argv[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):  # the interpreter's options: -u, -O
        rest = rest[1:]
    if not rest or rest[0] in ("-m", "-c"):
        return [Path(argv[0]).name, *rest]
    script, name = Path(rest[0]), Path(rest[0]).name
    on_path = shutil.which(name)
    beside = script.is_absolute() and script.parent == Path(argv[0]).parent  # the interpreter of its first line
    if beside or (on_path and Path(on_path).resolve() == script.resolve()):
        return [name, *rest[1:]]
    return [Path(argv[0]).name, *rest]


def launcher_argv() -> list[str] | None:
    """The parent's command line (Linux) when the parent is a launcher (``LAUNCHERS``), else None."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    argv = [w.decode(errors="replace") for w in raw.split(b"\0") if w]
    typed = as_typed(argv)
    program = typed[2] if typed[1:2] == ["-m"] and len(typed) > 2 else (typed[0] if typed else "")
    return argv if program in LAUNCHERS else None
