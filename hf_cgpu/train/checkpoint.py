"""Checkpointing: atomic, checksummed checkpoints around ``Accelerator.save_state``, and the loop's state in them.

A checkpoint is written into ``checkpoints/.tmp-step_N`` (accelerate's state, the EMA weights, ``trainer_state.json``
and ``history.json``: the logged metrics, so a resumed run's history and curves cover the whole run), then sealed: a
``manifest.json`` lists every file with its size and SHA-256 (``hf_cgpu.integrity``), every file is fsynced, and the
folder is renamed to ``checkpoints/step_N`` (a rename is atomic on one filesystem). Sealing runs in a background
thread (hashlib releases the GIL), so training goes on while a checkpoint is hashed;
the next save, and the end of the run, wait for it. A kill leaves at worst a ``.tmp-*`` folder, which is ignored.

Only finite states are sealed: weights, optimizer moments and EMA are checked before anything is written, so a
diverged run never overwrites "the last good state" with NaNs and pruning never removes the newest finite one.

At resume every file of the candidate is re-hashed against its manifest. ``latest`` falls back to the previous good
checkpoint, naming what failed; the newer, failed ones are set aside as ``.bad-step_N`` so that pruning (which keeps
the highest step numbers) can never delete the checkpoints of the resumed run in their favour. Resuming from an
explicit older checkpoint sets the newer ones aside as ``.superseded-step_N`` for the same reason.

An adapter run (LoRA, QLoRA) checkpoints only its trainable tensors: the frozen base is rebuilt from ``--model`` at
resume, so it is not written again at every save (a checkpoint holds the adapter and its optimizer state, not the
base). ``trainer_state.json`` then records a digest of the
frozen tensors, and a resume onto a base whose weights differ (another fine-tune with the same config) is refused
instead of silently training on it.

``Checkpointer`` is the loop's component: it saves, seals, prunes, and resumes a run only into the model, tokenizer,
data and settings it was written for (``TrainState.fingerprint``, ``fingerprint.run_fingerprint``), with the same
effective batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import CheckpointError, IntegrityError, UserError
from ..integrity import MANIFEST, as_disk_error, build_manifest, fsync_dir, fsync_file, verify_folder, write_manifest
from .fingerprint import difference, with_new_settings
from .parallel import gather_list, is_sharded, local
from .schedule import lr_at, weight_decay_factor

TRAINER_STATE = "trainer_state.json"
HISTORY = "history.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Sealed checkpoint directories, oldest first (temporaries and set-aside ones are not listed)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def step_of(ckpt: Path) -> int:
    m = _STEP_DIR.match(Path(ckpt).name)
    return int(m.group(1)) if m else -1


def seal(tmp_dir: Path, final_dir: Path, step: int | None = None) -> Path:
    """Hash every file into the manifest, fsync, and rename ``tmp_dir`` to ``final_dir``."""
    manifest = build_manifest(tmp_dir, "checkpoint", step=step)
    for rel in manifest.files:
        fsync_file(tmp_dir / rel)
    write_manifest(tmp_dir, manifest)
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    return final_dir


def verify(ckpt: Path) -> None:
    """Raise IntegrityError (one line) when ``ckpt`` is incomplete or any file differs from its manifest."""
    ckpt = Path(ckpt)
    try:
        manifest = verify_folder(ckpt)
    except IntegrityError as err:
        raise IntegrityError(str(err).replace(f"{ckpt}:", f"{ckpt.name}:", 1)) from None
    if manifest.kind != "checkpoint":
        raise IntegrityError(f"{ckpt.name}: its manifest describes a {manifest.kind} folder, not a checkpoint")
    if TRAINER_STATE not in manifest.files:
        raise IntegrityError(f"{ckpt.name}: its manifest lists no {TRAINER_STATE}")
    for rel in manifest.files:
        if rel.endswith(".safetensors"):
            try:
                with safe_open(str(ckpt / rel), framework="pt") as fh:
                    fh.keys()
            except Exception as err:  # safetensors raises its own error types
                raise IntegrityError(f"{ckpt.name}: {rel} does not parse as safetensors ({err})") from None


def find_resumable(output_dir: str | Path, which: str, warn=print,
                   failed: list[tuple[Path, str]] | None = None) -> Path | None:
    """Resolve ``--resume_from_checkpoint`` ('latest' or a path) to a verified checkpoint, newest good first;
    the ones that failed are reported through ``warn`` and appended to ``failed``."""
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
            if failed is not None:
                failed.append((ckpt, str(err)))
    return None


def set_aside(ckpt: Path, why: str) -> Path:
    """Rename a checkpoint to ``.<why>-step_N``: no longer listed, resumed from or counted by pruning."""
    dest = ckpt.with_name(f".{why}-{ckpt.name}")
    n = 1
    while dest.exists():
        dest, n = ckpt.with_name(f".{why}{n}-{ckpt.name}"), n + 1
    os.replace(ckpt, dest)
    return dest


def prune(output_dir: str | Path, keep: int, protect: Path | None = None) -> None:
    """Keep the newest ``keep`` sealed checkpoints and always ``protect`` (the newest finite, verified one); drop
    leftovers of interrupted writes."""
    root = checkpoint_root(output_dir)
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    if keep > 0:
        for old in list_checkpoints(output_dir)[:-keep]:
            if protect is None or old.resolve() != Path(protect).resolve():
                doomed = old.with_name(f".tmp-delete-{old.name}")  # renamed first: a kill mid-delete leaves no
                os.replace(old, doomed)  # half-deleted checkpoint that still looks sealed
                shutil.rmtree(doomed, ignore_errors=True)


def read_trainer_state(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / TRAINER_STATE).read_text())
    except (OSError, ValueError) as err:
        raise IntegrityError(f"{ckpt.name}: unreadable {TRAINER_STATE} ({err})") from None


def nonfinite_tensors(model: torch.nn.Module | None, optimizer=None, ema=None) -> list[str]:
    """Names of the floating-point weights, optimizer moments and EMA tensors holding a NaN or an infinity."""
    named: list[tuple[str, torch.Tensor]] = []
    if model is not None:
        named += [(f"weight {n}", t) for n, t in model.state_dict().items() if torch.is_tensor(t)]
    if optimizer is not None:
        params = {id(p): f"{i}" for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        for p, st in optimizer.state.items():
            named += [(f"optimizer {k} of parameter {params.get(id(p), '?')}", t) for k, t in st.items()
                      if torch.is_tensor(t)]
    if ema is not None:
        named += [(f"EMA {n}", t) for n, t in ema.shadow.items()]

    named = [(n, local(t)) for n, t in named]  # this rank's shards under FSDP2
    named = [(n, t) for n, t in named if t.is_floating_point() and t.numel()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(t).all() for _, t in named]).cpu().tolist()
    return [n for (n, _), ok in zip(named, finite) if not ok]


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
    processes: int = 1
    """Data-parallel processes; effective batch = micro-batch x accumulation x processes."""
    skipped_steps: int = 0
    """Steps whose loss or gradient norm came out non-finite."""
    units_seen: int = 0
    """Throughput units (tokens, images) trained on, all processes."""
    fingerprint: dict[str, Any] = field(default_factory=dict)
    """What must match for a checkpoint to be resumable (``fingerprint.run_fingerprint``)."""
    requested: dict[str, int] = field(default_factory=dict)
    """The micro-batch, accumulation and processes the settings asked for (before any OOM retry)."""
    batch_changes: list[dict[str, Any]] = field(default_factory=list)
    """Every change of micro-batch/accumulation/processes with its step and reason (OOM retry, resume)."""
    schedule_steps: int = 0
    """The schedule's length once ``--fit_schedule_to_time`` fixed it (0: ``max_steps``); a resumed run keeps it."""
    schedule_warmup: int = 0
    """The warmup the fitted length could hold, where it cut ``warmup_steps`` short (0: ``warmup_steps``)."""
    cpu_threads: int = 0
    """A CPU run's intra-op threads (0: not recorded): a matmul's sums, so its bits, depend on them."""

    @classmethod
    def start(cls, settings: Any, fingerprint: dict[str, Any], processes: int = 1) -> TrainState:
        m, a = settings.micro_batch_size, settings.gradient_accumulation_steps
        return cls(micro_batch_size=m, gradient_accumulation_steps=a, processes=processes, fingerprint=fingerprint,
                   requested={"micro_batch_size": m, "gradient_accumulation_steps": a, "processes": processes})

    def last_step(self, settings: Any) -> int:
        """Where the run ends: the length ``--fit_schedule_to_time`` fixed, else ``max_steps``."""
        return self.schedule_steps or settings.max_steps

    def use_cpu_threads(self, device: torch.device) -> str | None:
        """A CPU run records its thread count; a resumed one takes it back, since ``accelerate launch --cpu``,
        ``--cpu`` and a plain start may each pick another and the run would no longer be bit-identical. Returns the
        line saying so when it changed the count."""
        if device.type != "cpu":
            return None
        now = torch.get_num_threads()
        if not self.cpu_threads:
            self.cpu_threads = now
        if self.cpu_threads == now:
            return None
        torch.set_num_threads(self.cpu_threads)
        return (f"CPU threads: {self.cpu_threads}, as before the resume (this process started with {now}), so the "
                "resumed run repeats the uninterrupted one bit for bit")

    def lr(self, step: int, settings: Any) -> float:
        """The learning rate of ``step`` on this run's schedule (its fitted length and warmup, if fixed)."""
        return lr_at(step, settings, self.last_step(settings), self.schedule_warmup or None)

    def weight_decay_factor(self, step: int, settings: Any) -> float:
        """The multiple of the weight decay at ``step`` on this run's schedule (``--weight_decay_end``)."""
        return weight_decay_factor(step, settings, self.last_step(settings))

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps

    def record_batch(self, step: int, reason: str) -> None:
        self.batch_changes.append({"step": step, "micro_batch_size": self.micro_batch_size,
                                   "gradient_accumulation_steps": self.gradient_accumulation_steps,
                                   "processes": self.processes, "reason": reason})

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainState:
        saved = dict(saved)
        if "accumulation" in saved:  # checkpoints written before the settings' name was used
            saved["gradient_accumulation_steps"] = saved.pop("accumulation")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in names})


