"""Euler and Heun ODE schedulers for flow matching in our time convention, as diffusers schedulers.

Imports only numpy, torch and diffusers: ``save_for_remote_code`` writes this file into ``scheduler/`` so a saved
pipeline loads without hf_cgpu, and carries it into the saved file of a sampler that subclasses ``FlowMatchScheduler``
in a file of its own.

Convention: t = 0 is noise, t = 1 is data, the model predicts ut = x1 - x0 at time t, and sampling integrates
dx/dt = v(x, t) from t = 0 up to t = 1. ``scheduler.timesteps`` holds exactly the t values the pipeline passes to
the model (floats in [0, 1], not the 0..1000 of diffusers). diffusers' FlowMatch*DiscreteScheduler walk the same
grid with sigma = 1 - t and velocity -ut; with ``timestep_spacing="diffusers"`` our grid is theirs value for value,
and the tests check that both give the same samples.

Time grid t_0 = 0 < t_1 < ... < t_N = 1 for N = num_inference_steps:
    "uniform":   sigma_k = 1 - k / N, N equal steps. The default: on the 2D toy it beats the diffusers grid at
                 every budget.
    "diffusers": sigma = linspace(1, sigma_min, N) then 0, as in diffusers' set_timesteps; its last step is only
                 1 / num_train_timesteps long, so N Euler steps act like N - 1.
``shift`` > 1 warps sigma -> shift * sigma / (1 + (shift - 1) * sigma) (SD3), spending more steps near noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np
import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils import BaseOutput

TimestepSpacing = Literal["uniform", "diffusers"]


@dataclass
class FlowMatchSchedulerOutput(BaseOutput):
    """prev_sample: the sample moved forward in t (towards data), to feed to the next model call."""

    prev_sample: torch.Tensor


def _shift_sigmas(sigmas: np.ndarray, shift: float) -> np.ndarray:
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def time_grid(num_inference_steps: int, spacing: str, shift: float, num_train_timesteps: int) -> torch.Tensor:
    """The N + 1 times t_0 = 0 ... t_N = 1 (fp32) the integrator steps between."""
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps={num_inference_steps}; use 1 or more")
    if spacing == "uniform":
        sigmas = _shift_sigmas(np.linspace(1.0, 0.0, num_inference_steps + 1), shift)
    elif spacing == "diffusers":
        # diffusers: sigma_min comes from the (shifted) training grid and the linspace is shifted again.
        sigma_min = _shift_sigmas(np.array(1.0 / num_train_timesteps), shift)
        sigmas = _shift_sigmas(np.linspace(1.0, sigma_min, num_inference_steps), shift)
        sigmas = np.append(sigmas.astype(np.float32), 0.0)
    else:
        raise ValueError(f"timestep_spacing={spacing!r}; use 'uniform' or 'diffusers'")
    sigmas = torch.from_numpy(np.asarray(sigmas)).to(torch.float32)
    return 1.0 - sigmas  # (N + 1,)


class FlowMatchScheduler(SchedulerMixin, ConfigMixin):
    """The base of every sampler: the grid, the step index and the call plan. ``t_grid`` has N + 1 entries,
    ``timesteps`` the model-call times.

    A sampler sets ``order`` (model calls per step at most) and writes ``set_timesteps`` (``_make_grid``, then
    ``timesteps``), ``_call_interval`` (the grid interval of each call) and ``step``. Usable right after
    construction, as diffusers' schedulers: the default grid has ``num_train_timesteps`` steps until
    ``set_timesteps`` picks another.
    """

    config_name = "scheduler_config.json"
    _compatibles: list = []
    order = 1
    timesteps_are_t = True  # FlowMatchPipeline: timesteps are our t (0 = noise), not diffusers' sigma * 1000

    @register_to_config
    def __init__(
        self, num_train_timesteps: int = 1000, shift: float = 1.0, timestep_spacing: TimestepSpacing = "uniform"
    ) -> None:
        if timestep_spacing not in ("uniform", "diffusers"):
            raise ValueError(f"timestep_spacing={timestep_spacing!r}; use 'uniform' or 'diffusers'")
        if shift <= 0:
            raise ValueError(f"shift={shift} must be > 0")
        if num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps={num_train_timesteps}; use 1 or more")
        self.set_timesteps(num_train_timesteps)

    @property
    def step_index(self) -> int | None:
        """How many ``step`` calls were made since ``set_timesteps`` (None before the first)."""
        return self._step_index

    def _make_grid(self, num_inference_steps: int, device: torch.device | str | None) -> torch.Tensor:
        self.num_inference_steps = num_inference_steps
        self._step_index = None
        cfg = self.config
        grid = time_grid(num_inference_steps, cfg.timestep_spacing, cfg.shift, cfg.num_train_timesteps)
        self.t_grid = grid.to(device)
        return self.t_grid

    def _init_step_index(self, timestep: torch.Tensor | float) -> None:
        """Start at ``timestep``; for Heun's duplicated interior times take the later (predictor) occurrence."""
        match = (self.timesteps == torch.as_tensor(timestep, device=self.timesteps.device)).nonzero()
        if len(match) == 0:
            raise ValueError(f"timestep {float(timestep)} is not in scheduler.timesteps; pass one of those values")
        self._step_index = int(match[-1].item())

    def _output(self, prev_sample: torch.Tensor, return_dict: bool):
        if not return_dict:
            return (prev_sample,)
        return FlowMatchSchedulerOutput(prev_sample=prev_sample)

    def __len__(self) -> int:
        return self.config.num_train_timesteps

    def call_step_sizes(self) -> torch.Tensor:
        """(len(timesteps),) the length of the grid interval each model call belongs to: what a step-size
        conditioned UNet (``step_size_embedding``) is told it is jumping."""
        return (self.t_grid[1:] - self.t_grid[:-1])[self._call_interval()]

    def call_plan(self, guidance_interval: tuple[float, float] | None = None) -> list[tuple[float, float, bool]]:
        """(t, step size, guided) of every model call after ``set_timesteps``: guidance applies to a call whose t lies
        in ``guidance_interval`` = (lo, hi), both ends included to 1e-6 (the grid is fp32) (None: every call). A guided
        call costs two network evaluations, an unguided one one."""
        lo, hi = guidance_interval if guidance_interval is not None else (0.0, 1.0)
        ts, ds = self.timesteps.tolist(), self.call_step_sizes().tolist()
        return [(t, d, lo - 1e-6 <= t <= hi + 1e-6) for t, d in zip(ts, ds)]


