"""Activation recompute (checkpointing) of every transformer block, full or selective, through transformers' own
checkpointing hook; non-reentrant, and the model is put in training mode so that it engages (``from_pretrained``
returns eval mode, where transformers silently skips checkpointing)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..errors import SettingsError


def _attention_ops() -> set:
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def selective_recompute_policy(ctx, op, *args, **kwargs):
    """Selective activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): keep the
    outputs of attention and of every matmul but a low-rank up-projection (a LoRA B: inner dimension at most an eighth
    of the output's, where an MLP's up-projection is 4x at most; its input is the tiny A output), recompute the rest.

    For a LoRA step the backward needs no input of a frozen matmul (dX = dY W), so a full recompute is one more
    forward on top of a backward of about one forward: +50% by FLOPs. Kept matmul outputs make the replay skip every
    large matmul and attention, so the backward pays only the memory-bound ops again."""
    aten = torch.ops.aten
    if op in _ATTENTION:
        return CheckpointPolicy.MUST_SAVE
    if op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        a, b = (args[1], args[2]) if op is aten.addmm.default else (args[0], args[1])
        inner, out = a.shape[-1], b.shape[-1]
        return CheckpointPolicy.PREFER_RECOMPUTE if 8 * inner <= out else CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_ATTENTION: set = set()


def _checkpoint_kwargs(policy: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        _ATTENTION.update(_attention_ops())
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_recompute_policy)
    return kwargs


def apply_recompute(model: nn.Module, policy: str = "full") -> nn.Module:
    """Checkpoint every block (non-reentrant) through transformers' own mechanism; cache off.

    ``policy`` (``RECOMPUTE_POLICIES``): ``full`` recomputes each block once in the backward, ``selective`` keeps the
    matmul and attention outputs and recomputes the rest (``selective_recompute_policy``).
    Non-reentrant checkpointing needs no input that requires grad and supports autocast state and
    keyword arguments; transformers still enables input grads on the embeddings, which costs one b x s x d
    tensor and keeps reentrant-style custom layers working. Transformers only checkpoints in
    training mode and `from_pretrained` returns eval mode, so the model is put in training mode here:
    otherwise checkpointing is silently a no-op.
    """
    kwargs = _checkpoint_kwargs(policy)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        if not getattr(model, "supports_gradient_checkpointing", True):
            raise SettingsError(f"{type(model).__name__} does not support activation checkpointing: use recompute=False")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise SettingsError(f"{type(model).__name__} has no checkpointing hook: use recompute=False")
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    model.train()
    return model


__all__ = ["apply_recompute", "selective_recompute_policy"]
