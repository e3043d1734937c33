"""Errors a user can fix, and the one place that turns them into a one-line message and exit code 2.

Every recipe and every ``hf-cgpu`` subcommand runs its ``main`` through ``run_main``. A ``UserError`` (bad settings,
data, checkpoint or Hub input, or a run stopped on purpose) prints ``error: <message>`` on stderr and returns 2,
the exit code argparse uses for bad arguments; Ctrl-C (``KeyboardInterrupt``, or ``Interrupted`` from a run that
saved a checkpoint first) prints its one line and returns 130, as a shell reports a process stopped by SIGINT.
Anything else is a bug and keeps its traceback. ``HF_CGPU_DEBUG=1`` shows the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

USER_ERROR_EXIT = 2
INTERRUPTED_EXIT = 130
"""128 + SIGINT: what a shell reports for a process that Ctrl-C stopped."""
CLOSED_PIPE_EXIT = 141
"""128 + SIGPIPE: what a shell reports for a process whose reader went away (``... | head -1``)."""


class UserError(Exception):
    """Something the user can fix; the message is one line that names the fix."""

    exit_code = USER_ERROR_EXIT


class SettingsError(UserError, ValueError):
    """A bad setting or combination of settings."""


class DataError(UserError, ValueError):
    """Data that cannot be used as given (missing column, empty split, undecodable file)."""


class MissingPathError(UserError, FileNotFoundError):
    """A file or folder named on the command line does not exist."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is incomplete, corrupted or written for another model."""


class IntegrityError(CheckpointError):
    """A checkpoint, best-weights or model folder whose files do not match its manifest (missing, truncated, changed)."""


class OutputDirError(UserError, RuntimeError):
    """An output folder that cannot take this run: another run's, locked by a running writer, read-only or full."""


class TrainingStopped(UserError, RuntimeError):
    """The run stopped on purpose (diverged, out of memory at micro-batch 1, SIGTERM); a checkpoint was saved first."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a run; the message names the checkpoint that is kept and the command that resumes from
    it. A ``KeyboardInterrupt``, so that no ``except Exception`` on the way up swallows it."""

    exit_code = INTERRUPTED_EXIT


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the one error path: a bad flag or value is a ``SettingsError`` (one line, exit 2), not
    argparse's usage block (dozens of lines for a settings parser) followed by the message. Flags are never taken by
    a prefix (``--max_step`` is no ``--max_steps``), and an unknown one is answered with the closest real one. A value
    that starts with a minus and a digit (``-0.1:0.5``, ``-1e-3``) is a value, never a flag, so it reaches the setting's
    own check (argparse takes only plain negative numbers so)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)  # keeps ``about``'s lines
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d\S*$")

    def error(self, message: str):  # type: ignore[override]
        raise SettingsError(f"{self.prog}: {message}{self._did_you_mean(message)}; `{self.prog} --help` lists the "
                            "options")

    def _did_you_mean(self, message: str) -> str:
        """`` (did you mean --max_steps?)`` for the first unknown flag in ``message`` that is close to a real one
        (a dash for an underscore, a letter missing)."""
        if "unrecognized arguments" not in message:
            return ""
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        for word in message.split(":", 1)[1].split():
            if not word.startswith("--"):
                continue
            flag = "--" + word.split("=", 1)[0][2:].replace("-", "_")
            longer = sorted((f for f in flags if f.startswith(flag)), key=len)  # a prefix of a real flag
            close = longer or difflib.get_close_matches(flag, flags, n=1, cutoff=0.8)
            if close:
                return f" (did you mean {close[0]}?)"
        return ""


def about(what: str, *examples: str, more: str = "") -> str:
    """The start of every command's ``--help``: what it does in one sentence, then its example command(s), then
    ``more``."""
    head = "examples:" if len(examples) > 1 else "example:"
    return "\n\n".join(x for x in (textwrap.fill(what, 100), head + "\n" + "\n".join(f"  {e}" for e in examples), more.strip()) if x)


def require_model(spec: str, what: str = "model folder") -> None:
    """A ``spec`` that looks like a local path must exist. ``owner/name`` is left to the Hub loader, unless ``owner``
    is a local folder (``runs/nope``: a mistyped run, not a Hub id) or the Hub is switched off (HF_HUB_OFFLINE)."""
    if Path(spec).expanduser().exists():
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    hub_like = spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not Path(spec.split("/")[0]).is_dir()
    if not hub_like or offline:
        why = " (and HF_HUB_OFFLINE is set, so no Hub id)" if hub_like else ""
        raise MissingPathError(f"{what} {spec!r} not found{why}; pass a trained run's output_dir or a Hub id")


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)``; a ``UserError`` ends in one line on stderr and its exit code (2; Ctrl-C: 130), and so
    does Ctrl-C anywhere (``HF_CGPU_DEBUG=1``: raise). A reader that closed stdout (``| head``) ends it quietly, as
    a shell's own tools end, with 141."""
    try:
        code = int(main(argv) or 0)
        return code if _flush_stdout() else CLOSED_PIPE_EXIT
    except BrokenPipeError:
        _flush_stdout()
        return CLOSED_PIPE_EXIT
    except SystemExit:  # argparse's --help, printed into a pipe that may be closed
        if not _flush_stdout():
            return CLOSED_PIPE_EXIT
        raise
    except (UserError, KeyboardInterrupt) as err:
        if os.environ.get("HF_CGPU_DEBUG"):
            raise
        message = str(err) or "interrupted (Ctrl-C)"
        print(f"error: {' '.join(message.split())}", file=sys.stderr)
        return getattr(err, "exit_code", INTERRUPTED_EXIT)


def _flush_stdout() -> bool:
    """Flush stdout now (what is still buffered meets a closed pipe here, not in a traceback at exit); False when its
    reader went away, and stdout then points at /dev/null, where the interpreter's own flush at exit cannot fail."""
    try:
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False