class _Sealer:
    """Runs one seal at a time in a background thread; its error is raised by the next ``wait``."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, fn: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                fn()
            except BaseException as err:  # raised in the training thread by wait()
                self.error = err

        self.thread = threading.Thread(target=run, name="hf_cgpu-seal", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err


def _share(accelerator, fn: Callable[[], Any]) -> Any:
    """``fn()`` on the main process, its result (or its user error) on every process."""
    if accelerator.num_processes == 1:
        return fn()
    from accelerate.utils import broadcast_object_list

    box: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            box[0] = ("ok", fn())
        except UserError as err:
            box[0] = ("error", err)
    broadcast_object_list(box)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


TRAINABLE_ONLY = "trainable"
"""``trainer_state.json``'s ``model_weights`` for a checkpoint holding only the trainable tensors."""


def trainable_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def frozen_digest(model: torch.nn.Module, chunk: int = 1 << 24) -> str:
    """SHA-256 over every frozen state-dict tensor's name, dtype, shape and two exact integer sums of its bytes (plain
    and position-weighted), computed where the tensor lives in chunks of ``chunk`` bytes: the base an adapter was
    trained on, told apart from another one of the same shape without copying it to the host."""
    import hashlib

    trainable, h = trainable_names(model), hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if name in trainable or not isinstance(t, torch.Tensor):
            continue
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        sums = torch.zeros(2, dtype=torch.int64, device=flat.device)  # summed where the tensor lives, read once
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk].to(torch.int64)
            where = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) % 65521 + 1
            sums += torch.stack([part.sum(), (part * where).sum()])
        plain, weighted = sums.tolist()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{plain}|{weighted};".encode())
    return h.hexdigest()


