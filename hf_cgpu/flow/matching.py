"""Flow matching (rectified flow / conditional OT path) as pure tensor math.

Time convention, used by every file in ``hf_cgpu.flow``:

    t = 0 is noise  x0 ~ N(0, I),   t = 1 is data  x1,
    xt = (1 - t) * x0 + t * x1,     target velocity  ut = x1 - x0.

Sampling integrates dx/dt = v(x, t) from t = 0 to t = 1.

diffusers' flow-match schedulers use the mirror image: sigma = 1 - t (sigma = 1 is noise), their model
predicts ``noise - data = -ut`` and is called with ``timestep = sigma * num_train_timesteps``. The small
``to_diffusers_*`` / ``from_diffusers_*`` functions below are the whole mapping; tests prove our schedulers
and diffusers' give the same samples through it.

The math lives here, apart from the network and the training loop (the torchcfm split), so it can be
checked against closed forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F

TimeSampling = Literal["uniform", "logit_normal"]


# ----------------------------------------------------------------------------- diffusers mapping
def to_diffusers_timestep(t: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """Our t in [0, 1] (0 = noise) -> diffusers' timestep ``sigma * T`` with sigma = 1 - t."""
    return (1.0 - t) * num_train_timesteps


def from_diffusers_timestep(timestep: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """diffusers' timestep ``sigma * T`` -> our t = 1 - sigma."""
    return 1.0 - timestep / num_train_timesteps


def to_diffusers_velocity(ut: torch.Tensor) -> torch.Tensor:
    """Our velocity ``x1 - x0`` -> diffusers' ``noise - data``: the same line walked the other way."""
    return -ut


# ----------------------------------------------------------------------------- path and target
def interpolate(x0: torch.Tensor, x1: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """xt = (1 - t) x0 + t x1, with t of shape (B,) broadcast over the remaining dims of x."""
    t = _expand_like(t, x1)  # (B, 1, ..., 1)
    return (1.0 - t) * x0 + t * x1


def conditional_velocity(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    """ut = x1 - x0: constant along each straight path, so it does not depend on t."""
    return x1 - x0


def guided_velocity(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: v_u + w (v_c - v_u). w = 1 is the conditional model, w = 0 the unconditional."""
    return v_uncond + scale * (v_cond - v_uncond)


def _expand_like(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], *([1] * (x.dim() - 1))).to(x.dtype)


def _as_tensor(output: Any) -> torch.Tensor:
    """Accept a bare tensor or a diffusers-style output with ``.sample``, so a UNet can be passed as is."""
    return output.sample if hasattr(output, "sample") else output


# ----------------------------------------------------------------------------- the matcher
@dataclass
class FlowMatcher:
    """Samples (t, xt, ut) triples and computes the flow-matching loss; holds no network.

    Attributes:
        time_sampling: "uniform" draws t ~ U(0, 1). "logit_normal" draws t = sigmoid(N(mean, std)), which puts
            more training signal in the middle of the path where the regression target is hardest (SD3).
        logit_mean: mean of the normal before the sigmoid; > 0 shifts training towards the data end (t -> 1).
        logit_std: spread of the normal before the sigmoid; larger is closer to uniform in the middle.
    """

    time_sampling: TimeSampling = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0

    def __post_init__(self) -> None:
        if self.time_sampling not in ("uniform", "logit_normal"):
            raise ValueError(f"time_sampling={self.time_sampling!r}; use 'uniform' or 'logit_normal'")
        if self.logit_std <= 0:
            raise ValueError(f"logit_std={self.logit_std} must be > 0")

    def sample_time(
        self, batch_size: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """t of shape (B,) in fp32, drawn on ``device`` (the generator must live on the same device)."""
        if self.time_sampling == "uniform":
            return torch.rand(batch_size, device=device, generator=generator)
        z = torch.randn(batch_size, device=device, generator=generator)
        return torch.sigmoid(self.logit_mean + self.logit_std * z)

    def sample_location_and_conditional_flow(
        self,
        x1: torch.Tensor,
        generator: torch.Generator | None = None,
        x0: torch.Tensor | None = None,
        t: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (t, xt, ut) for a batch of data x1; x0 (noise) and t are drawn unless given."""
        if x0 is None:  # in x1's memory order (channels_last data gets channels_last noise, no mixed-layout ops);
            # the same draws as randn for contiguous x1
            x0 = torch.empty_like(x1).normal_(generator=generator)  # (B, ...)
        if t is None:
            t = self.sample_time(x1.shape[0], x1.device, generator)  # (B,)
        return t, interpolate(x0, x1, t), conditional_velocity(x0, x1)

    def loss(
        self,
        model_fn: Callable[..., Any],
        x1: torch.Tensor,
        class_labels: torch.Tensor | None = None,
        cond_drop_prob: float = 0.1,
        null_class: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """fp32 MSE between ``model_fn(xt, t[, labels])`` and ut.

        With labels, a fraction ``cond_drop_prob`` of them is replaced by ``null_class`` so one network also
        learns the unconditional field that classifier-free guidance needs. ``model_fn`` may return a tensor
        or an object with ``.sample`` (a diffusers model output).
        """
        t, xt, ut = self.sample_location_and_conditional_flow(x1, generator=generator)
        if class_labels is None:
            v = _as_tensor(model_fn(xt, t))
        else:
            labels = drop_labels(class_labels, cond_drop_prob, null_class, generator)
            v = _as_tensor(model_fn(xt, t, labels))
        return F.mse_loss(v.float(), ut.float())


def drop_labels(
    class_labels: torch.Tensor,
    drop_prob: float,
    null_class: int | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Replace each label by ``null_class`` with probability ``drop_prob`` (classifier-free guidance training)."""
    if drop_prob <= 0:
        return class_labels
    if null_class is None:
        raise ValueError("cond_drop_prob > 0 needs null_class: pass null_class=unet.config.num_classes")
    drop = torch.rand(class_labels.shape, device=class_labels.device, generator=generator) < drop_prob  # (B,)
    return torch.where(drop, torch.full_like(class_labels, null_class), class_labels)
