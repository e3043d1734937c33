"""An output folder belongs to one run, and is checked before the first step.

``claim`` (main process, before the task loads anything or writes its tokenizer):

1. the folder exists and takes a file (a read-only or full disk is found now, not after training steps were spent);
2. a lock (``filelock`` on ``.hf_cgpu.lock``, an ``flock`` the kernel drops when its process dies, even on SIGKILL)
   refuses a second writer in one line;
3. a fresh start (no ``--resume_from_checkpoint``) in a folder that holds an earlier run (checkpoints, a finished
   model, results) refuses in one line, or with ``--overwrite_output_dir true`` first deletes what hf_cgpu wrote
   there (checkpoints, best weights, tokenizer, samples, the files of the model manifest, results, history, card),
   so the new run is never mixed with the old one (otherwise pruning would keep the old run's higher step numbers
   and delete the new checkpoints, and ``--resume_from_checkpoint latest`` would load the old run).

``check_free_space`` (after the model and optimizer exist): room for two checkpoints, estimated from the tensors.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..errors import IntegrityError, OutputDirError
from ..integrity import MANIFEST, read_manifest
from .artifacts import finish_interrupted_save
from .checkpoint import checkpoint_root, list_checkpoints

LOCK_NAME = ".hf_cgpu.lock"
RESULTS = ("all_results.json", "history.json", "training_curves.png", "README.md")
"""Files of a finished run besides the model manifest's."""
RUN_FOLDERS = ("checkpoints", "best", "tokenizer", "samples")
"""Folders hf_cgpu writes into an output folder."""


class RunLock:
    """An exclusive, non-blocking lock on the output folder, held for the whole run."""

    def __init__(self, folder: Path):
        from filelock import FileLock

        self.path = Path(folder) / LOCK_NAME
        self._lock = FileLock(str(self.path), timeout=0)

    def acquire(self) -> RunLock:
        from filelock import Timeout

        try:
            self._lock.acquire()
        except Timeout:
            raise OutputDirError(
                f"another run is writing to {self.path.parent} (it holds {self.path}); wait for it to finish, "
                "stop it, or choose another --output_dir") from None
        return self

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release(force=True)


def check_writable(folder: Path) -> None:
    """Create the folder and write, fsync and delete one probe file in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".hf_cgpu-probe-{os.getpid()}"
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as err:
        raise OutputDirError(f"output_dir {folder} is not writable ({err.strerror or err}); fix its permissions "
                             "or disk, or choose another --output_dir") from None


MODEL_FILES = ("config.json", "model_index.json", "adapter_config.json", "model.safetensors",
               "adapter_model.safetensors")
"""Files that make a folder a model, sealed or not (a save cut off before its manifest, or one made by hand)."""


def earlier_run(folder: Path, fresh: bool = True) -> str | None:
    """What of an earlier run ``folder`` holds, in words (None: nothing). A resume (``fresh`` False) may start from
    step 0 beside best weights or an unsealed model of a run cut off before its first checkpoint: those count for a
    fresh start only."""
    ckpts = list_checkpoints(folder)
    if ckpts:
        return f"{len(ckpts)} checkpoint(s) of an earlier run (newest {ckpts[-1].name})"
    if (folder / MANIFEST).is_file():
        return f"a finished model ({MANIFEST})"
    if (folder / "all_results.json").is_file():
        return "the results of an earlier run (all_results.json)"
    if not fresh:
        return None
    model = [name for name in MODEL_FILES if (folder / name).is_file()]
    if model:
        return f"a model without {MANIFEST} ({', '.join(model)})"
    if (folder / "best").is_dir():
        return "the best weights of an earlier run (best/)"
    return None


def entries(folder: Path) -> set[str] | None:
    """The names at the top of ``folder`` (None: it does not exist)."""
    return set(os.listdir(folder)) if folder.is_dir() else None


def undo_start(folder: Path, before: set[str] | None) -> None:
    """Take back what a run made in ``folder`` when it ends before anything worth keeping exists (no sealed
    checkpoint, no model manifest): the folder itself when the run created it (``before`` None), else the entries it
    added (its tokenizer, its lock file). Called while the run still holds the folder's lock."""
    if not folder.is_dir() or list_checkpoints(folder) or (folder / MANIFEST).is_file():
        return
    if before is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name in set(os.listdir(folder)) - before:
        path = folder / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink(
            missing_ok=True)


