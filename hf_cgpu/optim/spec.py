"""What the registry knows of one optimizer (``OptimizerSpec``), torch-free."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..options import TIERS

Tensors = Sequence[tuple[int, str]]
"""Trainable tensors as (elements, kind); kind is embedding | head | linear | bias | norm | adapter (a block linear of
the model is "linear", a LoRA matrix "adapter")."""


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer: how it is built, what state it keeps, where it can run, and its own settings."""

    name: str
    """What ``--optimizer`` takes."""
    summary: str
    """One line for ``--help`` and the ledger."""
    build: Callable[..., Any] | str
    """``(model, named trainable parameters, TrainSettings, fused) -> torch.optim.Optimizer``, or the
    ``"module:function"`` that holds it (loaded when a run starts, so the spec stays torch-free)."""
    state_bytes: Callable[[Tensors, str], tuple[float, str]]
    """``(trainable tensors, tier) -> (bytes of optimizer state, how they are counted)``: the ledger's row."""
    tiers: tuple[str, ...] = TIERS
    """Memory tiers it can train (a tier outside is refused when the settings are validated)."""
    settings: type | None = None
    """Its own frozen settings dataclass (fields become flags; chosen with ``--optimizer NAME``), or None."""
    label: str = ""
    """How the ledger names it in a run's description (empty: ``name``)."""

    def __post_init__(self) -> None:
        unknown = set(self.tiers) - set(TIERS)
        if unknown:
            raise ValueError(f"optimizer {self.name!r} names unknown tiers {sorted(unknown)}; choose from "
                             f"{', '.join(TIERS)}")
        if not self.label:
            object.__setattr__(self, "label", self.name)

    def builder(self) -> Callable[..., Any]:
        if callable(self.build):
            return self.build
        module, _, function = self.build.partition(":")
        return getattr(importlib.import_module(module), function)


__all__ = ["OptimizerSpec", "Tensors"]
