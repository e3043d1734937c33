"""The 2D flow-matching toy as one more task of the one loop: fresh points from 8 Gaussians every step, the
``VelocityMLP`` of ``hf_cgpu.flow.toy2d``, and at the end Euler and Heun at every network-evaluation budget.

The training side (steps, batch, lr, warmup + cosine, EMA, seed) is ``TrainSettings``, from ``presets/flow2d/toy``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..integrity import MANIFEST, atomic_output, atomic_write_json, update_manifest
from ..flow.matching import FlowMatcher
from ..flow.toy2d import VelocityMLP, format_table, mode_centres, mode_stats, sample_modes, sample_rows, save_plot
from ..settings import TrainSettings, to_dict
from ..train import Task, TaskPlan, fit
from ..train.loop import hub_pusher
from .settings import Toy2DSettings




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

    def setup(self, settings: TrainSettings, accelerator) -> TaskPlan:
        c = self.cfg
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
        """Euler and Heun at every budget from one fixed noise; the best within-fraction at <= 20 evaluations."""
        x0 = torch.randn(self.cfg.num_samples, 2, generator=torch.Generator().manual_seed(settings.seed + 1))
        self.rows, self.samples = sample_rows(model, self.centres, x0.to(device), self.cfg.budgets,
                                              self.cfg.hit_radius)
        return {"best_within_at_20_nfe_or_less": best_within(self.rows)}

    def save_pretrained(self, model, output_dir: Path) -> None:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(output_dir / "model.safetensors"))

    def fingerprint(self) -> dict[str, Any]:
        c = self.cfg
        return {"hidden": c.hidden, "depth": c.depth, "time_embed_dim": c.time_embed_dim, "num_modes": c.num_modes,
                "radius": c.radius, "mode_std": c.mode_std, "time_sampling": c.time_sampling,
                "logit_mean": c.logit_mean, "logit_std": c.logit_std}


def best_within(rows: list[dict]) -> float:
    return max(r["within"] for r in rows if r["nfe"] <= 20)


def run_flow2d(cfg: Toy2DSettings, train: TrainSettings) -> dict:
    """Train with the one loop, print the table, write all_results.json (the loop's figures and the table) and
    flow2d_samples.png; return the results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    task = Toy2DTask(cfg)
    pusher = hub_pusher(train)  # created now (a missing token fails at once), pushed after the table and plot
    try:
        start = time.perf_counter()
        fitted = fit(task, dataclasses.replace(train, push_to_hub=False))
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    print(format_table(task.rows))
    out = Path(train.output_dir)
    data = sample_modes(cfg.num_samples, task.centres, cfg.mode_std, torch.Generator().manual_seed(train.seed + 2))
    with atomic_output(out / "flow2d_samples.png") as tmp:
        save_plot(str(tmp), data, task.samples, task.rows)
    results = {
        **fitted,
        "settings": to_dict(cfg, train),
        "train_seconds": round(seconds, 2),
        "final_loss": fitted["train_loss"],
        "rows": task.rows,
        "best_within_at_20_nfe_or_less": best_within(task.rows),
    }
    atomic_write_json(out / "all_results.json", results)
    if (out / MANIFEST).is_file():
        update_manifest(out, ["all_results.json", "flow2d_samples.png"])
    if pusher is not None:
        pusher.finish(task.card_kind)
    return results


__all__ = ["FreshPoints", "Toy2DSettings", "Toy2DTask", "mode_stats", "run_flow2d"]
