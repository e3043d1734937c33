"""The peers the memory benchmark measures hf_cgpu's ledger against, as the ledger counts them.

Not hf_cgpu tiers, so kept out of the package:

- stock peft, what a user following the peft / bitsandbytes docs writes (``bench_memory.stock_peft``): LoRA on a bf16
  model without autocast (peft casts every adapted input to fp32 and saves it), QLoRA through
  ``prepare_model_for_kbit_training`` (embeddings, head and norms fp32, so the residual stream and every activation
  fp32); both compute the model's own full-logits loss. ``stock_ledger`` counts them with ``hf_cgpu.budget.ledger``
  and a ``Regime`` of their own.
- the seed chapter's rules of thumb: 16 bytes per parameter for mixed-precision AdamW, ~34 d bytes per token per
  layer of activations (~2 d with full recompute), a flat 1.2 GB reserve.
"""

from __future__ import annotations

import dataclasses

from hf_cgpu.budget.memory import BF16, FP32, GiB, Regime, ledger
from hf_cgpu.budget.shape import ModelShape, TrainSetup

STOCK_REGIMES: dict[str, Regime] = {
    "lora": Regime(autocast=False, norm_save=BF16, norm_shared=True, norm_out=BF16, proj_out=BF16, attn=BF16,
                   resid=BF16, base_trainable=False, adapter_copy=FP32, logits=BF16),
    "qlora": Regime(autocast=False, norm_save=FP32, norm_shared=True, norm_out=FP32, proj_out=FP32, attn=FP32,
                    resid=FP32, base_trainable=False, adapter_copy=0, logits=FP32, rest_weights=FP32),
}
"""How stock peft runs a block: LoRA, a bf16 model without autocast, peft casting each adapted input to fp32 (4 B
saved per adapter); QLoRA, fp32 embeddings and norms making every activation fp32, the fp32 adapters sharing their
fp32 inputs, attention in fp32 (the memory-efficient kernel), the unquantized weights fp32."""

STOCK_LOGITS_HELD = False
"""Whether the peer's loop keeps the model's logits alive across ``backward()``: the benchmark's loop takes
``model(...).loss`` at once, as the HF Trainer does, so nothing references the logits after the forward."""


def stock_ledger(shape: ModelShape, setup: TrainSetup, memory_cap: float | None = None):
    """The ledger of stock peft's LoRA/QLoRA for ``setup``'s tier: its regime and the model's full-logits loss."""
    setup = dataclasses.replace(setup, loss_chunk_size=0)
    return ledger(shape, setup, memory_cap, regime=STOCK_REGIMES[setup.tier], logits_held=STOCK_LOGITS_HELD)


# ---- the seed chapter's rules -------------------------------------------------------------------------------------
SEED_STATE_BYTES_PER_PARAM = 16
"""bf16 weights 2 + bf16 grads 2 + fp32 master 4 + Adam m, v 8."""
SEED_ACT_BYTES_PER_D = 34
SEED_RECOMPUTE_BYTES_PER_D = 2
SEED_RESERVED_BYTES = int(1.2 * GiB)


def seed_model_state_bytes(params: float, bytes_per_param: int = SEED_STATE_BYTES_PER_PARAM) -> float:
    """The seed's mixed-precision AdamW: 16 bytes per parameter (its "GB" is GiB)."""
    return bytes_per_param * params


def seed_activation_bytes(n_layer: int, d_model: int, seq_len: int, micro_batch_size: int, recompute: bool) -> float:
    """The seed's rule: ~34 d bytes per token per layer (bf16, no recompute), ~2 d with full-layer recompute."""
    per_d = SEED_RECOMPUTE_BYTES_PER_D if recompute else SEED_ACT_BYTES_PER_D
    return n_layer * seq_len * micro_batch_size * per_d * d_model


__all__ = ["STOCK_REGIMES", "seed_activation_bytes", "seed_model_state_bytes", "stock_ledger"]
