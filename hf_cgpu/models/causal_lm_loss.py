"""A causal LM's loss without its full logits: the backbone's hidden states, then cross-entropy in checkpointed chunks.

Works for transformers causal LMs (peft-wrapped or compiled in place): the (B, T, vocab) fp32 logits, which for a
large vocabulary outweigh every activation of the step, never exist at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .cgpt.modeling_cgpt import chunked_cross_entropy


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    shift: bool = True,
    lm_head_bias: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy without materialising the (B, T, V) logits.

    hidden_states (B, T, d) are the final-norm outputs; labels (B, T) are the input ids when `shift`
    (token t predicts label t+1, as transformers' `ForCausalLMLoss`), already aligned otherwise.
    Tokens are processed in chunks of `chunk_size`; each chunk's logits are built in fp32 inside a
    non-reentrant checkpoint that saves only its inputs, so one (chunk, V) block is alive at a time
    in forward and again in backward. Same value and gradients as the full computation.
    `num_items_in_batch` divides the summed loss instead of the local token count (for gradient
    accumulation over micro-batches of uneven token counts).
    """
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # (B, T), last position ignored
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # (N, d)
    labels = labels.reshape(-1).to(hidden.device)  # (N,)
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden_states has {hidden.shape[0]} tokens but labels has {labels.shape[0]}")
    return chunked_cross_entropy(hidden, lm_head_weight, labels, chunk_size, bias=lm_head_bias,
                                 ignore_index=ignore_index, denominator=num_items_in_batch)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model under `torch.compile`'s wrapper and peft's `PeftModel`."""
    model = getattr(model, "_orig_mod", model)
    if hasattr(model, "get_base_model"):  # peft: LoRA layers stay injected in the returned model
        model = model.get_base_model()
    return model


def _backbone(lm: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (everything before the head)."""
    if hasattr(lm, "get_decoder"):
        try:
            decoder = lm.get_decoder()
        except (NotImplementedError, AttributeError, ValueError):
            decoder = None
        if decoder is not None and decoder is not lm:
            return decoder
    base = getattr(lm, "base_model", None)
    if base is not None and base is not lm:
        return base
    raise ValueError(f"cannot find the backbone of {type(lm).__name__}: expose get_decoder() or base_model_prefix")


def causal_lm_loss_from_hidden(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    shift: bool = True,
    **backbone_kwargs: Any,
) -> torch.Tensor:
    """The model's causal LM loss via its backbone and `chunked_causal_lm_loss`: no full logits.

    `labels` are the input ids when `shift` (HF convention), targets already aligned with the positions otherwise.

    Works for transformers causal LMs, peft-wrapped or compiled in place. It calls the backbone
    directly, so it bypasses the autocast that `accelerator.prepare` patches onto `model.forward`:
    call it under `accelerator.autocast()`. Heads with LoRA adapters, logit soft-capping or logit
    scaling are rejected because the chunked loss would silently skip them.
    """
    hidden, head = _hidden_and_head(model, input_ids, attention_mask, **backbone_kwargs)
    return chunked_causal_lm_loss(
        hidden,
        head.weight,
        labels,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        shift=shift,
        lm_head_bias=getattr(head, "bias", None),
        num_items_in_batch=num_items_in_batch,
    )


def _hidden_and_head(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     **backbone_kwargs: Any) -> tuple[torch.Tensor, nn.Module]:
    """The backbone's last hidden states (B, T, d) and the output head, for a loss that applies the head in chunks."""
    lm = unwrap_model(model)
    config = getattr(lm, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            raise NotImplementedError(f"{type(lm).__name__} uses {attr}: use the model's own labels= loss")
    head = lm.get_output_embeddings()
    if head is None or hasattr(head, "base_layer"):
        raise ValueError("the output head is missing or has LoRA adapters: use the model's own labels= loss")
    backbone = _backbone(lm)
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **backbone_kwargs)
    return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]), head


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    ignore_index: int) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # (n, V): matmul in the operands' dtype, softmax in fp32
    return -F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")


def token_logprobs_from_hidden(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor,
                               chunk_size: int = 1024, ignore_index: int = -100,
                               **backbone_kwargs: Any) -> torch.Tensor:
    """(B, T) fp32 log-probability of each already aligned target (0 where ``ignore_index``), the head applied in
    checkpointed chunks of ``chunk_size`` tokens as ``causal_lm_loss_from_hidden`` does: the (B, T, vocab) logits never
    exist at once. Call it under ``accelerator.autocast()``."""
    hidden, head = _hidden_and_head(model, input_ids, **backbone_kwargs)
    flat, labels = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).to(hidden.device)
    bias, parts = getattr(head, "bias", None), []
    for start in range(0, flat.shape[0], chunk_size):
        args = (flat[start : start + chunk_size], head.weight, bias, labels[start : start + chunk_size], ignore_index)
        if torch.is_grad_enabled() and flat.requires_grad:
            parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(*args))
    return torch.cat(parts).reshape(targets.shape)


__all__ = ["causal_lm_loss_from_hidden", "chunked_causal_lm_loss", "token_logprobs_from_hidden", "unwrap_model"]
