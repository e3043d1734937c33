"""Adversarial fine-tuning of a few-step student against real data: the second stage of ``train flow-distill``.

A regression-only student (``shortcut``) matches the guided teacher's paths; in one step it averages what it cannot
resolve, and the guided teacher itself trades variety for precision. This stage adds a GAN term on the student's
samples against REAL training images, so the student is pulled toward the data's distribution, not only toward the
teacher's paths (GDD / D2O: a pretrained flow fine-tuned with a GAN loss alone reaches one-step quality):

    fake      = the student's sample in 1 or 2 Euler steps of its own step sizes (``sample_in_steps``)
    D loss    = hinge: mean relu(1 - D(real, y)) + mean relu(1 + D(fake.detach(), y))
    G loss    = -mean D(fake, y)        (added to the shortcut loss with ``adversarial_weight``)

The discriminator is small trainable heads (``FeatureHeads``) on frozen features: for images, the teacher UNet's
encoder (its down blocks and middle block, class-conditioned through the time embedding) at a fixed time; the
gradient of G's loss reaches the student through those frozen layers. For the 2D toy the heads read the points.

Pure tensor math over callables, like ``shortcut``: ``student(x, t, d, cond)`` returns a velocity, ``disc(x, cond)``
a logit tensor (any shape, averaged).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Student = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Critic = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def sample_in_steps(student: Student, x0: torch.Tensor, steps: torch.Tensor,
                    cond: torch.Tensor | None = None) -> torch.Tensor:
    """Euler from noise ``x0`` (t = 0) to t = 1 with each row's own number of equal steps ``steps`` (B,) (one
    student call a step, told its step size); differentiable. Rows of equal count share their calls."""
    out = torch.empty_like(x0)
    for n in sorted(set(steps.tolist())):
        rows = steps == n
        x = x0[rows]
        c = None if cond is None else cond[rows]
        d = torch.full((x.shape[0],), 1.0 / n, device=x0.device)
        for k in range(int(n)):
            x = x + (1.0 / n) * student(x, d * k, d, c)
        out[rows] = x.to(out.dtype)
    return out


def row_steps(n: int, choices: tuple[int, ...], device) -> torch.Tensor:
    """(n,) step counts of a fake batch: ``choices`` in turn by row (every count as often, the same every step)."""
    return torch.tensor(choices, device=device)[torch.arange(n, device=device) % len(choices)]


def discriminator_loss(disc: Critic, real: torch.Tensor, fake: torch.Tensor,
                       cond: torch.Tensor | None = None) -> torch.Tensor:
    """Hinge loss of the critic on real rows against (detached) fake rows, fp32."""
    both = disc(torch.cat([real, fake.detach()]), None if cond is None else torch.cat([cond, cond])).float()
    d_real, d_fake = both.chunk(2)
    return F.relu(1.0 - d_real).mean() + F.relu(1.0 + d_fake).mean()


def generator_loss(disc: Critic, fake: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
    """The student's adversarial loss: -mean D(fake) (hinge GAN), fp32; its gradient reaches ``fake``."""
    return -disc(fake, cond).float().mean()


class FeatureHeads(nn.Module):
    """One small head per feature map (B, C_i, H_i, W_i) -> (B, H_i W_i) logits, concatenated; or an MLP on
    (B, C) vectors when ``spatial`` is False. Holds no frozen weights: only these are trained and checkpointed."""

    def __init__(self, channels: tuple[int, ...], width: int = 64, spatial: bool = True) -> None:
        super().__init__()
        self.spatial = spatial
        if spatial:
            self.heads = nn.ModuleList(nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.GroupNorm(8, width),
                                                     nn.LeakyReLU(0.2), nn.Conv2d(width, 1, 1)) for c in channels)
        else:
            self.heads = nn.ModuleList(nn.Sequential(nn.Linear(c, width), nn.LeakyReLU(0.2), nn.Linear(width, width),
                                                     nn.LeakyReLU(0.2), nn.Linear(width, 1)) for c in channels)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        outs = [head(f.to(head[0].weight.dtype)).flatten(1) for head, f in zip(self.heads, features)]
        return torch.cat(outs, dim=1)  # (B, sum of logits per head)


def unet_encoder_features(unet, x: torch.Tensor, t: float, cond: torch.Tensor | None,
                          generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The frozen UNet's encoder on ``x`` noised to time ``t`` (t = 1: the image itself), class-conditioned through
    its time embedding: [down block 1 (H), down block 2 (H/2), middle (H/4)] activations. The noise is drawn from
    ``generator`` (the same draw for real and fake rows only by chance: it smooths the critic, like instance noise)."""
    if t < 1.0:
        x = t * x + (1.0 - t) * torch.empty_like(x).normal_(generator=generator)
    emb = unet._embed(torch.full((x.shape[0],), t, device=x.device), cond, x.shape[0], x.device)
    h1 = unet.d1(unet.in_conv(x), emb)
    h2 = unet.d2(unet.down1(h1), emb)
    m = unet.mid(unet.down2(h2), emb)
    return [h1, h2, m]


def unet_feature_channels(config) -> tuple[int, int, int]:
    """Channels of ``unet_encoder_features``' maps for a FlowUNet2DModel config."""
    c1 = config["base_channels"]
    return c1, 2 * c1, 2 * c1


__all__ = ["FeatureHeads", "discriminator_loss", "generator_loss", "row_steps", "sample_in_steps",
           "unet_encoder_features", "unet_feature_channels"]
