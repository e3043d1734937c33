"""A small UNet for 32x32 flow matching, as a diffusers model.

Self-contained on purpose (imports only torch and diffusers): ``save_for_remote_code`` copies this file next to
the weights so ``DiffusionPipeline.from_pretrained(..., trust_remote_code=True)`` works without hf_cgpu.

Time convention: ``timestep`` is t in [0, 1] with t = 0 noise and t = 1 data; the network predicts the velocity
x1 - x0 (see hf_cgpu/flow/matching.py). t is multiplied by 1000 before the sinusoidal embedding so its
frequencies resolve the [0, 1] range as finely as integer diffusion steps would.

Shape (resolution 32 -> 16 -> 8 and back, channels c1 = base, c2 = c3 = 2 * base):
    in_conv 3 -> c1
    d1 = Block(c1, c1) @32, down1 (3x3 stride 2), d2 = Block(c1, c2) @16, down2 (3x3 stride 2)
    mid = Block(c2, c3) @8
    u2 = Block(c3 + c2, c2) @16 on [up(mid), d2], u1 = Block(c2 + c1, c1) @32 on [up(u2), d1]
    out = GroupNorm + SiLU + conv3x3 -> 3
Every Block receives the time (+ class) embedding. base 128 / 160 / 192 gives 6.1M / 9.3M / 13.3M parameters
without class conditioning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput


def sinusoidal_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """(B,) -> (B, dim) as [cos, sin] of t at geometrically spaced frequencies, computed in fp32."""
    half = dim // 2
    exponent = torch.arange(half, device=t.device, dtype=torch.float32) / half
    freqs = torch.exp(-math.log(max_period) * exponent)  # (half,)
    angles = t.float()[:, None] * freqs[None, :]  # (B, half)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)  # (B, dim)


def _compiling_channels_last(x: torch.Tensor) -> bool:
    """Under torch.compile with a (strictly) channels_last 4-D input: where the layout-keeping forms below apply."""
    return (torch.compiler.is_compiling() and x.dim() == 4 and not x.is_contiguous()
            and x.is_contiguous(memory_format=torch.channels_last))


class GroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` (same parameters, same values) written for ``torch.compile`` on a channels_last input. Eager
    keeps the native kernel.

    Compiled, it keeps the input's layout (CUDA's group-norm kernels return contiguous tensors, and inductor lays out
    the backward by them, so cuDNN's convolution backward would copy activation-sized gradients back to
    channels_last) and is written so both passes read the activation as few times as possible: the moments of
    each (image, channel) over its pixels in one reduction, the group's mean and variance combined from them (the
    group's variance is the mean of its channels' variances plus the variance of their means), then one scale and
    shift per (image, channel). Autograd's backward of that form reduces the gradient and the activation once per
    (image, channel), where a group-wise form reads them three times (per group, per channel across the batch, then
    the input gradient), which shortens the step's device time (benchmarks/RESULTS.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _compiling_channels_last(x):
            return super().forward(x)
        xf = x.float()
        scale, shift = self.scale_shift(*self.channel_moments(xf))
        y = xf * scale[:, :, None, None] + shift[:, :, None, None]
        # autocast runs group_norm in fp32 and returns fp32; without it the output has the input's dtype
        return y if torch.is_autocast_enabled(x.device.type) else y.to(x.dtype)

    @staticmethod
    def channel_moments(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(variance, mean) of each (image, channel) of an fp32 (n, c, h, w) tensor over its pixels: one pass."""
        return torch.var_mean(xf, dim=(2, 3), correction=0)

    def scale_shift(self, var_c: torch.Tensor, mean_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, c) fp32 scale and shift that normalize the input (affine included), from its (n, c) moments over the
        pixels: the group's mean is the mean of its channels' means, its variance the mean of their variances plus
        the variance of their means."""
        n, c = mean_c.shape
        g = self.num_groups
        mean_cg = mean_c.view(n, g, c // g)
        mean = mean_cg.mean(-1, keepdim=True)  # (n, g, 1)
        var = (var_c.view(n, g, c // g) + (mean_cg - mean).square()).mean(-1, keepdim=True)
        rstd = torch.rsqrt(var + self.eps)
        scale = rstd.expand(n, g, c // g).reshape(n, c)
        shift = (-mean * rstd).expand(n, g, c // g).reshape(n, c)
        if self.affine:
            scale, shift = scale * self.weight.float(), shift * self.weight.float() + self.bias.float()
        return scale, shift


def upsample2x(x: torch.Tensor) -> torch.Tensor:
    """Nearest-neighbour upsampling by 2, as ``F.interpolate(x, scale_factor=2.0, mode="nearest")``. Under compile a
    channels_last input is upsampled on its NHWC view, so the output and the gradient it sends back stay
    channels_last (inductor lays out the native op's backward contiguous, which adds gradient copies in the
    decoder's convolution backwards). Eager keeps the native op."""
    if not _compiling_channels_last(x):
        return F.interpolate(x, scale_factor=2.0, mode="nearest")
    b, c, h, w = x.shape
    nhwc = x.permute(0, 2, 3, 1)[:, :, None, :, None, :].expand(b, h, 2, w, 2, c)
    return nhwc.reshape(b, 2 * h, 2 * w, c).permute(0, 3, 1, 2)


def _zero_output_mlp(dim: int) -> nn.Sequential:
    """Linear-SiLU-Linear like the time MLP, its last layer zero: it adds nothing until trained."""
    mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
    nn.init.zeros_(mlp[2].weight)
    nn.init.zeros_(mlp[2].bias)
    return mlp


class ResBlock(nn.Module):
    """GN-SiLU-conv3x3, add projected embedding, GN-SiLU-conv3x3, plus a (1x1 when widths differ) skip."""

    def __init__(self, in_channels: int, out_channels: int, emb_dim: int, groups: int) -> None:
        super().__init__()
        self.norm1 = GroupNorm(groups, in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.emb_proj = nn.Linear(emb_dim, out_channels)
        self.norm2 = GroupNorm(groups, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.skip = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))  # (B, Cout, H, W)
        h = h + self.emb_proj(emb)[:, :, None, None]  # emb is already SiLU-activated, (B, Cout, 1, 1)
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


@dataclass
class FlowUNet2DOutput(BaseOutput):
    """sample: the predicted velocity x1 - x0, shape (B, C, H, W)."""

    sample: torch.Tensor


class FlowUNet2DModel(ModelMixin, ConfigMixin):
    """Velocity network v(x, t[, class]) for flow matching on small images (see the module docstring).

    Args:
        sample_size: image side; the pipeline draws noise of this size. Must be divisible by 4.
        in_channels / out_channels: 3 for RGB.
        base_channels: width c1; the two lower levels use 2 * base.
        time_embed_dim: width of the time embedding and of its 2-layer MLP.
        norm_num_groups: GroupNorm groups; must divide base_channels.
        num_classes: None for an unconditional model. Otherwise an embedding of num_classes + 1 rows is added
            to the time embedding; row ``num_classes`` is the null class used for classifier-free guidance.
        step_size_embedding: also embed the step size d the caller is about to take (a shortcut model: the output
            is the average velocity over [t, t + d], d = 0 the instantaneous one). An MLP like the time one whose last
            layer starts at zero, so a trained velocity model loaded into it is unchanged until fine-tuned; off
            (the default), the model and its weights are exactly those without the option.
        guidance_embedding: also embed a guidance scale w (a student distilled over a range of guidance: one call
            gives the velocity the guided teacher would at w), the same way as the step size: zero-initialised, so
            the model starts as the one loaded into it; off (the default), nothing changes.
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["ResBlock"]  # FSDP2 (TRANSFORMER_BASED_WRAP) shards each block as its own unit

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        in_channels: int = 3,
        out_channels: int = 3,
        base_channels: int = 128,
        time_embed_dim: int = 256,
        norm_num_groups: int = 8,
        num_classes: int | None = None,
        step_size_embedding: bool = False,
        guidance_embedding: bool = False,
    ) -> None:
        super().__init__()
        if base_channels % norm_num_groups:
            raise ValueError(f"base_channels={base_channels} must be a multiple of norm_num_groups={norm_num_groups}")
        if sample_size % 4:
            raise ValueError(f"sample_size={sample_size} must be divisible by 4 (two 2x downsamplings)")
        c1, c2, c3 = base_channels, 2 * base_channels, 2 * base_channels
        tdim, g = time_embed_dim, norm_num_groups
        self.time_mlp = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.class_embedding = nn.Embedding(num_classes + 1, tdim) if num_classes is not None else None
        self.step_mlp = _zero_output_mlp(tdim) if step_size_embedding else None
        self.in_conv = nn.Conv2d(in_channels, c1, 3, padding=1)
        self.d1 = ResBlock(c1, c1, tdim, g)
        self.down1 = nn.Conv2d(c1, c1, 3, stride=2, padding=1)
        self.d2 = ResBlock(c1, c2, tdim, g)
        self.down2 = nn.Conv2d(c2, c2, 3, stride=2, padding=1)
        self.mid = ResBlock(c2, c3, tdim, g)
        self.u2 = ResBlock(c3 + c2, c2, tdim, g)
        self.u1 = ResBlock(c2 + c1, c1, tdim, g)
        self.out = nn.Sequential(GroupNorm(g, c1), nn.SiLU(), nn.Conv2d(c1, out_channels, 3, padding=1))
        # built last, so every other weight draws the same initial values with the option as without it
        self.guidance_mlp = _zero_output_mlp(tdim) if guidance_embedding else None
        self.gradient_checkpointing = False

    @property
    def null_class(self) -> int | None:
        """Label index meaning "no class" (classifier-free guidance), or None for an unconditional model."""
        return self.config.num_classes

    def _scalar_embedding(self, mlp: nn.Module | None, value, default: float, flag: str, batch: int,
                          device: torch.device) -> torch.Tensor | None:
        """(B, tdim) ``mlp`` of the sinusoidal embedding of a per-row scalar (``default`` where None); None without
        the MLP, where a value given is refused (``flag``: the config entry that adds the MLP)."""
        if mlp is None:
            if value is not None:
                raise ValueError(f"{flag.removesuffix('_embedding')} given to a FlowUNet2DModel without {flag}")
            return None
        v = torch.as_tensor(default if value is None else value, device=device, dtype=torch.float32)
        v_emb = sinusoidal_embedding(v.reshape(-1).expand(batch) * 1000.0, self.config.time_embed_dim)
        return mlp(v_emb.to(mlp[0].weight.dtype))

    def _embed(
        self, timestep: torch.Tensor | float, class_labels: torch.Tensor | None, batch: int, device: torch.device,
        step_size: torch.Tensor | float | None = None, guidance: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        """(B, tdim) SiLU-activated time (+ step size) (+ guidance) (+ class) embedding shared by every block."""
        t = torch.as_tensor(timestep, device=device, dtype=torch.float32).reshape(-1).expand(batch)  # (B,)
        emb = sinusoidal_embedding(t * 1000.0, self.config.time_embed_dim)  # (B, tdim) fp32
        emb = self.time_mlp(emb.to(self.time_mlp[0].weight.dtype))
        # step_size None = 0: the instantaneous velocity; guidance None = 1: the unguided (conditional) model
        for mlp, value, default, flag in ((self.step_mlp, step_size, 0.0, "step_size_embedding"),
                                          (self.guidance_mlp, guidance, 1.0, "guidance_embedding")):
            added = self._scalar_embedding(mlp, value, default, flag, batch, device)
            if added is not None:
                emb = emb + added
        if self.class_embedding is not None:
            if class_labels is None:  # unconditional sampling of a conditional model
                class_labels = torch.full((batch,), self.config.num_classes, device=device, dtype=torch.long)
            emb = emb + self.class_embedding(class_labels)
        elif class_labels is not None:
            raise ValueError("class_labels given to an unconditional FlowUNet2DModel; build it with num_classes=N")
        return F.silu(emb)  # (B, tdim)

    def _block(self, block: nn.Module, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            return self._gradient_checkpointing_func(block, h, emb)
        return block(h, emb)

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float,
        class_labels: torch.Tensor | None = None,
        return_dict: bool = True,
        step_size: torch.Tensor | float | None = None,
        guidance: torch.Tensor | float | None = None,
    ) -> FlowUNet2DOutput | tuple[torch.Tensor]:
        """sample (B, C, H, W), timestep t in [0, 1] of shape (B,) or scalar, class_labels (B,) int64 or None,
        step_size d of shape (B,) or scalar (only with ``step_size_embedding``; None = 0), guidance scale w of shape
        (B,) or scalar (only with ``guidance_embedding``; None = 1)."""
        emb = self._embed(timestep, class_labels, sample.shape[0], sample.device, step_size, guidance)  # (B, tdim)
        h0 = self.in_conv(sample)  # (B, c1, H, W)
        h1 = self._block(self.d1, h0, emb)  # (B, c1, H, W)
        h2 = self._block(self.d2, self.down1(h1), emb)  # (B, c2, H/2, W/2)
        m = self._block(self.mid, self.down2(h2), emb)  # (B, c3, H/4, W/4)
        up2 = torch.cat([upsample2x(m), h2], dim=1)  # (B, c3 + c2, H/2, W/2)
        h = self._block(self.u2, up2, emb)  # (B, c2, H/2, W/2)
        up1 = torch.cat([upsample2x(h), h1], dim=1)  # (B, c2 + c1, H, W)
        h = self._block(self.u1, up1, emb)  # (B, c1, H, W)
        out = self.out(h)  # (B, out_channels, H, W)
        if not return_dict:
            return (out,)
        return FlowUNet2DOutput(sample=out)
