"""What a model family supplies to the loop: a ``Task`` turns a batch into a loss; ``setup`` returns a ``TaskPlan``.

A task declares what it needs as values (the plan, the class attributes) and never edits the settings.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .artifacts import load_saved_weights
from .schedule import SampleOrder

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..budget.shape import RunShape
    from ..settings import TrainSettings


@dataclass(frozen=True)
class TaskPlan:
    """What a task's ``setup`` hands the loop."""

    model: torch.nn.Module
    """The model to train, before memory tiers, compile and accelerate."""
    eval_steps: int | None = None
    """Evaluate every this many optimizer steps; None = the settings' ``eval_steps``."""
    expected_initial_loss: float | None = None
    """ln(vocab) for a causal LM from scratch: a first loss far below it means the targets leak into the inputs."""
    flops_per_unit: float = 0.0
    """Training FLOPs per throughput unit for MFU; 0 = from ``shape`` (language models) or unknown."""
    shape: RunShape | None = None
    """The run shape for the ledger (``--autofit``, OOM advice, MFU); None = not a language model."""
    settings: TrainSettings | None = None
    """New TrainSettings the task chose from its data (a GPT's ``--auto``), which the run trains with and records;
    None = the ones given."""
    companions: tuple = ()
    """Further modules and optimizers trained beside the model, already on the device, never saved with it: a module
    with its optimizer here is stepped by the task itself inside ``loss`` (a discriminator); a module whose
    parameters no optimizer here holds is trained by the run's optimizer with the model, clipped with it and on its
    schedule (a GPT's multi-token heads: ``joint_modules``). Accelerate prepares them after the model, so every
    checkpoint holds their weights and moments (``model_1.safetensors``, ``optimizer_1.bin``) and a resume restores
    them exactly. One process only."""

    @property
    def joint_modules(self) -> list[torch.nn.Module]:
        """The companion modules the run's optimizer trains with the model (none of their parameters in a companion
        optimizer)."""
        own = {id(p) for o in self.companions if isinstance(o, torch.optim.Optimizer)
               for group in o.param_groups for p in group["params"]}
        return [m for m in self.companions if isinstance(m, torch.nn.Module)
                and not any(id(p) in own for p in m.parameters())]


class Task:
    """Subclasses fill in every method that raises."""

    unit: ClassVar[str] = "sample"
    """What throughput counts: "tok", "img"."""
    card: ClassVar[str | None] = None
    """The kind of model card rendered for the saved model (``hf_cgpu.hub.cards.CARDS``: gpt, flow, lora); None:
    none."""
    best_metric: ClassVar[str | None] = None
    """Evaluation figure (lower is better) that picks the best weights, e.g. val_loss."""
    cfg: Any = None
    """The task's settings dataclass, recorded in all_results.json."""
    ledger_task: ClassVar[str | None] = None
    """The image ledger's name of this task (``budget.images``: flow, flow-distill, classifier), which prices a run
    whose plan declares no language-model ``shape``; None: the shape's ledger, or none."""

    @property
    def train_mode(self) -> str:
        """pretrain or finetune, as the task's settings class declares it (the adapter tiers need a trained base)."""
        return getattr(self.cfg, "train_mode", "pretrain")

    def setup(self, settings: TrainSettings, accelerator: Accelerator) -> TaskPlan:
        """Build the model and the data. Runs before any tier, compile or prepare."""
        raise NotImplementedError

    def num_train_samples(self) -> int:
        raise NotImplementedError

    def sample_order(self, seed: int) -> SampleOrder:
        """What ``train_batch`` receives at each step: ``indices(step, batch)`` and ``epoch_of(step, batch)``, a
        function of ``(seed, step)`` only (exact resume). Default: sample indices, a new permutation each epoch."""
        return SampleOrder(self.num_train_samples(), seed)

    def train_batch(self, indices: torch.Tensor, device: torch.device, generator: torch.Generator) -> dict:
        """The micro-batch made of training samples ``indices`` (1-D LongTensor from ``sample_order``), on ``device``."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """Scalar fp32 loss of ``batch`` (random draws only from ``generator``)."""
        raise NotImplementedError

    def at_step(self, step: int, last_step: int) -> None:
        """Called before optimizer step ``step``'s forward and backward with the schedule's last step (as
        ``--fit_schedule_to_time`` fixes it): a task whose loss follows the schedule reads them here. Default:
        nothing."""

    def units(self, batch: dict) -> int:
        """Throughput units in ``batch`` (tokens, images)."""
        raise NotImplementedError

    def eval_micro_batches(self, settings: TrainSettings) -> float:
        """Forward micro-batches of one evaluation, for the ledger's time of a run (0: not priced)."""
        return 0.0

    def evaluate(self, model: torch.nn.Module, settings: TrainSettings, device: torch.device) -> dict[str, float]:
        """Figures on held-out data (never the training set). Model holds EMA weights when EMA is on."""
        return {}

    def on_evaluate(self, model: torch.nn.Module, step: int, output_dir: Path) -> None:
        """Side products of an evaluation (e.g. a sample grid). Model holds EMA weights when EMA is on."""

    def save_pretrained(self, model: torch.nn.Module, output_dir: Path) -> None:
        raise NotImplementedError

    def on_saved(self, model: torch.nn.Module, output_dir: Path, log=print) -> dict[str, Any]:
        """After ``save_pretrained``, with the saved weights in ``model`` (main process): figures of those weights
        that go into all_results.json and the card (the GPT's continuations, the flow's final sample grid)."""
        return {}

    def save_best(self, model: torch.nn.Module, folder: Path) -> None:
        """Write the best-so-far weights (``output_dir/best``); default: what ``save_pretrained`` writes."""
        self.save_pretrained(model, folder)

    def load_saved_weights(self, model: torch.nn.Module, folder: Path) -> None:
        """Load weights that ``save_pretrained`` wrote to ``folder`` back into ``model`` (for the best weights)."""
        load_saved_weights(model, folder)

    def data_fingerprint(self) -> dict[str, Any]:
        """Content hashes of what the task reads (its tokenizer, training and validation data), by name: a resume must
        read the same (``train.fingerprint``; the model's config and the fixed settings are compared without the
        task's help)."""
        return {}

    def running(self) -> contextlib.AbstractContextManager:
        """Entered around the whole run (setup to the saved model): process state the task needs and gives back."""
        return contextlib.nullcontext()
