"""LoRA adapters on a frozen base (tiers lora and qlora), through peft.

The base stays in its own dtype (bf16, or nf4 whose linears compute in bf16) and only the adapters are fp32: peft's
``prepare_model_for_kbit_training`` would upcast every non-4-bit weight (embeddings, head, norms) to fp32, doubling
those weights and turning the residual stream and every checkpointed activation fp32.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from ..errors import SettingsError
from .load import freeze


LORA_TARGET_MODULES: dict[str, list[str]] = {
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "cgpt": ["qkv", "proj", "fc", "fc_out"],
}
"""LoRA targets per architecture: every linear of attention and MLP (the QLoRA paper: all-linear matches full
fine-tuning, attention-only does not)."""


def default_target_modules(model_type: str | None) -> list[str] | str:
    """LoRA target module names for a `config.model_type`; "all-linear" (peft skips the head) otherwise."""
    targets = LORA_TARGET_MODULES.get(model_type or "")
    return list(targets) if targets is not None else "all-linear"


@contextlib.contextmanager
def peft_quiet():
    """Around peft's model wrapping: without the FutureWarning it triggers on transformers 5.23+ (it reads the
    deprecated ``is_gradient_checkpointing``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def apply_lora(
    model: nn.Module,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: list[str] | str | None = None,
) -> nn.Module:
    """Wrap `model` in a peft LoRA model: frozen base in its own dtype, fp32 trainable adapters.

    Deliberately not `prepare_model_for_kbit_training`: that upcasts every non-4-bit weight to fp32
    (embeddings, head, norms), which doubles those weights and turns the residual stream fp32. Input grads for
    checkpointing are enabled by `apply_recompute`.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if target_modules is None:
        target_modules = default_target_modules(model_type)
    freeze(model)
    lora_config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        bias="none",
        fan_in_fan_out=model_type == "gpt2",  # GPT-2's Conv1D stores weights transposed
        task_type="CAUSAL_LM" if isinstance(model, PreTrainedModel) else None,
    )
    if isinstance(target_modules, (list, tuple, set)):
        names = [n for n, _ in model.named_modules() if n]  # peft's list rule: a name, or a dotted suffix of one
        missing = sorted(k for k in set(target_modules) if not any(n == k or n.endswith("." + k) for n in names))
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if n and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")})
            raise SettingsError(f"--lora_target_modules: {', '.join(missing)} is no module of this "
                                f"{type(model).__name__}; its linear layers are {', '.join(linear)}")
    with peft_quiet():
        peft_model = get_peft_model(model, lora_config, autocast_adapter_dtype=True)
    for p in peft_model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # fp32 adapters: their updates are tiny relative to bf16 steps
    return peft_model


__all__ = ["LORA_TARGET_MODULES", "apply_lora", "default_target_modules", "peft_quiet"]
