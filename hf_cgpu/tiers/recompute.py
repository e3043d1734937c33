"""Activation recompute (checkpointing) of every transformer block, full, selective or offloaded, through
transformers' own checkpointing hook; non-reentrant, and the model is put in training mode so that it engages
(``from_pretrained`` returns eval mode, where transformers silently skips checkpointing)."""

from __future__ import annotations

import functools
import warnings
import weakref
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


class _Stashed:
    """One block input in host memory: its device, and while it is on the way back, its device copy."""

    __slots__ = ("host", "device", "older", "copied", "back", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, older, copied) -> None:
        self.host, self.device, self.older, self.copied, self.back = host, device, older, copied, None


class HostOffload:
    """``saved_tensors_hooks`` that keep what a checkpointed block saves between forward and backward (its inputs:
    non-reentrant checkpointing saves nothing else) in pinned host memory.

    On CUDA each copy runs on a side stream: out after the compute stream has made the tensor (``record_stream``
    keeps the allocator from reusing it before the copy is done), back when the backward reaches the block, and the
    block before it (the one the backward reaches next) is fetched at the same time, so its copy overlaps this
    block's recompute and backward. On the CPU the same copies run in place of a move."""

    def __init__(self) -> None:
        self.stream: torch.cuda.Stream | None = None
        self.last: weakref.ref | None = None

    def _side(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def pack(self, t: torch.Tensor):
        if t.numel() == 0:
            return t
        side = self._side(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=side is not None)
        copied = None
        if side is None:
            host.copy_(t)
        else:
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
                copied = side.record_event()
            t.record_stream(side)
        stashed = _Stashed(host, t.device, self.last, copied)
        self.last = weakref.ref(stashed)
        return stashed

    def _fetch(self, s: _Stashed) -> None:
        """Start ``s``'s copy back to its device (once)."""
        if s.back is not None:
            return
        side = self._side(s.device)
        if side is None:
            s.back = s.host.to(s.device, copy=True), None
            return
        with torch.cuda.stream(side):
            side.wait_event(s.copied)
            back = torch.empty(s.host.shape, dtype=s.host.dtype, layout=s.host.layout, device=s.device)
            back.copy_(s.host, non_blocking=True)
            s.back = back, side.record_event()

    def unpack(self, s):
        if isinstance(s, torch.Tensor):
            return s
        self._fetch(s)
        back, arrived = s.back
        s.back = None  # a second unpack (retain_graph) copies it again
        if arrived is not None:
            current = torch.cuda.current_stream(s.device)
            current.wait_event(arrived)
            back.record_stream(current)
        older = s.older() if s.older is not None else None
        if older is not None:
            self._fetch(older)
        return back


def _offloaded(hooks: HostOffload, checkpoint_fn, function, *args, **kwargs):
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        return checkpoint_fn(function, *args, **kwargs)


def offload_checkpoints(model: nn.Module) -> nn.Module:
    """Wrap every checkpointed block's checkpoint function in one ``HostOffload``: the inputs it keeps for the
    backward's recompute live in host memory."""
    hooks = HostOffload()
    blocks = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)
              and callable(getattr(m, "_gradient_checkpointing_func", None))]
    if not blocks:
        raise SettingsError(f"{type(model).__name__} has no checkpointed block to offload: use recompute_policy='full'")
    for block in blocks:
        block._gradient_checkpointing_func = functools.partial(_offloaded, hooks, block._gradient_checkpointing_func)
    return model


def apply_recompute(model: nn.Module, policy: str = "full") -> nn.Module:
    """Checkpoint every block (non-reentrant) through transformers' own mechanism; cache off.

    ``policy`` (``RECOMPUTE_POLICIES``): ``full`` recomputes each block once in the backward, ``selective`` keeps the
    matmul and attention outputs and recomputes the rest (``selective_recompute_policy``), ``offload`` is ``full``
    with each block's kept input in host memory (``offload_checkpoints``).
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
    if policy == "offload":
        offload_checkpoints(model)
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    model.train()
    return model


__all__ = ["HostOffload", "apply_recompute", "offload_checkpoints", "selective_recompute_policy"]
