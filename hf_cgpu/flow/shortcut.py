"""Few-step distillation of a trained flow: the shortcut-model objective (Frans et al. 2024) with a teacher.

A student s(x, t, d) predicts the average velocity over the step [t, t + d], so x + d s(x, t, d) lands where the
teacher's ODE would after integrating from t to t + d; d = 0 is the instantaneous velocity. Targets:

    d = 0:        s(xt, t, 0)  = v(xt, t)                                the guided teacher's velocity
    d = D:        s(xt, t, D)  = (s(xt, t, D/2) + s(x', t + D/2, D/2)) / 2,   x' = xt + D/2 s(xt, t, D/2)
                                  (self-consistency: one step of D is two of D/2; no gradient through the target)
    smallest D:   the same with the teacher's velocity in place of s at D/2 (two Euler steps of the teacher)

with D = 1, 1/2, ..., 2^-levels and t on D's grid (t = k D), the grid an N-step sampler with N = 1/D walks. The
exact flow map satisfies every line (``tests/test_flow_distill.py`` checks it on Gaussians, where it is affine),
so the objective's minimum is the teacher's flow, guidance and its interval included, in one or two steps.

Why this method: it starts from the teacher's weights (a zero-initialised step-size embedding, so the student is
the teacher at d = 0 on step one), needs only forward passes of the teacher and no ODE solves or reflow dataset, and
every target is a closed form on the toy, so it can be checked on the CPU.

Pure tensor math over callables, like ``matching``: ``student(x, t, d, cond)`` and ``teacher(x, t, cond)`` return
velocities (B, ...) for x (B, ...), t and d (B,) and cond the rows' class labels (B,) or None, or a tuple of such
per-row tensors (the labels and each row's guidance scale of a student trained over a range of guidance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .matching import guided_velocity, interpolate

Student = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Teacher = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def two_step_target(fn: Student, x: torch.Tensor, t: torch.Tensor, half: torch.Tensor,
                    cond: torch.Tensor | None = None) -> torch.Tensor:
    """(fn(x, t, h) + fn(x', t + h, h)) / 2 with x' = x + h fn(x, t, h): the average velocity of two steps of h."""
    h = half.reshape(-1, *([1] * (x.dim() - 1)))
    v1 = fn(x, t, half, cond)
    v2 = fn(x + h * v1, t + half, half, cond)
    return (v1 + v2) / 2


def guided_teacher(model_fn: Callable, null_class: int | None, scale: float,
                   interval: tuple[float, float] | None, guide_fn: Callable | None = None) -> Teacher:
    """teacher(x, t, labels): the classifier-free guided velocity v_u + w (v_c - v_u) of ``model_fn(x, t, labels)``
    for rows whose t lies in ``interval`` (None: all), the conditional velocity elsewhere; as the pipeline samples.
    With ``guide_fn`` (a weaker model, autoguidance) v_u is ``guide_fn(x, t, labels)``, the same labels or none.
    ``teacher(x, t, labels, scales)`` guides each row at its own w, ``scales`` (B,), in place of ``scale``."""
    lo, hi = interval if interval is not None else (0.0, 1.0)

    def teacher(x, t, labels, scales: torch.Tensor | None = None):
        if (scales is None and scale == 1.0) or (labels is None and guide_fn is None):
            return model_fn(x, t, labels)
        if guide_fn is not None:
            v_c, v_u = model_fn(x, t, labels), guide_fn(x, t, labels)
        else:
            v_c, v_u = model_fn(torch.cat([x, x]), torch.cat([t, t]),
                                torch.cat([labels, torch.full_like(labels, null_class)])).chunk(2)
        inside = (t >= lo - 1e-6) & (t <= hi + 1e-6)
        w = torch.where(inside, scale if scales is None else scales.to(t.dtype), 1.0)
        return guided_velocity(v_u, v_c, w.reshape(-1, *([1] * (x.dim() - 1))))

    return teacher


def _rows(cond, rows):
    """The ``rows`` (a mask or a slice) of per-row conditioning: a tensor, a tuple of them (or None), or None."""
    if isinstance(cond, tuple):
        return tuple(_rows(c, rows) for c in cond)
    return None if cond is None else cond[rows]


@dataclass(frozen=True)
class ShortcutObjective:
    """Draws the (xt, t, d) rows of a batch and their targets; holds no network."""

    levels: int = 7
    """Step sizes 1, 1/2, ..., 2^-levels; the smallest is bootstrapped from the teacher."""
    consistency_fraction: float = 0.25
    """Share of each batch trained on self-consistency targets (d > 0); the rest match the teacher at d = 0."""

    def __post_init__(self) -> None:
        if self.levels < 1:
            raise ValueError(f"levels={self.levels}; use 1 or more (the smallest step is 2^-levels)")
        if not 0 < self.consistency_fraction < 1:
            raise ValueError(f"consistency_fraction={self.consistency_fraction}; use a value in (0, 1)")

    def draw_steps(self, n: int, device, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(t, D) for ``n`` self-consistency rows: D = 2^-j with j = row mod (levels + 1) (every level as often,
        and a batch's shapes the same every step, which torch.compile and CUDA graphs need), t = k D with k uniform
        in 0..1/D - 1."""
        j = torch.arange(n, device=device) % (self.levels + 1)
        big = torch.exp2(-j.float())  # (n,)
        k = torch.floor(torch.rand(n, device=device, generator=generator) * torch.exp2(j.float()))
        return k * big, big

    @torch.no_grad()
    def targets(self, student: Student, teacher: Teacher, xt: torch.Tensor, t: torch.Tensor,
                big: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        """The self-consistency target of s(xt, t, D) for each row (the student's two half steps, the teacher's at
        the smallest D)."""
        smallest = big <= 2.0 ** -self.levels
        out = torch.empty_like(xt)
        for mask, fn in ((smallest, lambda x, s, h, c: teacher(x, s, c)), (~smallest, student)):
            if mask.any():
                out[mask] = two_step_target(fn, xt[mask], t[mask], big[mask] / 2, _rows(cond, mask)).to(out.dtype)
        return out

    def loss(self, student: Student, teacher: Teacher, x1: torch.Tensor, t_flow: torch.Tensor,
             generator: torch.Generator | None = None, cond: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 MSE of one batch of data ``x1`` (class labels ``cond``): rows past ``len(t_flow)`` are
        self-consistency rows, the first ``len(t_flow)`` match the teacher at d = 0 at times ``t_flow`` (the teacher's
        training time distribution)."""
        n = x1.shape[0]
        n_flow = t_flow.shape[0]
        t_sc, big = self.draw_steps(n - n_flow, x1.device, generator)
        t = torch.cat([t_flow.to(x1.device, torch.float32), t_sc])
        d = torch.cat([torch.zeros(n_flow, device=x1.device), big])
        x0 = torch.empty_like(x1).normal_(generator=generator)
        xt = interpolate(x0, x1, t)
        head, tail = _rows(cond, slice(None, n_flow)), _rows(cond, slice(n_flow, None))
        with torch.no_grad():
            target = torch.cat([teacher(xt[:n_flow], t[:n_flow], head).float(),
                                self.targets(student, teacher, xt[n_flow:], t[n_flow:], big, tail).float()])
        return F.mse_loss(student(xt, t, d, cond).float(), target)

    def flow_rows(self, batch: int) -> int:
        """Rows of a batch of ``batch`` that match the teacher at d = 0 (at least one of each kind)."""
        return min(batch - 1, max(1, round(batch * (1 - self.consistency_fraction))))


__all__ = ["ShortcutObjective", "guided_teacher", "two_step_target"]
