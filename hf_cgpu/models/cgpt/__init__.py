"""The hf_cgpu GPT: ``CgptConfig`` and ``CgptForCausalLM`` (a transformers ``PreTrainedModel`` + ``GenerationMixin``).

The package itself imports neither torch nor transformers, so the settings can read the architecture options
(``options_cgpt``) for ``--help`` and ``hf-cgpu budget``; the model classes load on first use. ``register()`` adds
them to transformers' Auto classes (``import hf_cgpu`` calls it once transformers is imported), so
``AutoModelForCausalLM.from_pretrained(dir)`` needs no ``trust_remote_code``; a saved folder also carries the model
files (``register_for_auto_class`` in each), so ``trust_remote_code=True`` loads it without hf_cgpu installed.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_EXPORTS = {"CgptConfig": "configuration_cgpt", "CgptForCausalLM": "modeling_cgpt", "CgptModel": "modeling_cgpt",
            "chunked_cross_entropy": "modeling_cgpt"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    register()
    return value


def _importing(module: str) -> bool:
    """True while ``module`` is being imported (its import set off the one of transformers that called ``register``)."""
    found = sys.modules.get(f"{__name__}.{module}")
    return found is not None and getattr(getattr(found, "__spec__", None), "_initializing", False)


def register() -> None:
    """Register the GPT with transformers' AutoConfig, AutoModel and AutoModelForCausalLM (idempotent). Deferred while
    one of the model files is still being imported: the first use of a name of this package registers then."""
    if _importing("configuration_cgpt") or _importing("modeling_cgpt"):
        return
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .configuration_cgpt import CgptConfig
    from .modeling_cgpt import CgptForCausalLM, CgptModel

    AutoConfig.register(CgptConfig.model_type, CgptConfig, exist_ok=True)
    AutoModel.register(CgptConfig, CgptModel, exist_ok=True)
    AutoModelForCausalLM.register(CgptConfig, CgptForCausalLM, exist_ok=True)


__all__ = [*_EXPORTS, "register"]
