"""The adversarial stage's losses (hf_cgpu.flow.adversarial) on a 2D mixture whose modes and weights are known.

The teacher is the exact flow of a mixture with the wrong weights (0.4, 0.3, 0.2, 0.1), as a guided teacher trades
variety for precision; the real data has four equal modes. A one-step student distilled from it inherits the
teacher's weights; the GAN term against the real points brings every mode to within 20% of its true weight, in 1 and
in 2 steps, and the same run without that term does not."""

import copy

import pytest
import torch

from hf_cgpu.flow.adversarial import (FeatureHeads, discriminator_loss, generator_loss, row_steps, sample_in_steps,
                                      unet_encoder_features, unet_feature_channels)
from hf_cgpu.flow.shortcut import ShortcutObjective
from hf_cgpu.flow.toy2d import VelocityMLP, mode_centres, sample_modes

K, STD = 4, 0.1
CENTRES = mode_centres(K, 2.0)
TEACHER_WEIGHTS = torch.tensor([0.4, 0.3, 0.2, 0.1])
TRUTH = torch.full((K,), 1.0 / K)


def mixture_velocity(centres: torch.Tensor, weights: torch.Tensor, std: float):
    """The exact flow-matching velocity toward a Gaussian mixture: (E[x1 | x_t] - x_t) / (1 - t), where x_t is
    N(t mu_k, (1 - t)^2 + t^2 std^2) under mode k."""
    def velocity(x, t, cond=None):
        tt = t[:, None]
        var = (1 - tt) ** 2 + (tt * std) ** 2  # (B, 1)
        mean = tt[:, :, None] * centres[None]  # (B, K, 2)
        post = (weights.log()[None] - ((x[:, None] - mean) ** 2).sum(-1) / (2 * var)).softmax(-1)  # (B, K)
        x1_k = centres[None] + (tt * std**2 / var)[:, :, None] * (x[:, None] - mean)
        return ((post[:, :, None] * x1_k).sum(1) - x) / (1 - tt).clamp_min(1e-3)
    return velocity


def train(student, steps, generator, adversarial_weight=0.0, disc=None):
    """``steps`` of the shortcut objective against the skewed teacher on real points, plus the GAN term."""
    teacher, objective = mixture_velocity(CENTRES, TEACHER_WEIGHTS, STD), ShortcutObjective(2, 0.5)
    opt = torch.optim.Adam(student.parameters(), 1e-3)
    dopt = torch.optim.Adam(disc.parameters(), 1e-3, betas=(0.0, 0.99)) if disc is not None else None
    s = lambda x, t, d, c: student(x, t, d)  # noqa: E731
    critic = lambda x, c: disc([x])  # noqa: E731
    for _ in range(steps):
        x1 = sample_modes(256, CENTRES, STD, generator)
        loss = objective.loss(s, teacher, x1, torch.rand(128, generator=generator), generator)
        if adversarial_weight:
            x0 = torch.randn(x1.shape, generator=generator)
            fake = sample_in_steps(s, x0, row_steps(len(x0), (1, 2), x0.device))
            dopt.zero_grad()
            discriminator_loss(critic, x1, fake).backward()
            dopt.step()
            disc.requires_grad_(False)
            loss = loss + adversarial_weight * generator_loss(critic, fake)
            disc.requires_grad_(True)
        opt.zero_grad()
        loss.backward()
        opt.step()


def mode_weights(student, steps: int, n: int = 4000) -> torch.Tensor:
    """Share of ``n`` samples of ``steps`` Euler steps nearest each mode."""
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        x = sample_in_steps(lambda x, t, d, c: student(x, t, d), torch.randn(n, 2, generator=g), torch.full((n,), steps))
    return torch.bincount(torch.cdist(x, CENTRES).argmin(1), minlength=K).float() / n


@pytest.fixture(scope="module")
def distilled():
    """A one-step student distilled from the skewed teacher (the stage's starting point)."""
    torch.manual_seed(0)
    student = VelocityMLP(64, 3, 32, step_size_embedding=True)
    train(student, 400, torch.Generator().manual_seed(0))
    return student


@pytest.mark.parametrize("adversarial", [True, False], ids=["with_gan", "without"])
def test_the_gan_term_restores_the_modes_weights(distilled, adversarial):
    student = copy.deepcopy(distilled)
    torch.manual_seed(1)
    disc = FeatureHeads((2,), width=64, spatial=False)
    train(student, 500, torch.Generator().manual_seed(1), 0.5 if adversarial else 0.0, disc)
    for steps in (1, 2):
        weights = mode_weights(student, steps)
        close = ((weights / TRUTH - 1).abs() <= 0.2).all()
        assert bool(close) == adversarial, (steps, weights.tolist())


def test_the_losses_push_each_side_the_right_way():
    """The critic's hinge loss falls when it scores real above fake; the student's falls when its fakes score higher;
    only the fakes carry the student's gradient (the critic's loss sees them detached)."""
    real, fake = torch.ones(4, 2), torch.zeros(4, 2, requires_grad=True)
    good = lambda x, c: x.sum(1)  # noqa: E731 - real scores 2, fake 0
    bad = lambda x, c: -x.sum(1)  # noqa: E731
    assert discriminator_loss(good, real, fake) < discriminator_loss(bad, real, fake)
    assert discriminator_loss(good, real, fake).requires_grad is False
    g = generator_loss(good, fake)
    g.backward()
    assert torch.equal(fake.grad, torch.full((4, 2), -0.25))  # -d mean(sum x) / dx: raising the fakes' score


def test_sample_in_steps_walks_each_rows_own_step_count():
    """Rows of 1 and 2 steps in one batch, each call told its step size: a constant velocity lands at x0 + v."""
    calls = []

    def student(x, t, d, c):
        calls.append((len(x), d.tolist(), t.tolist()))
        return torch.ones_like(x)

    x0 = torch.zeros(4, 2)
    out = sample_in_steps(student, x0, row_steps(4, (1, 2), x0.device))
    assert torch.equal(out, torch.ones(4, 2))
    assert calls == [(2, [1.0, 1.0], [0.0, 0.0]), (2, [0.5, 0.5], [0.0, 0.0]), (2, [0.5, 0.5], [0.5, 0.5])]


def test_unet_features_are_the_encoders_and_carry_the_gradient():
    """The three maps of the frozen UNet's encoder, of the channels the heads are built for; the gradient reaches
    the input through the frozen weights."""
    from hf_cgpu.flow.unet import FlowUNet2DModel

    unet = FlowUNet2DModel(base_channels=8, num_classes=3).requires_grad_(False)
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    feats = unet_encoder_features(unet, x, 1.0, torch.tensor([0, 2]))
    assert [f.shape[1:] for f in feats] == [(8, 32, 32), (16, 16, 16), (16, 8, 8)]
    assert tuple(f.shape[1] for f in feats) == unet_feature_channels(unet.config)
    heads = FeatureHeads(unet_feature_channels(unet.config), width=8)
    heads(feats).mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
