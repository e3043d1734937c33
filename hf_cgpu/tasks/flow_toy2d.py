"""The 2D flow-matching toy as one more task of the one loop: fresh points from 8 Gaussians every step, the
``VelocityMLP`` of ``hf_cgpu.flow.toy2d``, and at the end Euler and Heun at every network-evaluation budget.

The training side (steps, batch, lr, warmup + cosine, EMA, seed) is ``TrainSettings``, from ``presets/flow2d/toy``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import SettingsError
from ..integrity import MANIFEST, atomic_output, atomic_write_json, update_manifest
from ..flow.matching import FlowMatcher
from ..flow.toy2d import VelocityMLP, format_table, mode_centres, mode_stats, sample_modes, sample_rows, save_plot
from ..settings import TrainSettings, to_dict
from ..train import Task, TaskPlan, fit


@dataclass(frozen=True)
class Toy2DSettings:
    """Data, network and evaluation of the toy; with the preset, >= 90% within 0.3 at <= 20 evaluations in < 60 s."""

    num_modes: int = 8
    """Gaussians on the circle."""
    radius: float = 2.0
    """Circle radius."""
    mode_std: float = 0.08
    """Standard deviation of each Gaussian."""
    hidden: int = 64
    """MLP width."""
    depth: int = 3
    """Hidden layers of the MLP."""
    time_embed_dim: int = 32
    """Sinusoidal features of t fed to the MLP; 0 feeds raw t like the seed."""
    time_sampling: str = "uniform"
    """'uniform' or 'logit_normal' (see FlowMatcher)."""
    logit_mean: float = 0.0
    """Logit-normal mean (> 0 trains more near the data end)."""
    logit_std: float = 1.0
    """Logit-normal spread."""
    num_samples: int = 2000
    """Samples drawn for each evaluation row."""
    nfe_budgets: str = "2,5,10,20,100"
    """Comma-separated network-evaluation budgets; Heun takes N = (budget + 1) // 2 steps, 2N - 1 <= budget calls."""
    hit_radius: float = 0.3
    """A sample counts as on a mode when this close to its centre."""
    threads: int = 1
    """torch CPU threads. 1 on purpose: for matrices this small a second OpenMP thread gains little on an idle
    machine and, on a shared one, spin-waiting makes a step 10x slower (measured 22 ms vs 359 ms)."""

    def __post_init__(self) -> None:
        FlowMatcher(self.time_sampling, self.logit_mean, self.logit_std)  # validates the time settings
        self.budgets  # noqa: B018 - validates nfe_budgets

    @property
    def budgets(self) -> tuple[int, ...]:
        """``nfe_budgets`` as ints."""
        try:
            budgets = tuple(int(b) for b in self.nfe_budgets.split(","))
        except ValueError:
            raise SettingsError(f"nfe_budgets={self.nfe_budgets!r}; write comma-separated integers like 2,5,10") from None
        if min(budgets) < 1:
            raise SettingsError(f"nfe_budgets={self.nfe_budgets!r}; every budget must be >= 1")
        return budgets


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
    try:
        start = time.perf_counter()
        fitted = fit(task, train)
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
    return results


__all__ = ["FreshPoints", "Toy2DSettings", "Toy2DTask", "mode_stats", "run_flow2d"]
