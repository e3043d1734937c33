"""Validation: when to evaluate, evaluating with the EMA weights in place, and the best weights (``BestKeeper``:
kept in host memory, written to output_dir/best at each checkpoint and at the end, early stopping, restored at the
end with ``--load_best_at_end``)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import IntegrityError
from ..integrity import build_manifest, replace_dir, verify_folder, write_manifest
from .checkpoint import nonfinite_tensors
from .ema import ema_weights
from .parallel import full_model, is_sharded, load_full_state


class HostCopy:
    """A host-memory copy of the weights that change in training (trainable parameters and buffers; frozen ones,
    a LoRA base say, stay as they are), taken out of a model and put back into it for a write."""

    def __init__(self):
        self.model: torch.nn.Module | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    @staticmethod
    def changing(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        return {**params, **dict(model.named_buffers())}

    @torch.no_grad()
    def take(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s changing tensors into host buffers (pinned for a GPU model; allocated once)."""
        live = self.changing(model)
        if model is not self.model or live.keys() != self.tensors.keys():
            self.tensors = {n: torch.empty_like(t, device="cpu", pin_memory=t.is_cuda) for n, t in live.items()}
            self.model = model
        for n, t in live.items():
            self.tensors[n].copy_(t.detach(), non_blocking=True)
        if any(t.is_cuda for t in live.values()):
            torch.cuda.synchronize()

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the model's changing tensors with the held copy, one tensor at a time (call twice to restore),
        as ``EMA.swap`` does: no second model-sized buffer."""
        for n, t in self.changing(self.model).items():
            live = t.detach().to("cpu", copy=True)
            t.copy_(self.tensors[n])
            self.tensors[n].copy_(live)

    @contextmanager
    def in_place(self):
        """Inside: the model holds the copied weights (its own ones are put back on the way out)."""
        self.swap()
        try:
            yield self.model
        finally:
            self.swap()


class BestKeeper:
    """Keeps the weights with the lowest evaluation ``metric`` and counts evaluations since the last improvement
    (early stopping). Its state travels in every checkpoint, so a resumed run keeps it.

    An improvement copies the evaluated weights into host memory (``HostCopy``); ``flush`` writes them to
    ``output_dir/best`` with ``write(model, folder)`` (the task's ``save_best``), beside, sealed with a checksum
    manifest, then swapped in (``integrity.replace_dir``). The loop flushes before each checkpoint (so a checkpoint's
    keeper state and best/ agree) and at the end: a model-sized write per checkpoint, not per improvement."""

    def __init__(self, metric: str | None, folder: Path, patience: int = 0, save: bool = True,
                 write: Callable[[torch.nn.Module, Path], None] | None = None):
        self.metric, self.folder, self.patience, self.save, self.write = metric, folder, patience, save, write
        self.value: float | None = None
        self.step: int | None = None
        self.metrics: dict[str, float] = {}
        self.stale = 0
        self.held = HostCopy()
        self.unwritten: tuple[int, dict[str, float]] | None = None
        """The step and figures of the weights in ``held`` when best/ does not hold them yet."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "step": self.step, "metrics": self.metrics, "stale": self.stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.step = state.get("value"), state.get("step")
        self.metrics, self.stale = dict(state.get("metrics") or {}), int(state.get("stale") or 0)

    def observe(self, metrics: dict[str, float], step: int, model: torch.nn.Module | None) -> bool:
        """Record one evaluation; ``model`` (None: nothing to keep, as on all but the main process) holds the
        weights evaluated, copied to host memory when they are the best so far."""
        value = metrics.get(self.metric) if self.metric else None
        if value is None or not math.isfinite(value):
            return False
        if self.value is not None and value >= self.value:
            self.stale += 1
            return False
        self.value, self.step, self.metrics, self.stale = value, step, dict(metrics), 0
        if self.save and self.write is not None and model is not None:
            self.held.take(model)
            self.unwritten = (step, dict(metrics))
        return True

    def flush(self) -> None:
        """Write the kept weights to ``folder`` unless it holds them already."""
        if self.unwritten is None:
            return
        step, metrics = self.unwritten
        tmp = self.folder.with_name(f".{self.folder.name}-tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        with self.held.in_place() as model:
            self.write(model, tmp)
        (tmp / "best.json").write_text(json.dumps({"step": step, **metrics}, indent=1))
        write_manifest(tmp, build_manifest(tmp, "best", step=step))
        replace_dir(tmp, self.folder)
        self.unwritten = None

    def check_folder(self) -> str | None:
        """Why ``folder`` cannot be trusted to hold the recorded best weights (None: it can)."""
        try:
            manifest = verify_folder(self.folder)
        except IntegrityError as err:
            return str(err)
        if manifest.meta.get("step") != self.step:
            return f"{self.folder} holds the weights of step {manifest.meta.get('step')}, not of step {self.step}"
        return None

    def should_stop(self) -> bool:
        return self.patience > 0 and self.stale >= self.patience


class Validator:
    """Evaluate every ``every`` steps before the last (0 = only at the end) and once at the end, reusing an
    evaluation of the same step (an early stop or the deadline right after one)."""

    def __init__(self, task, model, accelerator, ema, settings, keeper: BestKeeper, metrics, every: int,
                 output_dir: Path, template=None):
        self.task, self.model, self.accelerator, self.ema, self.settings = task, model, accelerator, ema, settings
        self.keeper, self.metrics, self.every, self.output_dir = keeper, metrics, every, output_dir
        self.template = template
        """FSDP2: the plain copy the whole weights are gathered into for sample grids and the best weights."""
        self.last: tuple[int | None, dict[str, float]] = (None, {})

    def due(self, step: int, last_step: int) -> bool:
        """An evaluation at ``step``: every ``every`` steps before ``last_step`` (the final evaluation covers it)."""
        return bool(self.every) and step % self.every == 0 and step < last_step

    def run(self, step: int) -> dict[str, float]:
        """Evaluate the EMA weights (live ones without EMA); the keeper keeps a copy when they are the best."""
        acc, model = self.accelerator, self.model
        was_training = model.training
        model.eval()
        # eagerly: a compiled model would recompile for no_grad, eval() and the evaluation/sample batch shapes
        with ema_weights(self.ema), torch.compiler.set_stance("force_eager"):
            with torch.no_grad(), acc.autocast():
                raw = self.task.evaluate(model, self.settings, acc.device)  # every rank: the same figures
            with full_model(acc, model, self.template) as whole:  # None on all but the main process
                if whole is not None:
                    whole.eval()
                    self.task.on_evaluate(whole, step, self.output_dir)
                finite = whole is not None and not nonfinite_tensors(whole)  # best/ never holds a NaN either
                improved = self.keeper.observe(raw, step, whole if finite else None)
            acc.wait_for_everyone()
        model.train(was_training)
        metrics = {f"eval/{k}": v for k, v in raw.items()}
        self.metrics.evaluation(step, metrics, improved)
        self.last = (step, metrics)
        return metrics

    def stop_early(self, step: int) -> bool:
        if not self.keeper.should_stop():
            return False
        k = self.keeper
        self.metrics.write(f"early stopping at step {step}: {k.metric} has not improved for {k.stale} evaluations "
                           f"(best {k.value:.4g} at step {k.step})")
        return True

    def final(self, step: int) -> dict[str, float]:
        """The end-of-run figures, without the ``eval/`` prefix."""
        metrics = self.last[1] if self.last[0] == step else self.run(step)
        return {k.split("/")[-1]: v for k, v in metrics.items()}

    def restore_best(self, step: int, final: dict[str, float]) -> bool:
        """``--load_best_at_end``: put the best weights into the model when they are not the last ones."""
        k = self.keeper
        if not (self.settings.load_best_at_end and k.step is not None and k.step != step):
            return False
        problem = k.check_folder() if k.folder.is_dir() else f"{k.folder} is missing"
        if problem:
            self.metrics.write(f"warning: load_best_at_end: {problem}; the saved model is the last one (step {step})")
            return False
        acc = self.accelerator
        acc.wait_for_everyone()
        if is_sharded(acc):  # every rank loads the whole best weights into its shards
            from safetensors.torch import load_file

            if (k.folder / "adapter_model.safetensors").is_file():
                self.metrics.write("warning: load_best_at_end: adapter weights are not restored into FSDP2 shards; "
                                   f"the saved model is the last one (step {step}); the best is in {k.folder}")
                return False
            state: dict[str, torch.Tensor] = {}
            for f in sorted(k.folder.rglob("*.safetensors")):
                state.update(load_file(str(f)))
            load_full_state(acc, self.model, state)
        else:
            self.task.load_saved_weights(acc.unwrap_model(self.model), k.folder)
        self.metrics.write(f"load_best_at_end: the saved model is the one of step {k.step} ({k.metric} {k.value:.4g}; "
                           f"last step {step}: {final.get(k.metric, float('nan')):.4g})")
        return True