class Checkpointer:
    """Save every ``every`` steps (0 = only at the end), keep the newest ``keep``, resume exactly."""

    def __init__(self, accelerator, output_dir: Path, every: int, keep: int, ema=None, keeper=None, log=print,
                 model=None, optimizer=None, metrics=None):
        self.accelerator, self.output_dir, self.every, self.keep = accelerator, Path(output_dir), every, keep
        self.ema, self.keeper, self.log = ema, keeper, log
        self.model, self.optimizer, self.metrics = model, optimizer, metrics
        self.last_saved = 0
        self.good: Path | None = None
        """The newest checkpoint known finite and whole (resumed from, or sealed by this run)."""
        self.on_sealed: Callable[[Path, int], None] | None = None
        """Called (in the sealing thread) with each checkpoint once it is sealed in place: the Hub upload."""
        self._sealer = _Sealer()
        self.trainable_only = model is not None and _is_adapter(accelerator, model)
        # the frozen base's digest, taken now, before any forward: bitsandbytes repacks 4-bit weights for the CPU at
        # the first one
        self.frozen = frozen_digest(model) if self.trainable_only else None
        if self.trainable_only:
            accelerator.register_save_state_pre_hook(_keep_trainable)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def _intact(self) -> str:
        good = self.good or next(iter(reversed(list_checkpoints(self.output_dir))), None)
        return f"checkpoint {good.name} is intact" if good is not None else "no earlier checkpoint exists"

    def save(self, step: int, state: TrainState, prune_old: bool = True) -> Path | None:
        """Write the best weights held in memory to best/ (``BestKeeper.flush``), then ``checkpoints/step_N``
        atomically (accelerate state, EMA, trainer state, history) and seal it in the background. Returns None,
        writing no checkpoint, when the state is not finite. ``prune_old`` False (a stop
        on non-finite losses) keeps every earlier checkpoint: the ones from before a divergence may be the good
        ones."""
        acc = self.accelerator
        self._sealer.wait()
        if self.keeper is not None:  # best/ then holds the weights the keeper state below names
            self.keeper.flush()

        bad = gather_list(acc, nonfinite_tensors(self.model, self.optimizer, self.ema))  # every rank's shards
        if bad:
            self.log(f"step {step}: not checkpointed, {len(bad)} tensors are not finite (first: {bad[0]}); "
                     f"{self._intact()}")
            return None
        root = checkpoint_root(self.output_dir)
        final, tmp = root / f"step_{step:07d}", root / f".tmp-step_{step:07d}"
        acc.wait_for_everyone()
        try:
            if acc.is_main_process:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            acc.wait_for_everyone()
            acc.save_state(str(tmp))
            if self.ema is not None:  # every rank: FSDP2 shards are gathered
                self.ema.save(tmp / "ema.safetensors" if acc.is_main_process else None)
            if acc.is_main_process:
                trainer_state = {**dataclasses.asdict(state), "step": step,
                                 "best": self.keeper.state_dict() if self.keeper is not None else {}}
                if self.trainable_only:
                    trainer_state.update(model_weights=TRAINABLE_ONLY, frozen_digest=self.frozen)
                (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
                if self.metrics is not None:
                    (tmp / HISTORY).write_text(json.dumps(self.metrics.state_dict()))
        except Exception as err:  # safetensors and torch report a full disk in their own exception types
            disk = as_disk_error(err)
            if disk is None:
                raise
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"writing checkpoint {final.name} failed ({disk.strerror or disk}); "
                                  f"{self._intact()}: free space (or fix the disk) and resume with "
                                  "--resume_from_checkpoint latest") from err
        acc.wait_for_everyone()
        if acc.is_main_process:
            self._sealer.start(lambda: self._seal(tmp, final, step, prune_old))
        self.last_saved = step
        return final

    def _seal(self, tmp: Path, final: Path, step: int, prune_old: bool = True) -> None:
        try:
            seal(tmp, final, step)
        except OSError as err:
            if as_disk_error(err) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"sealing checkpoint {final.name} failed ({err.strerror or err}); "
                                  f"{self._intact()}: free space (or fix the disk) and resume with "
                                  "--resume_from_checkpoint latest") from err
        self.good = final
        prune(self.output_dir, self.keep if prune_old else 0, protect=final)
        if self.on_sealed is not None:
            self.on_sealed(final, step)

    def save_if_new(self, state: TrainState) -> None:
        if state.step > self.last_saved:
            self.save(state.step, state)

    def wait(self) -> None:
        """Block until the checkpoint being sealed is on disk (raises what sealing raised)."""
        self._sealer.wait()

    def close(self, raise_errors: bool = True) -> None:
        try:
            self._sealer.wait()
        except Exception as err:
            if raise_errors:
                raise
            self.log(f"warning: {err}")

    # ---- resume
    def _choose(self, which: str) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The checkpoint to resume from (verified), and the newer ones set aside; main process only."""
        failed: list[tuple[Path, str]] = []
        found = find_resumable(self.output_dir, which, warn=self.log, failed=failed)
        if found is None:
            if failed:
                details = "; ".join(why for _, why in failed[:3])
                raise IntegrityError(f"no checkpoint in {checkpoint_root(self.output_dir)} verifies ({details}); "
                                     "nothing was changed: repair or delete them, or start over with "
                                     "--overwrite_output_dir true")
            return None, []
        moved = []
        for ckpt, why in failed:
            moved.append((set_aside(ckpt, "bad"), why))
        newer = [c for c in list_checkpoints(self.output_dir) if step_of(c) > step_of(found)]
        for ckpt in newer:
            moved.append((set_aside(ckpt, "superseded"), f"newer than {found.name}, which this run resumes from"))
        for dest, why in moved:
            self.log(f"set aside {dest.name} ({why}); delete it when no longer needed")
        return found, moved

    def resume(self, which: str, fresh: TrainState, settings: tuple = ()) -> TrainState:
        """The state to start from: ``fresh``, or the checkpoint ``which`` names ('latest' or a path); ``settings``:
        the run's settings objects, whose defaults stand in for settings newer than the checkpoint."""
        self.last_saved = fresh.step
        if not which:
            return fresh
        found, _ = _share(self.accelerator, lambda: self._choose(which))
        if found is None:
            self.log(f"no checkpoint in {checkpoint_root(self.output_dir)}; starting from step 0")
            return fresh
        saved = read_trainer_state(found)
        ours = fresh.fingerprint
        theirs = with_new_settings(saved.get("fingerprint", {}), ours, *settings)
        if theirs != ours:
            raise CheckpointError(f"{found} was written for a different model/data "
                                  f"({difference(theirs, ours, *settings)} as checkpoint vs now); resume with the "
                                  "settings it was made with, or use a fresh --output_dir")
        self._check_sharding(found)
        state = TrainState.from_dict({**dataclasses.asdict(fresh), **saved, "fingerprint": ours})
        self._apply_batch(state, fresh, found)
        try:
            if saved.get("model_weights") == TRAINABLE_ONLY:
                self._check_frozen(found, saved)
                self.accelerator.load_state(str(found), strict=False)  # the frozen rest is the base, checked above
            else:  # every tensor (a full run, or an adapter checkpoint written before adapters were saved alone)
                self.accelerator.load_state(str(found))
        except pickle.UnpicklingError as err:  # torch.load(weights_only=True) refused an object: nothing ran
            raise CheckpointError(f"{found.name} holds a pickled object that is not plain tensors and numbers ("
                                  f"{' '.join(str(err).split())[:160]}); it was not loaded: resume from another "
                                  "checkpoint or start a fresh --output_dir, and find out who wrote it") from None
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, KeyError, FileNotFoundError) as err:  # a tensor or moment of another shape
            raise CheckpointError(f"{found.name} does not fit this run's networks ({' '.join(str(err).split())[:200]}"
                                  "); resume with the settings it was made with, or start a fresh --output_dir"
                                  ) from None
        if self.ema is not None:
            self.ema.load(found / "ema.safetensors")
        if self.keeper is not None:
            self.keeper.load_state_dict(saved.get("best") or {})
        if self.metrics is not None and (found / HISTORY).is_file():
            self.metrics.load_state_dict(json.loads((found / HISTORY).read_text()))
        self.last_saved, self.good = state.step, found
        self.log(f"resumed from {found} at step {state.step}")
        return state

    def _check_frozen(self, found: Path, saved: dict) -> None:
        """A trainable-only checkpoint loads onto this run's model only if it holds exactly this model's trainable
        tensors and the frozen base is the one it was trained on (``strict=False`` would let anything else through)."""
        weights = found / "model.safetensors"
        if self.model is None or not weights.is_file():
            raise CheckpointError(f"{found.name} holds trainable weights only, but no model.safetensors of them is "
                                  "there to load; resume from another checkpoint or start a fresh --output_dir")
        with safe_open(str(weights), framework="pt") as f:
            stored = set(f.keys())
        wanted = trainable_names(self.model)
        if stored != wanted:
            odd = sorted(stored ^ wanted)[:3]
            raise CheckpointError(f"{found.name} holds {len(stored)} trainable tensors, this run's model has "
                                  f"{len(wanted)} (first differences: {odd}); resume with the adapter settings it "
                                  "was made with, or use a fresh --output_dir")
        if saved.get("frozen_digest") != self.frozen:
            raise CheckpointError(f"{found.name} was trained on a base model whose weights differ from this run's "
                                  "--model (same config, other weights); resume with the base it was made with, or "
                                  "use a fresh --output_dir")

    def _check_sharding(self, found: Path) -> None:
        """accelerate writes FSDP checkpoints in its own layout (``pytorch_model_fsdp*``), which only an FSDP run
        reads back; refuse the other way round in one line."""
        written_fsdp = any(found.glob("pytorch_model_fsdp*"))
        if written_fsdp != is_sharded(self.accelerator):
            was, now = ("with FSDP2", "without FSDP") if written_fsdp else ("without FSDP", "with FSDP2")
            raise CheckpointError(f"{found.name} was written by a run {was}; this one runs {now}: resume it with the "
                                  "accelerate config it was trained with (e.g. recipes/accelerate/fsdp2.yaml), or "
                                  "start a fresh --output_dir")

    def _apply_batch(self, state: TrainState, fresh: TrainState, found: Path) -> None:
        """Same effective batch: a new split of it is applied from this step and recorded; another one is refused
        (it would change which samples every later step sees)."""
        asked = fresh.requested
        before = state.requested or {"micro_batch_size": state.micro_batch_size,
                                     "gradient_accumulation_steps": state.gradient_accumulation_steps,
                                     "processes": state.processes}
        if asked == before:
            return  # as it was made (an OOM retry's smaller micro-batch stays)
        total = math.prod(before.values())
        if math.prod(asked.values()) != total:
            m, a, p = before["micro_batch_size"], before["gradient_accumulation_steps"], before["processes"]
            raise CheckpointError(
                f"{found.name} was trained with an effective batch of {total} (micro_batch_size {m} x "
                f"gradient_accumulation_steps {a} x {p} processes); this run asks for "
                f"{math.prod(asked.values())}, which would change the data of every later step. Resume with "
                f"--micro_batch_size {m} --gradient_accumulation_steps {a} (or another split with the same product), "
                "or start a fresh --output_dir")
        state.micro_batch_size = asked["micro_batch_size"]
        state.gradient_accumulation_steps = asked["gradient_accumulation_steps"]
        state.processes, state.requested = asked["processes"], dict(asked)
        state.record_batch(state.step, "changed at resume (same effective batch)")
        self.log(f"resuming at step {state.step} with micro_batch_size {state.micro_batch_size} x "
                 f"gradient_accumulation_steps {state.gradient_accumulation_steps} x {state.processes} processes "
                 f"(was {before['micro_batch_size']} x {before['gradient_accumulation_steps']} x "
                 f"{before['processes']}): the same effective batch; recorded in all_results.json")


def _is_adapter(accelerator, model) -> bool:
    """An adapter model (peft) on one process or DDP; FSDP2 writes its own sharded layout, left whole."""
    return hasattr(accelerator.unwrap_model(model), "peft_config") and not is_sharded(accelerator)


def _keep_trainable(models, weights, output_dir) -> None:
    """accelerate's save-state pre-hook: each model's state dict cut down to its trainable tensors, in place."""
    for i, model in enumerate(models[: len(weights)]):
        keep = trainable_names(model)
        weights[i] = {k: v for k, v in weights[i].items() if k in keep}


__all__ = ["Checkpointer", "MANIFEST", "TrainState", "checkpoint_root", "find_resumable", "list_checkpoints",
           "frozen_digest", "nonfinite_tensors", "prune", "read_trainer_state", "seal", "set_aside", "trainable_names",
           "verify"]
