"""Closed-form checks of the flow-matching math (t = 0 noise, t = 1 data, ut = x1 - x0)."""

import pytest
import torch

from hf_cgpu.flow.matching import (
    FlowMatcher,
    drop_labels,
    from_diffusers_timestep,
    guided_velocity,
    interpolate,
    to_diffusers_timestep,
    to_diffusers_velocity,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_path_endpoints_and_target():
    x0, x1 = torch.randn(4, 3, 5, 5, generator=_gen(0)), torch.randn(4, 3, 5, 5, generator=_gen(1))
    m = FlowMatcher()
    t, xt, ut = m.sample_location_and_conditional_flow(x1, x0=x0, t=torch.zeros(4))
    assert torch.equal(xt, x0) and torch.equal(ut, x1 - x0)
    _, xt, _ = m.sample_location_and_conditional_flow(x1, x0=x0, t=torch.ones(4))
    assert torch.equal(xt, x1)
    # Each sample gets its own t, broadcast over (C, H, W).
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    xt = interpolate(x0, x1, t)
    assert torch.allclose(xt[1], 0.75 * x0[1] + 0.25 * x1[1])


def test_draws_are_reproducible_with_a_generator():
    x1 = torch.randn(8, 2)
    a = FlowMatcher().sample_location_and_conditional_flow(x1, generator=_gen(3))
    b = FlowMatcher().sample_location_and_conditional_flow(x1, generator=_gen(3))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_oracle_velocity_gives_zero_loss():
    """The exact conditional velocity recovered from xt, (x1 - xt) / (1 - t), is ut: zero loss."""
    x1 = torch.randn(256, 2, generator=_gen(0))

    def oracle(xt, t):
        return (x1 - xt) / (1 - t)[:, None]

    loss = FlowMatcher().loss(oracle, x1, generator=_gen(1))
    assert loss.dtype == torch.float32 and loss.item() < 1e-8


def test_zero_model_loss_is_noise_energy():
    """With x1 = 0 and a zero model the loss is E[x0^2] = 1 (and would not be if ut were x0 - x1 scaled)."""
    x1 = torch.zeros(20000, 4)
    loss = FlowMatcher().loss(lambda xt, t: torch.zeros_like(xt), x1, generator=_gen(0))
    assert abs(loss.item() - 1.0) < 0.03


def test_loss_is_fp32_for_low_precision_outputs():
    x1 = torch.randn(16, 2, dtype=torch.bfloat16)
    loss = FlowMatcher().loss(lambda xt, t: torch.zeros_like(xt), x1)
    assert loss.dtype == torch.float32


def test_loss_unwraps_model_outputs_with_sample():
    class Out:
        def __init__(self, sample):
            self.sample = sample

    x1 = torch.randn(64, 2, generator=_gen(0))
    plain = FlowMatcher().loss(lambda xt, t: xt * 0.5, x1, generator=_gen(1))
    wrapped = FlowMatcher().loss(lambda xt, t: Out(xt * 0.5), x1, generator=_gen(1))
    assert torch.equal(plain, wrapped)


def test_time_sampling():
    u = FlowMatcher("uniform").sample_time(50000, generator=_gen(0))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    ln = FlowMatcher("logit_normal", logit_mean=1.0, logit_std=0.5).sample_time(50000, generator=_gen(0))
    assert 0 < ln.min() and ln.max() < 1
    assert abs(ln.median().item() - torch.sigmoid(torch.tensor(1.0)).item()) < 0.01
    with pytest.raises(ValueError, match="uniform"):
        FlowMatcher("beta")


def test_condition_dropout():
    labels = torch.arange(10).repeat(1000)  # (10000,)
    assert torch.equal(drop_labels(labels, 0.0, 10), labels)
    assert torch.all(drop_labels(labels, 1.0, 10) == 10)
    dropped = drop_labels(labels, 0.1, 10, _gen(0))
    frac = (dropped == 10).float().mean().item()
    assert 0.09 < frac < 0.11
    kept = dropped != 10
    assert torch.equal(dropped[kept], labels[kept])
    with pytest.raises(ValueError, match="null_class"):
        drop_labels(labels, 0.1, None)


def test_loss_passes_dropped_labels_to_the_model():
    seen = []

    def model(xt, t, y):
        seen.append(y)
        return torch.zeros_like(xt)

    FlowMatcher().loss(model, torch.randn(4000, 2), torch.zeros(4000, dtype=torch.long), 0.5, null_class=7)
    assert set(seen[0].tolist()) == {0, 7}


def test_guided_velocity():
    vu, vc = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.equal(guided_velocity(vu, vc, 0.0), vu)
    assert torch.allclose(guided_velocity(vu, vc, 1.0), vc)
    assert torch.allclose(guided_velocity(vu, vc, 3.0), vc + 2.0 * (vc - vu))


def test_diffusers_mapping_matches_their_forward_process():
    """diffusers' scale_noise(x1, timestep, noise) is our xt at t = 1 - timestep / 1000; their target is -ut."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler()
    sched.set_timesteps(10)
    x0, x1 = torch.randn(2, 3, 4, 4, generator=_gen(0)), torch.randn(2, 3, 4, 4, generator=_gen(1))
    timestep = sched.timesteps[3]
    theirs = sched.scale_noise(x1, timestep[None], x0)
    t = from_diffusers_timestep(timestep)
    assert torch.allclose(theirs, interpolate(x0, x1, t.expand(2)), atol=1e-6)
    assert torch.allclose(to_diffusers_timestep(t), timestep)
    assert to_diffusers_timestep(torch.tensor(0.0)) == 1000 and to_diffusers_timestep(torch.tensor(1.0)) == 0
    assert torch.equal(to_diffusers_velocity(x1 - x0), x0 - x1)  # diffusers' "noise - data"
