"""The optimizer registry: one ``OptimizerSpec`` per optimizer, the only place the loop, the ledger, autofit and the
settings learn what an optimizer is.

A spec says how to build the optimizer from the model and the training settings, how many bytes of state it keeps
(the ledger's "optimizer state" row), which memory tiers it can train, and which settings of its own it takes (a
frozen dataclass whose fields become flags, parsed only when the optimizer is chosen). Specs are torch-free, so
``--help`` and ``hf-cgpu budget`` stay quick; ``build`` may name its function as ``"module:function"`` to load torch
code only when a run starts.

    from hf_cgpu.optim import OPTIMIZERS, OptimizerSpec
    OPTIMIZERS.add("sgd", OptimizerSpec("sgd", "SGD with momentum", build=my_build, state_bytes=my_bytes))

``docs/extending.md`` walks through adding one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import SettingsError
from ..registry import Registry
from .adamw import ADAMW
from .muon import MUON
from .spec import OptimizerSpec

if TYPE_CHECKING:
    import torch

OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer")
"""Every optimizer the settings accept, by name, in registration order."""
for _spec in (ADAMW, MUON):
    OPTIMIZERS.add(_spec.name, _spec)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of ``name``, or one line naming the registered ones."""
    return OPTIMIZERS.lookup(name)


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


def build_optimizer(model: torch.nn.Module, settings: Any, fused: bool | None = None,
                    also: Sequence[torch.nn.Module] = ()) -> torch.optim.Optimizer:
    """The optimizer ``settings.optimizer`` names, over the trainable parameters of ``model`` and of the modules
    ``also`` trained with it (a task's companion heads; grouped as parameters outside the model: AdamW, decayed where
    2-D).

    ``fused=None`` uses torch's fused kernels when every parameter is on CUDA (the loop then skips a non-finite step on
    the device, ``train.update``); not on the CPU, where the fused AdamW's OpenMP region hangs in a forked child.
    """
    spec = optimizer_spec(settings.optimizer)
    named = trainable_parameters(model)
    if not named:
        what = "the 8-bit optimizer" if settings.tier == "adamw8bit" else f"optimizer {settings.optimizer}"
        raise SettingsError(f"{what} got no trainable parameters (all requires_grad=False): apply LoRA "
                            "(hf_cgpu.tiers.apply_tiers) for adapter tiers or unfreeze the model for full/adamw8bit")
    named += [(f"companion_{i}.{name}", p) for i, m in enumerate(also) for name, p in trainable_parameters(m)]
    if fused is None:
        fused = all(p.is_cuda for _, p in named)
    optimizer = spec.builder()(model, named, settings, fused)
    embed_lr = getattr(settings, "embedding_learning_rate", 0.0)
    if embed_lr and not any(g.get("lr_scale") == embed_lr / settings.learning_rate for g in optimizer.param_groups):
        raise SettingsError(f"optimizer {settings.optimizer} does not take --embedding_learning_rate (its builder "
                            "makes no group for the tables: hf_cgpu.optim.groups.with_embedding_lr); drop the flag")
    return optimizer

__all__ = ["OPTIMIZERS", "OptimizerSpec", "build_optimizer", "optimizer_choices", "optimizer_settings",
           "optimizer_spec", "trainable_parameters"]
