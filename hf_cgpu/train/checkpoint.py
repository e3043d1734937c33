"""Checkpointing: atomic, verifiable checkpoints around ``Accelerator.save_state``, and the loop's state in them.

A checkpoint is written into ``checkpoints/.tmp-step_N``, sealed with a ``manifest.json`` listing every file and its
size, then renamed to ``checkpoints/step_N`` (a rename is atomic on one filesystem). A power cut leaves at worst a
``.tmp-*`` directory, which is ignored. At resume each candidate is verified (manifest present, sizes match,
safetensors headers parse); a bad one is reported in one line and the previous good one is used.

``Checkpointer`` is the loop's component: it saves (accelerate state + EMA weights + ``TrainState`` + the best-weights
bookkeeping), seals, prunes, and resumes a run only into the model and data it was written for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from ..errors import CheckpointError

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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


# ---------------------------------------------------------------------------------------------------- the component


@dataclass
class TrainState:
    """What the loop carries from step to step besides weights and optimizer (saved as trainer_state.json)."""

    step: int = 0
    """Optimizer steps done (skipped non-finite steps count: their data is consumed)."""
    micro_batch_size: int = 1
    """Current micro-batch (an OOM retry halves it)."""
    gradient_accumulation_steps: int = 1
    """Current accumulation (an OOM retry doubles it: the effective batch stays)."""
    skipped_steps: int = 0
    """Steps whose loss or gradient norm came out non-finite."""
    units_seen: int = 0
    """Throughput units (tokens, images) trained on, all processes."""
    fingerprint: dict[str, Any] = field(default_factory=dict)
    """What must match for a checkpoint to be resumable (``Task.fingerprint``)."""

    @classmethod
    def start(cls, settings: Any, fingerprint: dict[str, Any]) -> TrainState:
        return cls(micro_batch_size=settings.micro_batch_size,
                   gradient_accumulation_steps=settings.gradient_accumulation_steps, fingerprint=fingerprint)

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainState:
        saved = dict(saved)
        if "accumulation" in saved:  # checkpoints written before the settings' name was used
            saved["gradient_accumulation_steps"] = saved.pop("accumulation")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in names})


class Checkpointer:
    """Save every ``every`` steps (0 = only at the end), keep the newest ``keep``, resume exactly."""

    def __init__(self, accelerator, output_dir: Path, every: int, keep: int, ema=None, keeper=None, log=print):
        self.accelerator, self.output_dir, self.every, self.keep = accelerator, Path(output_dir), every, keep
        self.ema, self.keeper, self.log = ema, keeper, log
        self.last_saved = 0

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, state: TrainState) -> Path:
        """Write ``checkpoints/step_N`` atomically: accelerate state, EMA weights, trainer state, then seal."""
        acc = self.accelerator
        root = checkpoint_root(self.output_dir)
        final, tmp = root / f"step_{step:07d}", root / f".tmp-step_{step:07d}"
        acc.wait_for_everyone()
        if acc.is_main_process:
            tmp.mkdir(parents=True, exist_ok=True)
        acc.save_state(str(tmp))
        if acc.is_main_process:
            if self.ema is not None:
                self.ema.save(tmp / "ema.safetensors")
            trainer_state = {**dataclasses.asdict(state), "step": step,
                             "best": self.keeper.state_dict() if self.keeper is not None else {}}
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
            seal(tmp, final)
            prune(self.output_dir, self.keep)
        self.last_saved = step
        return final

    def save_if_new(self, state: TrainState) -> None:
        if state.step > self.last_saved:
            self.save(state.step, state)

    def resume(self, which: str, fresh: TrainState) -> TrainState:
        """The state to start from: ``fresh``, or the checkpoint ``which`` names ('latest' or a path)."""
        self.last_saved = fresh.step
        if not which:
            return fresh
        found = find_resumable(self.output_dir, which, warn=self.log)
        if found is None:
            self.log(f"no checkpoint in {checkpoint_root(self.output_dir)}; starting from step 0")
            return fresh
        saved = read_trainer_state(found)
        theirs, ours = saved.get("fingerprint", {}), fresh.fingerprint
        if theirs != ours:
            diff = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
            raise CheckpointError(f"{found} was written for a different model/data ({diff} as checkpoint vs now); "
                                  "resume with the settings it was made with, or use a fresh --output_dir")
        self.accelerator.load_state(str(found))
        if self.ema is not None:
            self.ema.load(found / "ema.safetensors")
        if self.keeper is not None:
            self.keeper.load_state_dict(saved.get("best") or {})
        state = TrainState.from_dict({**dataclasses.asdict(fresh), **saved})
        self.last_saved = state.step
        self.log(f"resumed from {found} at step {state.step}")
        return state