class FlowMatchEulerScheduler(FlowMatchScheduler):
    """x_{k+1} = x_k + (t_{k+1} - t_k) v(x_k, t_k): N model calls for N steps, first order."""

    order = 1

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        """Build the grid; ``timesteps`` = t_0 ... t_{N-1}, one per model call."""
        grid = self._make_grid(num_inference_steps, device)
        self.timesteps = grid[:-1]

    def _call_interval(self) -> torch.Tensor:
        return torch.arange(len(self.timesteps), device=self.t_grid.device)  # call k steps over interval k

    def step(
        self,
        model_output: torch.Tensor,
        timestep: torch.Tensor | float,
        sample: torch.Tensor,
        return_dict: bool = True,
    ) -> FlowMatchSchedulerOutput | tuple[torch.Tensor]:
        """Advance ``sample`` from ``timestep`` to the next grid time with velocity ``model_output`` (fp32 math)."""
        if self._step_index is None:
            self._init_step_index(timestep)
        k = self._step_index
        dt = self.t_grid[k + 1] - self.t_grid[k]
        prev = sample.float() + dt * model_output.float()
        self._step_index = k + 1
        return self._output(prev.to(model_output.dtype), return_dict)


class FlowMatchHeunScheduler(FlowMatchScheduler):
    """Heun (explicit trapezoid) on every interval but the last, which takes one Euler step.

    Like diffusers' FlowMatchHeunDiscreteScheduler: N steps cost 2N - 1 model calls, and ``timesteps`` lists the
    interior grid times twice, [t_0, t_1, t_1, ..., t_{N-1}, t_{N-1}]. Call k even is a predictor (Euler to the next
    grid time), call k odd the corrector that replaces it by the average of both slopes. The last interval is
    Euler because diffusers' formula would divide by sigma = 0 there; with the "diffusers" grid it is 1/1000 long.
    """

    order = 2

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        """Build the grid; ``timesteps`` has 2N - 1 entries (interior times duplicated)."""
        grid = self._make_grid(num_inference_steps, device)
        self.timesteps = torch.cat([grid[:1], grid[1:-1].repeat_interleave(2)])  # (2N - 1,)
        self._x_start: torch.Tensor | None = None
        self._v_start: torch.Tensor | None = None

    def _call_interval(self) -> torch.Tensor:  # predictor 2i and corrector 2i + 1 both belong to interval i
        return torch.arange(len(self.timesteps), device=self.t_grid.device) // 2

    @property
    def state_in_first_order(self) -> bool:
        """True when the next call is a predictor (or the final Euler step), False for a corrector."""
        return self._step_index is None or self._step_index % 2 == 0

    def step(
        self,
        model_output: torch.Tensor,
        timestep: torch.Tensor | float,
        sample: torch.Tensor,
        return_dict: bool = True,
    ) -> FlowMatchSchedulerOutput | tuple[torch.Tensor]:
        """Predictor or corrector half-step; the model must be called at exactly the times in ``timesteps``."""
        if self._step_index is None:
            self._init_step_index(timestep)
        k = self._step_index
        i = k // 2  # grid interval [t_i, t_{i+1}]
        dt = self.t_grid[i + 1] - self.t_grid[i]
        v = model_output.float()
        if k % 2 == 0:
            x = sample.float()
            prev = x + dt * v
            self._x_start, self._v_start = x, v
        else:
            prev = self._x_start + dt * 0.5 * (self._v_start + v)
            self._x_start = self._v_start = None
        self._step_index = k + 1
        return self._output(prev.to(model_output.dtype), return_dict)


def sample_ode(
    velocity_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    scheduler: FlowMatchScheduler,
    x0: torch.Tensor,
    num_inference_steps: int,
) -> tuple[torch.Tensor, int]:
    """Integrate dx/dt = velocity_fn(x, t) from noise x0 (t = 0) to t = 1 with ``scheduler``.

    ``velocity_fn`` gets t expanded to shape (B,). Works for any sample shape (images, 2D points).
    Returns (x1, number of velocity_fn calls).
    """
    scheduler.set_timesteps(num_inference_steps, device=x0.device)
    x = x0
    for t in scheduler.timesteps:
        v = velocity_fn(x, t.expand(x.shape[0]))
        x = scheduler.step(v, t, x).prev_sample
    return x, len(scheduler.timesteps)
