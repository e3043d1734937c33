"""Our samplers: what every registered one must do (``sampler_checks``, run for each entry of ``SAMPLERS``), then
Euler's and Heun's closed forms and their equivalence with diffusers' flow-match schedulers."""

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler
from sampler_checks import (check_evaluation_count, check_grid_and_calls, check_order, check_saved_pipeline,
                            check_scheduler_round_trip, remote_samples)

from hf_cgpu.flow.matching import from_diffusers_timestep, to_diffusers_velocity
from hf_cgpu.flow.samplers import SAMPLERS, sampler_class
from hf_cgpu.flow.scheduling_flow_match import FlowMatchEulerScheduler, FlowMatchHeunScheduler, sample_ode

SCHEDULERS = [sampler_class(name) for name in SAMPLERS]


# ---------------------------------------------------------------------------- every registered sampler
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_every_sampler_walks_n_steps_from_noise_to_data(name):
    check_grid_and_calls(name)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_every_sampler_converges_at_its_order(name):
    check_order(name)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_every_sampler_costs_what_evaluations_per_image_counts(name):
    check_evaluation_count(name)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_every_sampler_config_round_trips(name, tmp_path):
    check_scheduler_round_trip(name, tmp_path)


@pytest.mark.slow  # a fresh interpreter per sampler without hf_cgpu: the slow tier
def test_every_sampler_saves_a_pipeline_that_loads_with_and_without_hf_cgpu(tmp_path):
    """One fresh interpreter loads every sampler's folder."""
    folders = [tmp_path / name for name in SAMPLERS]
    for name, folder in zip(SAMPLERS, folders):
        check_saved_pipeline(name, folder)
    remote_samples(folders)


# ---------------------------------------------------------------------------- Euler and Heun


def field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A nonlinear velocity in (x, t), our convention."""
    t = t.reshape(-1, *([1] * (x.dim() - 1)))
    return torch.sin(2 * x) * (1 + t) - 0.3 * x**2 + torch.cos(3 * t)


def run_diffusers(sched, x0: torch.Tensor) -> tuple[torch.Tensor, int, list[float]]:
    """diffusers' loop; the model is ``field`` seen through the mapping sigma = 1 - t, velocity -ut."""
    x, times = x0, []
    for ts in sched.timesteps:
        t = from_diffusers_timestep(ts)
        times.append(float(t))
        x = sched.step(to_diffusers_velocity(field(x, t.expand(x.shape[0]))), ts, x).prev_sample
    return x, len(times), times


@pytest.mark.parametrize("steps", [1, 2, 5, 13])
@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("ours, theirs", [(FlowMatchEulerScheduler, FlowMatchEulerDiscreteScheduler),
                                          (FlowMatchHeunScheduler, FlowMatchHeunDiscreteScheduler)])
def test_matches_diffusers_on_its_own_grid(ours, theirs, steps, shift):
    x0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(steps))
    sched = theirs(shift=shift)
    sched.set_timesteps(steps)
    expected, their_calls, their_times = run_diffusers(sched, x0)

    mine = ours(shift=shift, timestep_spacing="diffusers")
    got, calls = sample_ode(field, mine, x0, steps)
    assert calls == their_calls == (steps if ours.order == 1 else 2 * steps - 1)
    assert torch.allclose(mine.timesteps, torch.tensor(their_times), atol=1e-6)
    # diffusers' Heun corrector computes (x - (x - v * sigma)) / sigma in fp32: at sigma = 0.001 that loses
    # ~eps / sigma = 1e-4 relative; ours uses v directly. Euler agrees to rounding.
    assert torch.allclose(got, expected, atol=1e-6 if ours.order == 1 else 1e-4)


@pytest.mark.parametrize("steps", [1, 4, 10])
def test_uniform_euler_matches_diffusers_with_custom_sigmas(steps):
    x0 = torch.randn(5, 2, generator=torch.Generator().manual_seed(0))
    sched = FlowMatchEulerDiscreteScheduler(shift=2.0)
    sched.set_timesteps(sigmas=torch.linspace(1, 0, steps + 1)[:-1].tolist())
    expected, their_calls, _ = run_diffusers(sched, x0)
    got, calls = sample_ode(field, FlowMatchEulerScheduler(shift=2.0), x0, steps)
    assert calls == their_calls == steps
    assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("steps", [2, 6])
def test_uniform_heun_matches_diffusers_on_the_same_grid(steps):
    """diffusers' Heun has no custom-sigma argument; give it our uniform grid in its own duplicated layout."""
    x0 = torch.randn(5, 2, generator=torch.Generator().manual_seed(1))
    mine = FlowMatchHeunScheduler()
    got, calls = sample_ode(field, mine, x0, steps)
    sched = FlowMatchHeunDiscreteScheduler()
    sched.set_timesteps(steps)
    sigmas = 1 - mine.t_grid  # (N + 1,) from 1 to 0
    sched.timesteps = torch.cat([sigmas[:1], sigmas[1:-1].repeat_interleave(2)]) * 1000
    sched.sigmas = torch.cat([sigmas[:1], sigmas[1:-1].repeat_interleave(2), sigmas[-1:]])
    expected, their_calls, _ = run_diffusers(sched, x0)
    assert calls == their_calls == 2 * steps - 1
    assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("cls", SCHEDULERS)
