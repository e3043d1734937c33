"""Memory tiers: the model as the loop trains it, made by small steps applied in one fixed order (``apply_tiers``).

    load.load_base_model      fp32 master weights (full, adamw8bit), a frozen bf16 base (lora), a frozen nf4 base
    1. lora.apply_lora         adapters on the frozen base (lora, qlora); full and adamw8bit train every weight
    2. recompute.apply_recompute  activation checkpointing of every block, the cache off
    3. compile.apply_compile   torch.compile(dynamic=False), in place
    4. accelerate's prepare    done by the loop, which also builds the optimizer (``hf_cgpu.optim``)

Adapters come first because checkpointing and compile must see the final modules (compiling before LoRA injection
would trace the bare base layers); checkpointing comes before compile so the compiled region holds the checkpoint,
as torchtitan does. Which tier a run may use is settled when its settings are validated (``options.check_tier``).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from ..errors import SettingsError
from ..options import ADAPTER_TIERS
from .compile import apply_compile, compile_options, transformer_blocks
from .load import count_parameters, is_4bit, load_base_model
from .lora import LORA_TARGET_MODULES, apply_lora, default_target_modules, peft_quiet
from .recompute import apply_recompute, selective_recompute_policy


def apply_tiers(model: nn.Module, settings: Any, compile: bool | None = None, backend: str = "inductor") -> nn.Module:
    """Apply ``settings``' tier, recompute and compile (``compile`` None: ``settings.compile``) in the one fixed order.

    The returned model is what the loop must use (a ``PeftModel`` for the adapter tiers)."""
    s = settings
    compile = s.compile if compile is None else compile
    if s.tier == "qlora" and not is_4bit(model):
        raise SettingsError("tier qlora needs a 4-bit base: load it with load_base_model(name, tier='qlora')")
    if s.tier in ADAPTER_TIERS and not hasattr(model, "peft_config"):  # a PeftModel: its loaded adapter is trained
        targets = [m for m in s.lora_target_modules.split(",") if m] or None
        model = apply_lora(model, r=s.lora_r, alpha=s.lora_alpha, dropout=s.lora_dropout, target_modules=targets)
    if s.recompute:
        if s.recompute_policy == "selective" and not compile:
            warnings.warn("selective recompute without compile runs a Python policy on every op, slower than full "
                          "recompute; use compile=True or recompute_policy='full'", stacklevel=2)
        model = apply_recompute(model, s.recompute_policy)
    model = apply_compile(model, compile, mode=None if s.compile_mode == "default" else s.compile_mode,
                          backend=backend)
    model.train()
    return model


__all__ = ["LORA_TARGET_MODULES", "apply_compile", "apply_lora", "apply_recompute", "apply_tiers", "compile_options",
           "count_parameters", "default_target_modules", "is_4bit", "load_base_model", "peft_quiet",
           "selective_recompute_policy", "transformer_blocks"]
