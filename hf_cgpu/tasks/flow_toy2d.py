"""The 2D flow-matching toy as one more task of the one loop: fresh points from 8 Gaussians every step, the
``VelocityMLP`` of ``hf_cgpu.flow.toy2d``, and at the end every registered sampler at every network-evaluation budget:
a table (printed and in all_results.json) and a scatter plot (``flow2d_samples.png``).

The training side (steps, batch, lr, warmup + cosine, EMA, seed) is ``TrainSettings``, from ``presets/flow2d/toy``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import MissingPathError, SettingsError
from ..flow.guide import copy_with_weights
from ..flow.matching import FlowMatcher
from ..flow.toy2d import VelocityMLP, format_table, mode_centres, sample_modes, sample_rows, save_plot
from ..settings import TrainSettings
from ..train import Task, TaskPlan
from ..train.checkpoint import checkpoint_root, step_of
from .settings import Toy2DSettings

PLOT = "flow2d_samples.png"


class FreshPoints:
    """Every step draws new points (an endless stream): the indices only say how many."""

    def indices(self, step: int, batch: int) -> torch.Tensor:
        return torch.arange(batch)

    def epoch_of(self, step: int, batch: int) -> float:
        return 0.0


class Toy2DTask(Task):
    unit = "point"

    def __init__(self, cfg: Toy2DSettings):
        self.cfg = cfg
        self.centres = mode_centres(cfg.num_modes, cfg.radius)
        self.matcher = FlowMatcher(cfg.time_sampling, cfg.logit_mean, cfg.logit_std)
        self.rows: list[dict] = []
        self.samples: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def running(self):
        """``cfg.threads`` torch threads for the run, the caller's given back after it."""
        threads = torch.get_num_threads()
        torch.set_num_threads(self.cfg.threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def setup(self, settings: TrainSettings, accelerator) -> TaskPlan:
        c = self.cfg
        self.seed = settings.seed
        if c.guidance_model:
            check_own_checkpoint(Path(c.guidance_model), settings)
        return TaskPlan(VelocityMLP(c.hidden, c.depth, c.time_embed_dim), eval_steps=0)

    def sample_order(self, seed: int) -> FreshPoints:
        return FreshPoints()

    def train_batch(self, indices, device, generator) -> dict:
        return {"x1": sample_modes(len(indices), self.centres, self.cfg.mode_std, generator).to(device)}

    def loss(self, model, batch, generator) -> torch.Tensor:
        return self.matcher.loss(model, batch["x1"], generator=generator)

    def units(self, batch) -> int:
        return batch["x1"].shape[0]

    def evaluate(self, model, settings, device) -> dict[str, float]:
        """Every sampler at every budget from one fixed noise; the best within-fraction at <= 20 evaluations."""
        x0 = torch.randn(self.cfg.num_samples, 2, generator=torch.Generator().manual_seed(settings.seed + 1))
        guide = None
        if self.cfg.guidance_model:  # an early checkpoint of this run exists only once the run has passed it
            guide = (copy_with_weights(model, self.cfg.guidance_model), self.cfg.guidance_scale)
        self.rows, self.samples = sample_rows(model, self.centres, x0.to(device), self.cfg.budgets,
                                              self.cfg.hit_radius, guide)
        return {"best_within_at_20_nfe_or_less": best_within(self.rows)}

    def save_pretrained(self, model, output_dir: Path) -> None:
        """The MLP's weights and the scatter plot of the last evaluation's samples beside the data."""
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(output_dir / "model.safetensors"))
        data = sample_modes(self.cfg.num_samples, self.centres, self.cfg.mode_std,
                            torch.Generator().manual_seed(self.seed + 2))
        save_plot(str(output_dir / PLOT), data, self.samples, self.rows)

    def on_saved(self, model, output_dir: Path, log=print) -> dict[str, Any]:
        """The table, printed and kept in all_results.json."""
        log(format_table(self.rows))
        best = best_within(self.rows)
        log(f"best within {self.cfg.hit_radius} at <= 20 network evaluations: {best:.1%}; plot: {output_dir / PLOT}")
        return {"rows": self.rows, "best_within_at_20_nfe_or_less": best}


def check_own_checkpoint(guide: Path, settings: TrainSettings) -> None:
    """Before training: ``guide`` exists, or is a checkpoint this run writes and still keeps at its end (pruning keeps
    the newest ``checkpoints_total_limit``); otherwise a one-line error naming the fix."""
    ours = checkpoint_root(settings.output_dir).resolve()
    if guide.exists() or ours not in guide.resolve().parents:
        if not guide.exists():
            raise MissingPathError(f"--guidance_model {guide} does not exist and is no checkpoint this run will write "
                                   f"(under {ours}); pass a checkpoint folder")
        return
    every, last = settings.checkpointing_steps, settings.max_steps
    written = sorted({*range(every, last + 1, every), last} if every else {last})
    kept = written[-settings.checkpoints_total_limit:]
    if step_of(guide) not in kept:
        raise SettingsError(f"--guidance_model {guide}: this run keeps only the checkpoints of steps {kept} at its "
                            f"end; pass one of them, or --checkpoints_total_limit {len(written)}")


def best_within(rows: list[dict]) -> float:
    return max(r["within"] for r in rows if r["nfe"] <= 20)


__all__ = ["FreshPoints", "Toy2DTask", "best_within"]
