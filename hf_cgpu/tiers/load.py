"""The base model as a tier needs it: fp32 master weights (full, adamw8bit), a frozen bf16 base (lora) or a frozen
nf4 base (qlora)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..options import ADAPTER_TIERS


def freeze(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)


def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (AVX512-BF16 or AMX); elsewhere a bf16 matmul is emulated,
    several times slower than fp32."""
    return any(getattr(torch.cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported",
                                                                         "_is_amx_tile_supported"))


def base_dtype(tier: str, device: torch.device | str | None = None) -> torch.dtype:
    """The tier's weights: bf16 for a frozen adapter base (it needs no fp32 copy), except a LoRA base on a CPU
    without bf16 arithmetic (fp32: faster there); fp32 master weights for the tiers that train every weight."""
    if tier not in ADAPTER_TIERS:
        return torch.float32
    if tier == "lora" and device is not None and torch.device(device).type == "cpu" and not cpu_has_bf16():
        return torch.float32
    return torch.bfloat16


def load_base_model(
    name_or_path: str,
    tier: str,
    dtype: torch.dtype | None = None,
    device_map: Any = None,
    trust_remote_code: bool = False,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Load a causal LM with the weights the tier needs; adapter tiers come back frozen.

    `dtype=None` picks the tier's default on ``device`` (``base_dtype``): bf16 for lora/qlora (a frozen base needs
    no fp32 copy; fp32 for lora on a CPU without bf16 arithmetic) and fp32 for full/adamw8bit, which train every weight and need fp32 master weights under bf16
    autocast (pure-bf16 AdamW loses updates smaller than 2^-8 of the weight).
    qlora stores linears in nf4 (the bitsandbytes default is fp4, worse for normal weights), double
    quantizes the block scales (~0.4 bit/param saved) and computes in bf16.
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if dtype is None:
        dtype = base_dtype(tier, device)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if tier == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if tier in ADAPTER_TIERS:
        freeze(model)
    return model


def is_4bit(model: nn.Module) -> bool:
    if getattr(model, "is_loaded_in_4bit", False):
        return True
    return any(type(m).__name__ == "Linear4bit" for m in model.modules())


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters, counting each shared tensor once.

    bitsandbytes `Params4bit` stores two 4-bit values per uint8 element, so its `numel()` is half the
    logical count; the logical shape is in `quant_state.shape`.
    """
    trainable = total = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        quant_state = getattr(p, "quant_state", None)
        n = quant_state.shape.numel() if quant_state is not None else p.numel()
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


__all__ = ["base_dtype", "count_parameters", "cpu_has_bf16", "freeze", "is_4bit", "load_base_model"]
