"""The optimizer registry: one ``OptimizerSpec`` per optimizer, the only place the loop, the ledger, autofit and the
settings learn what an optimizer is.

A spec says how to build the optimizer from the model and the training settings, how many bytes of state it keeps
(the ledger's "optimizer state" row), which memory tiers it can train, and which settings of its own it takes (a
frozen dataclass whose fields become flags, parsed only when the optimizer is chosen). Specs are torch-free, so
``--help`` and ``hf-cgpu budget`` stay quick; ``build`` may name its function as ``"module:function"`` to load torch
code only when a run starts.

    from hf_cgpu.optim import OptimizerSpec, register_optimizer
    register_optimizer(OptimizerSpec("sgd", "SGD with momentum", build=my_build, state_bytes=my_bytes))

``docs/extending.md`` walks through adding one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import SettingsError
from ..options import TIERS
from .adamw import ADAMW
from .muon import MUON
from .spec import OptimizerSpec

if TYPE_CHECKING:
    import torch

OPTIMIZERS: dict[str, OptimizerSpec] = {}
"""Every optimizer the settings accept, by name, in registration order (the first is the default)."""


def register_optimizer(spec: OptimizerSpec, replace: bool = False) -> OptimizerSpec:
    """Add ``spec`` to ``OPTIMIZERS`` (``replace`` to redefine a name); returns it."""
    if spec.name in OPTIMIZERS and not replace:
        raise ValueError(f"an optimizer named {spec.name!r} is registered already; pass replace=True to redefine it")
    unknown = set(spec.tiers) - set(TIERS)
    if unknown:
        raise ValueError(f"optimizer {spec.name!r} names unknown tiers {sorted(unknown)}; choose from {', '.join(TIERS)}")
    OPTIMIZERS[spec.name] = spec
    return spec


def unregister_optimizer(name: str) -> None:
    """Remove ``name`` from ``OPTIMIZERS`` (tests that registered a toy one)."""
    OPTIMIZERS.pop(name, None)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of ``name``, or one line naming the registered ones."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise SettingsError(f"optimizer={name!r}; choose one of {', '.join(OPTIMIZERS)}") from None


def optimizer_settings() -> dict[str, type | None]:
    """Each optimizer's own settings class (None: it has none), for the parser."""
    return {name: spec.settings for name, spec in OPTIMIZERS.items()}


def optimizer_choices() -> dict[str, str]:
    """Each optimizer's one-line summary, for ``--help``."""
    return {name: spec.summary for name, spec in OPTIMIZERS.items()}


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter that requires grad, each shared tensor once."""
    seen: set[int] = set()
    named = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            named.append((name, p))
    return named


def build_optimizer(model: torch.nn.Module, settings: Any, fused: bool | None = None) -> torch.optim.Optimizer:
    """The optimizer ``settings.optimizer`` names, over the trainable parameters of ``model``.

    ``fused=None`` uses torch's fused kernels when every parameter is on CUDA (the loop then skips a non-finite step on
    the device, ``train.update``); not on the CPU, where the fused AdamW's OpenMP region hangs in a forked child.
    """
    spec = optimizer_spec(settings.optimizer)
    named = trainable_parameters(model)
    if not named:
        what = "the 8-bit optimizer" if settings.tier == "adamw8bit" else f"optimizer {settings.optimizer}"
        raise SettingsError(f"{what} got no trainable parameters (all requires_grad=False): apply LoRA "
                            "(hf_cgpu.tiers.apply_tiers) for adapter tiers or unfreeze the model for full/adamw8bit")
    if fused is None:
        fused = all(p.is_cuda for _, p in named)
    return spec.builder()(model, named, settings, fused)


for _spec in (ADAMW, MUON):
    register_optimizer(_spec)

__all__ = ["OPTIMIZERS", "OptimizerSpec", "build_optimizer", "optimizer_choices", "optimizer_settings",
           "optimizer_spec", "register_optimizer", "trainable_parameters", "unregister_optimizer"]
