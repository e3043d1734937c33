"""The closed lists of choices the settings take, in one torch-free place that settings, ledger and loop import.

Open lists (optimizers, samplers, tasks, model cards, data formats) are registries of their own; these are the
choices whose meaning is written into the code that reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import SettingsError

TIERS = ("full", "adamw8bit", "lora", "qlora")
"""Memory tiers, least saving first: full (fp32 master weights, AdamW), adamw8bit (8-bit optimizer state), lora
(frozen bf16 base + adapters), qlora (frozen nf4 base + adapters). The ladder walks them in this order."""
ADAPTER_TIERS = ("lora", "qlora")
"""Tiers that train adapters on a frozen base: they need a pretrained model."""
TRAIN_MODES = ("pretrain", "finetune")
"""What a task starts from: random weights (pretrain) or a trained model (finetune)."""
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
"""torch.compile modes ``--compile_mode`` takes (``default`` is torch.compile's own)."""
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The compile modes that replay the compiled code as CUDA graphs (on CUDA)."""
RECOMPUTE_POLICIES = ("full", "selective", "offload")
"""What the backward of a checkpointed block re-runs: everything (full, and offload: full with each block's input
kept in host memory) or only the cheap ops (selective)."""
MIXED_PRECISIONS = ("auto", "bf16", "no")
"""auto: bf16 autocast where the GPU has it, else fp32."""
DATA_ORDERS = ("shifted", "random", "fixed")
"""How a language-model task cuts training windows from its token stream (``hf_cgpu.data.windows.WindowOrder``)."""
ATTN_IMPLEMENTATIONS = ("sdpa", "flex_attention", "eager")
"""Attention kernels a GPT run may train with (transformers' ``ALL_ATTENTION_FUNCTIONS``)."""
TIME_SAMPLINGS = ("uniform", "logit_normal")
"""Training-time distributions of flow matching (``hf_cgpu.flow.matching.FlowMatcher``)."""
VERIFY_MODES = ("auto", "sizes", "full", "off")
"""What a command that reads a saved folder checks of its manifest first (``hf_cgpu.verify.check_saved``): auto (the
sizes, and the SHA-256 too for a folder of at most ``verify.HASH_LIMIT`` bytes), sizes, full (every SHA-256) or off."""


def check_choice(name: str, value: str, allowed: Sequence[str], hint: str = "") -> None:
    """One line naming the setting, the value and the choices when ``value`` is not one of ``allowed``."""
    if value not in allowed:
        raise SettingsError(f"{name}={value!r}; choose one of {', '.join(allowed)}{hint}")


def check_tier(tier: str, train_mode: str = "") -> None:
    """Whether ``tier`` can train a model that starts from ``train_mode`` (empty: not known yet): adapters on a frozen
    random base learn nothing, so the adapter tiers are fine-tuning only."""
    if tier not in TIERS:
        raise SettingsError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
    if train_mode:
        check_choice("train_mode", train_mode, TRAIN_MODES)
    if train_mode == "pretrain" and tier in ADAPTER_TIERS:
        what = "a frozen 4-bit base" if tier == "qlora" else "a frozen pretrained base"
        raise SettingsError(f"{tier} is a fine-tuning tier: it trains adapters on {what}, and a frozen random base "
                            "learns nothing; use --tier full or --tier adamw8bit for pretraining")


__all__ = ["ADAPTER_TIERS", "ATTN_IMPLEMENTATIONS", "COMPILE_MODES", "CUDA_GRAPH_MODES", "DATA_ORDERS",
           "MIXED_PRECISIONS", "RECOMPUTE_POLICIES", "TIERS", "TIME_SAMPLINGS", "TRAIN_MODES", "VERIFY_MODES",
           "check_choice", "check_tier"]
