"""Atomic, verifiable checkpoints around ``Accelerator.save_state``.

A checkpoint is written into ``checkpoints/.tmp-step_N``, sealed with a ``manifest.json`` listing every file and its
size, then renamed to ``checkpoints/step_N`` (a rename is atomic on one filesystem). A power cut leaves at worst a
``.tmp-*`` directory, which is ignored. At resume each candidate is verified (manifest present, sizes match,
safetensors headers parse); a bad one is reported in one line and the previous good one is used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from safetensors import safe_open

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    pass


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Sealed checkpoint directories, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def seal(tmp_dir: Path, final_dir: Path) -> Path:
    """Write the manifest, fsync, and rename ``tmp_dir`` to ``final_dir``."""
    files = {
        str(p.relative_to(tmp_dir)): p.stat().st_size for p in sorted(tmp_dir.rglob("*")) if p.is_file()
    }
    (tmp_dir / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
    for p in tmp_dir.rglob("*"):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(tmp_dir, final_dir)
    return final_dir


def verify(ckpt: Path) -> None:
    """Raise CheckpointError (one line) when ``ckpt`` is incomplete or corrupted."""
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{ckpt.name}: no {MANIFEST} (write was cut off)")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as err:
        raise CheckpointError(f"{ckpt.name}: unreadable {MANIFEST} ({err})") from None
    for rel, size in files.items():
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointError(f"{ckpt.name}: missing {rel}")
        if path.stat().st_size != size:
            raise CheckpointError(f"{ckpt.name}: {rel} is {path.stat().st_size} bytes, expected {size} (truncated?)")
        if rel.endswith(".safetensors"):
            try:
                with safe_open(str(path), framework="pt") as fh:
                    fh.keys()
            except Exception as err:  # safetensors raises its own error types
                raise CheckpointError(f"{ckpt.name}: {rel} does not parse as safetensors ({err})") from None


def find_resumable(output_dir: str | Path, which: str, warn=print) -> Path | None:
    """Resolve ``--resume_from_checkpoint`` ('latest' or a path) to a verified checkpoint, newest good first."""
    if which != "latest":
        path = Path(which)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {which!r} not found; pass 'latest' or an existing step_N directory")
        verify(path)
        return path
    for ckpt in reversed(list_checkpoints(output_dir)):
        try:
            verify(ckpt)
            return ckpt
        except CheckpointError as err:
            warn(f"skipping bad checkpoint: {err}; trying the previous one")
    return None


def prune(output_dir: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` sealed checkpoints; drop leftovers of interrupted writes."""
    root = checkpoint_root(output_dir)
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    if keep > 0:
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def read_trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / TRAINER_STATE).read_text())
