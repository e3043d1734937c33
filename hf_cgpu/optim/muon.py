"""Muon on the 2-D hidden weight matrices, AdamW on embeddings, head, norms and biases (tier full).

Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/) replaces each update of a weight matrix by its
orthogonalised Nesterov momentum; ``muon_optimizer.MuonWithAdamW`` runs torch's ``torch.optim.Muon`` algorithm and
AdamW as one optimizer. This file is its registry entry: settings, state bytes, tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SettingsError
from .adamw import ADAM_STATE_BYTES
from .spec import OptimizerSpec, Tensors

MUON_STATE_BYTES = 4
"""torch.optim.Muon keeps one fp32 momentum buffer per parameter (Newton-Schulz runs on a bf16 copy of one matrix
at a time, inside the workspace)."""


@dataclass(frozen=True)
class MuonSettings:
    """Muon's own settings; its AdamW part uses learning_rate, weight_decay and adam_*."""

    muon_learning_rate: float = 0.02
    """Peak learning rate of the Muon matrices; follows the same warmup and cosine schedule."""
    muon_momentum: float = 0.95
    """Muon's Nesterov momentum."""
    muon_weight_decay: float = 0.0
    """Decoupled weight decay of the Muon matrices, times their learning rate (Keller Jordan's default 0)."""

    def __post_init__(self) -> None:
        if self.muon_learning_rate <= 0 or not 0 <= self.muon_momentum < 1 or self.muon_weight_decay < 0:
            raise SettingsError("muon_learning_rate must be > 0, muon_momentum in [0, 1) and muon_weight_decay >= 0; "
                                "e.g. --muon_learning_rate 0.02 --muon_momentum 0.95")


def state_bytes(tensors: Tensors, tier: str) -> tuple[float, str]:
    """One fp32 momentum buffer for the block matrices, AdamW's two for the rest."""
    muon = sum(n for n, kind in tensors if kind == "linear")
    rest = sum(n for n, kind in tensors if kind != "linear")
    return (MUON_STATE_BYTES * muon + ADAM_STATE_BYTES * rest,
            f"Muon momentum fp32 4 B/param on the {muon / 1e6:.1f}M block matrices, AdamW m, v 8 B/param on the rest")


MUON = OptimizerSpec(
    "muon", "Muon (orthogonalised Nesterov momentum) on the 2-D hidden matrices, AdamW on the rest",
    build="hf_cgpu.optim.muon_optimizer:build", state_bytes=state_bytes, tiers=("full",), settings=MuonSettings,
    label="Muon + AdamW",
)

__all__ = ["MUON", "MuonSettings"]