def clear_earlier_run(folder: Path, log=print) -> None:
    """Delete what hf_cgpu wrote into ``folder`` (and nothing else)."""
    try:
        names = list(read_manifest(folder).files) if (folder / MANIFEST).is_file() else []
    except (IntegrityError, OSError) as err:  # unreadable or naming files outside: left; the new run writes its own
        log(f"warning: the files of the earlier model are left: {err}")
        names = []
    for rel in [*names, MANIFEST, *RESULTS]:
        (folder / rel).unlink(missing_ok=True)
    for name in RUN_FOLDERS:
        shutil.rmtree(folder / name, ignore_errors=True)
    for tmp in folder.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    for sub in sorted({(folder / rel).parent for rel in names}, key=lambda p: -len(p.parts)):
        if sub != folder and sub.is_dir() and not any(sub.iterdir()):
            sub.rmdir()
    log(f"--overwrite_output_dir: deleted the earlier run's checkpoints, model and results in {folder}")


def claim(folder: Path, resume: str, overwrite: bool, log=print) -> RunLock:
    """Writable, locked, and this run's: see the module docstring. Returns the held lock."""
    check_writable(folder)
    lock = RunLock(folder).acquire()
    try:
        finish_interrupted_save(folder, log)
        found = earlier_run(folder, fresh=not resume)
        if found and not resume:
            if not overwrite:
                raise OutputDirError(
                    f"output_dir {folder} holds {found}; resume it with --resume_from_checkpoint latest, choose "
                    "another --output_dir, or pass --overwrite_output_dir true to delete it first")
            clear_earlier_run(folder, log)
        elif resume == "latest" and found and not list_checkpoints(folder) and not _set_aside(folder):
            raise OutputDirError(
                f"--resume_from_checkpoint latest: output_dir {folder} holds {found} but no checkpoint to resume; "
                "choose another --output_dir, or pass --overwrite_output_dir true and no --resume_from_checkpoint")
    except BaseException:
        lock.release()
        raise
    return lock


def _set_aside(folder: Path) -> bool:
    root = checkpoint_root(folder)
    return root.is_dir() and any(p.name.startswith((".bad-", ".superseded-")) for p in root.iterdir())


# ---------------------------------------------------------------------------------------------------- free space


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def checkpoint_bytes(model: torch.nn.Module, tier: str = "full", ema: bool = False) -> int:
    """A checkpoint's size before its first save: the state dict, AdamW's two moments of every trainable weight
    (fp32; 8-bit AdamW: one byte each) and the EMA copy (fp32)."""
    weights = _bytes(model.state_dict().values())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_moment = 1 if tier == "adamw8bit" else 4
    return weights + 2 * per_moment * trainable + (4 * trainable if ema else 0)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def check_free_space(folder: Path, per_checkpoint: int, copies: int = 2) -> None:
    """Refuse to start when ``folder``'s filesystem cannot hold ``copies`` checkpoints (a save writes the new one
    before pruning the old)."""
    free = shutil.disk_usage(folder).free
    need = copies * per_checkpoint
    if free < need:
        raise OutputDirError(
            f"output_dir {folder} has {_gb(free)} free, but this run needs about {_gb(need)} ({copies} checkpoints "
            f"of ~{_gb(per_checkpoint)}: weights, optimizer moments, EMA); free space or choose another --output_dir")


__all__ = ["LOCK_NAME", "MODEL_FILES", "RunLock", "check_free_space", "check_writable", "checkpoint_bytes", "claim",
           "clear_earlier_run", "earlier_run", "entries", "undo_start"]
