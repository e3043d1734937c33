"""AdamW: torch's (fused on CUDA) for tiers full, lora and qlora; bitsandbytes' 8-bit AdamW for tier adamw8bit.

Weight decay applies to >= 2-D weights only: decaying a norm gain or a bias towards 0 fights what it is for.
"""

from __future__ import annotations

import math
from typing import Any

from .spec import OptimizerSpec, Tensors

FP32 = 4
ADAM_STATE_BYTES = 2 * FP32
"""AdamW keeps m and v in fp32: 8 bytes per trainable parameter."""
ADAM8BIT_STATE_BYTES = 2
"""bitsandbytes AdamW8bit keeps m and v in one byte each."""
BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps 32-bit state for tensors with fewer elements (``min_8bit_size``): norms, biases."""
BNB_8BIT_BLOCK = 256
"""Blockwise 8-bit state: one fp32 absmax per 256 values, per state tensor (m and v)."""


def adamw8bit_state_bytes(numels: list[int]) -> float:
    """bitsandbytes AdamW8bit: 2 B/param + blockwise absmax for big tensors; fp32 m, v for tensors < 4096 elements."""
    total = 0.0
    for n in numels:
        if n < BNB_MIN_8BIT_SIZE:
            total += ADAM_STATE_BYTES * n
        else:
            total += ADAM8BIT_STATE_BYTES * n + 2 * FP32 * math.ceil(n / BNB_8BIT_BLOCK)
    return total


def state_bytes(tensors: Tensors, tier: str) -> tuple[float, str]:
    if tier == "adamw8bit":
        return (adamw8bit_state_bytes([n for n, _ in tensors]),
                "AdamW8bit: 2 B/param (+absmax); fp32 for tensors < 4096")
    on = " on the adapters" if tensors and all(kind == "adapter" for _, kind in tensors) else ""
    return ADAM_STATE_BYTES * sum(n for n, _ in tensors), f"AdamW m, v fp32{on}: 8 B/param"


def decay_groups(named: list, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: >= 2-D weights decayed, the rest (norms, biases, 1-D tensors) not; empty ones dropped."""
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build(model, named: list, settings: Any, fused: bool):
    """``torch.optim.AdamW``, or bitsandbytes' ``AdamW8bit`` (``PagedAdamW8bit`` with ``--paged_optimizer``, whose
    state can spill to host memory) for tier adamw8bit; bitsandbytes keeps 32-bit state for tensors under 4096
    elements."""
    s = settings
    from .groups import with_embedding_lr  # torch: only when a run starts

    groups = with_embedding_lr(model, decay_groups(named, s.weight_decay), s)
    kwargs = dict(lr=s.learning_rate, betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_eps, weight_decay=s.weight_decay)
    if s.tier == "adamw8bit":
        import bitsandbytes as bnb

        return (bnb.optim.PagedAdamW8bit if s.paged_optimizer else bnb.optim.AdamW8bit)(groups, **kwargs)
    import torch

    return torch.optim.AdamW(groups, fused=fused, **kwargs)


ADAMW = OptimizerSpec(
    "adamw", "AdamW on every trainable weight (8-bit state under --tier adamw8bit)", build=build,
    state_bytes=state_bytes, label="AdamW",
)

__all__ = ["ADAMW", "ADAM_STATE_BYTES", "adamw8bit_state_bytes", "decay_groups"]
