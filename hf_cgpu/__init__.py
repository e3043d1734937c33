"""hf_cgpu: train real small models on one consumer GPU with the Hugging Face stack.

``import hf_cgpu`` imports neither torch nor transformers: every name below loads its module on first use, and
the GPT's transformers Auto registration (``AutoModelForCausalLM.from_pretrained(dir)`` without
``trust_remote_code``) runs when transformers itself is imported (a post-import hook, ``wrapt``), or at once
when it already is.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "CgptConfig": "hf_cgpu.models.cgpt",
    "CgptForCausalLM": "hf_cgpu.models.cgpt",
    "FlowMatchPipeline": "hf_cgpu.flow.pipeline_flow_match",
    "FlowUNet2DModel": "hf_cgpu.flow.unet",
    "FlowMatchEulerScheduler": "hf_cgpu.flow.scheduling_flow_match",
    "FlowMatchHeunScheduler": "hf_cgpu.flow.scheduling_flow_match",
    "fit": "hf_cgpu.train",
    "TrainSettings": "hf_cgpu.settings",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_cgpu' has no attribute {name!r}")


def _register_auto_classes(_transformers=None) -> None:
    """Register the GPT with transformers' Auto classes."""
    importlib.import_module("hf_cgpu.models.cgpt").register()


def _install_registration_hook() -> None:
    import sys

    if "transformers" in sys.modules:  # already paid for: register now
        _register_auto_classes()
        return
    try:
        from wrapt import register_post_import_hook
    except ImportError:  # without wrapt: register eagerly, as before
        _register_auto_classes()
        return
    register_post_import_hook(_register_auto_classes, "transformers")


BNB_KERNELS_LOGGER = "bitsandbytes.backends.cpu.ops"
"""bitsandbytes' CPU backend, which on a CPU with AVX512-BF16 warns at import that the optional ``kernels`` package
(a faster 4-bit matmul fetched from the Hub) is missing. diffusers and accelerate import bitsandbytes whatever the
tier, so the line came with every command; the fallback it takes computes the same result."""


class _NoKernelsHint:
    """Drops exactly that warning; anything else bitsandbytes logs passes."""

    @staticmethod
    def filter(record) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


def _quiet_bitsandbytes() -> None:
    import logging

    logging.getLogger(BNB_KERNELS_LOGGER).addFilter(_NoKernelsHint)


_install_registration_hook()
_quiet_bitsandbytes()

__all__ = [*_LAZY]