@pytest.mark.parametrize("spacing", ["uniform", "diffusers"])
def test_constant_velocity_is_integrated_exactly(cls, spacing):
    x0, v = torch.randn(3, 4), torch.randn(3, 4)
    got, _ = sample_ode(lambda x, t: v, cls(timestep_spacing=spacing, shift=2.5), x0, 7)
    assert torch.allclose(got, x0 + v, atol=1e-6)


@pytest.mark.parametrize("spacing", ["uniform", "diffusers"])
def test_affine_in_t_field(spacing):
    """v = a + b t: Heun's trapezoids are exact on every interval but the last (Euler, error b h^2 / 2);
    Euler is the left Riemann sum."""
    a, b, x0, steps = 0.7, -1.9, torch.zeros(2, 1), 6
    heun = FlowMatchHeunScheduler(timestep_spacing=spacing)
    got, _ = sample_ode(lambda x, t: a + b * t[:, None], heun, x0, steps)
    h_last = float(1 - heun.t_grid[-2])
    assert torch.allclose(got, torch.full_like(x0, a + b / 2 - b * h_last**2 / 2), atol=1e-6)

    euler = FlowMatchEulerScheduler(timestep_spacing=spacing)
    got, _ = sample_ode(lambda x, t: a + b * t[:, None], euler, x0, steps)
    g = euler.t_grid.double()
    riemann = float(((a + b * g[:-1]) * (g[1:] - g[:-1])).sum())
    assert torch.allclose(got, torch.full_like(x0, riemann), atol=1e-6)


def test_linear_in_x_field_closed_form():
    """v = lam x: Euler multiplies by (1 + lam h) per step, Heun by (1 + lam h + (lam h)^2 / 2), last step Euler."""
    lam, steps, x0 = -1.3, 4, torch.ones(1, 1)
    h = 1 / steps
    euler, _ = sample_ode(lambda x, t: lam * x, FlowMatchEulerScheduler(), x0, steps)
    assert torch.allclose(euler, x0 * (1 + lam * h) ** steps, atol=1e-6)
    heun, _ = sample_ode(lambda x, t: lam * x, FlowMatchHeunScheduler(), x0, steps)
    expected = (1 + lam * h + (lam * h) ** 2 / 2) ** (steps - 1) * (1 + lam * h)
    assert torch.allclose(heun, x0 * expected, atol=1e-6)


def test_timesteps_are_our_t():
    euler, heun = FlowMatchEulerScheduler(), FlowMatchHeunScheduler()
    euler.set_timesteps(4)
    heun.set_timesteps(4)
    assert torch.allclose(euler.timesteps, torch.tensor([0.0, 0.25, 0.5, 0.75]))
    assert torch.allclose(heun.timesteps, torch.tensor([0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75]))
    assert euler.order == 1 and heun.order == 2
    shifted = FlowMatchEulerScheduler(shift=3.0)
    shifted.set_timesteps(4)
    assert torch.all(shifted.timesteps[1:] < euler.timesteps[1:])  # shift > 1 spends more steps near noise


def test_step_upcasts_to_fp32():
    sched = FlowMatchEulerScheduler()
    sched.set_timesteps(3)
    x = torch.tensor([1.0, 300.0], dtype=torch.bfloat16)
    v = torch.tensor([0.01, 0.7], dtype=torch.bfloat16)
    out = sched.step(v, sched.timesteps[0], x).prev_sample
    expected = (x.float() + (1 / 3) * v.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_unknown_timestep_and_bad_settings_fail():
    sched = FlowMatchEulerScheduler()
    sched.set_timesteps(3)
    with pytest.raises(ValueError, match="scheduler.timesteps"):
        sched.step(torch.zeros(1), 0.123, torch.zeros(1))
    with pytest.raises(ValueError, match="uniform"):
        FlowMatchEulerScheduler(timestep_spacing="karras")
    with pytest.raises(ValueError, match="num_inference_steps"):
        sched.set_timesteps(0)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_save_load(tmp_path, cls):
    sched = cls(shift=2.0, timestep_spacing="diffusers")
    sched.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "scheduler_config.json").read_text())
    assert config["_class_name"] == cls.__name__ and config["shift"] == 2.0
    loaded = cls.from_pretrained(tmp_path)
    assert loaded.config.timestep_spacing == "diffusers" and loaded.config.shift == 2.0
    other = (set(SCHEDULERS) - {cls}).pop().from_config(loaded.config)  # swap Euler <-> Heun
    assert other.config.shift == 2.0
