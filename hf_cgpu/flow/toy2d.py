"""2D flow-matching toy on CPU: 8 Gaussians on a circle, learned in seconds, sampled with every registered sampler.

The data, the velocity MLP and the evaluation; the one loop trains it as ``hf_cgpu.tasks.flow_toy2d.Toy2DTask``
(``hf-cgpu flow2d``). Same loss and the same scheduler classes as the image model, so it tests the whole idea cheaply.
Quality measure (the seed chapter's): fraction of 2000 samples within 0.3 of a mode centre, and how many samples land
nearest to each mode (250 each is perfect coverage, no mode collapse). What the preset's choices buy (a sinusoidal
embedding of t, the learning rate, the network's width) is measured in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .matching import guided_velocity
from .samplers import SAMPLERS, sampler_class, steps_within
from .scheduling_flow_match import sample_ode
from .unet import sinusoidal_embedding


# ----------------------------------------------------------------------------- data and model
def mode_centres(num_modes: int, radius: float) -> torch.Tensor:
    """(K, 2) centres evenly spaced on the circle."""
    angles = torch.arange(num_modes, dtype=torch.float32) * (2 * math.pi / num_modes)
    return radius * torch.stack([angles.cos(), angles.sin()], dim=1)


def sample_modes(n: int, centres: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """(n, 2) points from the equal-weight Gaussian mixture."""
    idx = torch.randint(0, centres.shape[0], (n,), generator=generator)
    return centres[idx] + std * torch.randn(n, 2, generator=generator)


class VelocityMLP(nn.Module):
    """v(x, t) for 2D points: [x, features(t)] -> SiLU MLP -> 2.

    ``step_size_embedding``: also features of the step size d (a shortcut student, ``hf_cgpu.flow.shortcut``), fed
    through first-layer columns that start at zero, so ``load_state_dict(teacher, strict=False)`` gives the teacher.
    """

    def __init__(self, hidden: int, depth: int, time_embed_dim: int, step_size_embedding: bool = False) -> None:
        super().__init__()
        self.time_embed_dim = time_embed_dim
        width_in = 2 + (time_embed_dim if time_embed_dim > 0 else 1)
        layers: list[nn.Module] = [nn.Linear(width_in, hidden), nn.SiLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.SiLU()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, 2))
        self.step_in = None
        if step_size_embedding:
            self.step_in = nn.Linear(width_in - 2, hidden, bias=False)
            nn.init.zeros_(self.step_in.weight)

    def time_features(self, t: torch.Tensor) -> torch.Tensor:
        """(N,) -> (N, F): the UNet's sinusoids of 1000 t, periods from ~2*pi/1000 to ~2*pi in t; or raw t."""
        if self.time_embed_dim == 0:
            return t[:, None]
        return sinusoidal_embedding(1000.0 * t, self.time_embed_dim, max_period=1000.0)

    def forward(self, x: torch.Tensor, t: torch.Tensor, step_size: torch.Tensor | None = None) -> torch.Tensor:
        h = self.net[0](torch.cat([x, self.time_features(t)], dim=1))
        if self.step_in is not None and step_size is not None:
            h = h + self.step_in(self.time_features(step_size))
        return self.net[1:](h)  # (N, 2)


# ----------------------------------------------------------------------------- evaluation
def mode_stats(samples: torch.Tensor, centres: torch.Tensor, hit_radius: float) -> dict:
    """Fraction within ``hit_radius`` of some centre and counts of samples nearest to each centre."""
    nearest = torch.cdist(samples, centres).min(dim=1)  # values, indices: (N,)
    hit = (nearest.values < hit_radius).float().mean().item()
    counts = torch.bincount(nearest.indices, minlength=centres.shape[0])
    return {"within": hit, "counts": counts.tolist()}


def autoguided(model: nn.Module, weak: nn.Module, scale: float):
    """The velocity of autoguidance: v_weak + w (v - v_weak) (``guided_velocity`` with the weak model as the base)."""
    return lambda x, t: guided_velocity(weak(x, t), model(x, t), scale)


@torch.no_grad()
def sample_rows(model: nn.Module, centres: torch.Tensor, x0: torch.Tensor, budgets: tuple[int, ...],
                hit_radius: float, guide: tuple[nn.Module, float] | None = None
                ) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Every registered sampler at every budget from the same noise ``x0``; returns table rows and the samples per
    row. ``guide`` = (weak model, w): also every sampler autoguided ("+ag" rows; a call costs two evaluations)."""
    rows, samples = [], {}
    variants = [("", model, 1.0)] + ([("+ag", autoguided(model, guide[0], guide[1]), guide[1])] if guide else [])
    for suffix, velocity, scale in variants:
        for name in SAMPLERS:
            scheduler = sampler_class(name)()
            for budget in budgets:
                steps = steps_within(budget, name, guidance_scale=scale)
                x1, calls = sample_ode(velocity, scheduler, x0, steps)
                stats = mode_stats(x1, centres, hit_radius)
                nfe = calls * (2 if scale != 1 else 1)
                rows.append({"method": name + suffix, "budget": budget, "steps": steps, "nfe": nfe, **stats})
                samples[f"{name}{suffix}-{budget}"] = x1
    return rows, samples


def format_table(rows: list[dict]) -> str:
    width = max(6, *(len(r["method"]) for r in rows))
    lines = [f"{'method':<{width}} {'budget':>6} {'steps':>5} {'nfe':>4} {'within':>7}  per-mode counts (250 ideal)"]
    for r in rows:
        head = f"{r['method']:<{width}} {r['budget']:>6} {r['steps']:>5} {r['nfe']:>4}"
        lines.append(f"{head} {r['within']:>7.1%}  {r['counts']}")
    return "\n".join(lines)


def save_plot(path: str, data: torch.Tensor, samples: dict[str, torch.Tensor], rows: list[dict]) -> None:
    """Scatter of data vs samples: one row per method, one column per budget (plus data in the first)."""
    budgets = sorted({r["budget"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    nfe = {(r["method"], r["budget"]): r["nfe"] for r in rows}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # plotting only where a plot is drawn

    fig, axes = plt.subplots(len(methods), len(budgets) + 1, figsize=(2.6 * (len(budgets) + 1), 2.7 * len(methods)),
                             squeeze=False)
    for row, method in enumerate(methods):
        axes[row, 0].scatter(data[:, 0], data[:, 1], s=1, c="k")
        axes[row, 0].set_title("data")
        for col, budget in enumerate(budgets, start=1):
            x = samples[f"{method}-{budget}"]
            axes[row, col].scatter(x[:, 0], x[:, 1], s=1)
            axes[row, col].set_title(f"{method}, {nfe[method, budget]} NFE")
    for ax in axes.flat:
        ax.set(xlim=(-3, 3), ylim=(-3, 3), xticks=[], yticks=[], aspect="equal")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
