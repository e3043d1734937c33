"""torch.compile of the model in place, as the tiers need it: a plain model whole, an adapter model block by block
with each block's checkpoint moved inside the compiled region."""

from __future__ import annotations

import functools
import types

import torch
from torch import nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks: transformers' `GradientCheckpointingLayer`s, else the largest ModuleList."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - older transformers
        GradientCheckpointingLayer = ()  # type: ignore[assignment]
    blocks = [m for m in model.modules() if GradientCheckpointingLayer and isinstance(m, GradientCheckpointingLayer)]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    return list(max(lists, key=len)) if lists else []


def apply_compile(model: nn.Module, enabled: bool, mode: str | None = None, backend: str = "inductor") -> nn.Module:
    """`torch.compile(dynamic=False)` in place (`Module.compile`): parameter names keep no `_orig_mod.` prefix.

    A plain model is compiled whole, so the head and the loss fuse with the blocks (faster than blocks alone,
    benchmarks/RESULTS.md). An adapter (peft) model compiles each transformer block instead: peft's wrappers and
    `causal_lm_loss_from_hidden`, which calls the backbone directly, then still run compiled code. Identical blocks
    share one graph: the frozen embedding's output is made to require grad (``enable_input_require_grads``), else the
    first block's input differs from the others' in ``requires_grad`` and dynamo compiles that block a second time.
    `dynamic=False` because a second shape would compile a dynamic graph. `backend` is inductor but for tests
    ("eager" and "aot_eager" trace with dynamo's guards, so recompiles are the same, without codegen).
    """
    if not enabled:
        return model
    blocks = transformer_blocks(model) if hasattr(model, "peft_config") else []
    if blocks and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    how = compile_options(model, mode, backend)
    for block in blocks:
        _checkpoint_inside(block)
    for block in blocks or [model]:
        block.compile(dynamic=False, backend=backend, **how)
    return model


def _checkpointed_forward(self, *args, **kwargs):
    forward = type(self).forward  # the class's function, bound by partial: dynamo breaks the graph on __get__
    if self.training and torch.is_grad_enabled():
        return self._hf_cgpu_checkpoint(functools.partial(forward, self, **kwargs), *args)
    return forward(self, *args, **kwargs)


def _checkpoint_inside(block: nn.Module) -> None:
    """Move a checkpointed block's checkpoint from transformers' wrapper into the block's own ``forward``, i.e. into
    the region ``Module.compile`` compiles. Where transformers checkpoints a layer in ``__call__`` (outside the
    compiled ``_call_impl``), the backward replays the compiled forward eagerly and a selective policy never reaches
    the traced ops; inside, dynamo traces the checkpoint into the block's graph, so the backward graph holds the
    recompute and the policy decides what is saved. Same checkpoint function, same arguments; no-op when the block is
    not checkpointed."""
    func = getattr(block, "_gradient_checkpointing_func", None)
    if not getattr(block, "gradient_checkpointing", False) or func is None:
        return
    block.gradient_checkpointing = False  # transformers' wrapper (either version) now calls the block as is
    block._hf_cgpu_checkpoint = func
    block.forward = types.MethodType(_checkpointed_forward, block)


def compile_options(model: nn.Module, mode: str | None, backend: str = "inductor") -> dict:
    """torch.compile's ``mode`` / ``options`` for ``model``: a model whose convolution weights are channels_last keeps
    channels_last inside inductor (``force_layout_optimization``, with the mode's own options merged in, since
    torch.compile takes one or the other). Inductor's heuristic turns its layout optimization off for a whole graph
    when one convolution has at least twice as many input as output channels (a UNet decoder's concatenated skips);
    the backward would then feed NCHW tensors to cuDNN, which copies activation-sized tensors back to channels_last."""
    convs = [p for p in model.parameters() if p.dim() == 4]  # 1x1 kernels are both layouts at once
    channels_last = all(p.is_contiguous(memory_format=torch.channels_last) for p in convs) and any(
        not p.is_contiguous() for p in convs)
    if backend != "inductor" or not channels_last:
        return {"mode": mode}
    from torch._inductor import list_mode_options  # inductor loads only for a channels_last model

    return {"options": {**list_mode_options(mode or "default"), "force_layout_optimization": True}}


__all__ = ["apply_compile", "compile_options", "transformer_blocks"]
