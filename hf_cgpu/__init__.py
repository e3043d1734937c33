"""hf_cgpu: train real small models on one consumer GPU with the Hugging Face stack.

Heavy pieces are imported on first use, so ``import hf_cgpu`` stays quick.
"""

from .models.cgpt import CgptConfig, CgptForCausalLM

__version__ = "0.1.0"

_LAZY = {
    "FlowMatchPipeline": "hf_cgpu.flow.pipeline_flow_match",
    "FlowUNet2DModel": "hf_cgpu.flow.unet",
    "FlowMatchEulerScheduler": "hf_cgpu.flow.scheduling_flow_match",
    "FlowMatchHeunScheduler": "hf_cgpu.flow.scheduling_flow_match",
    "fit": "hf_cgpu.train",
    "TrainSettings": "hf_cgpu.settings",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_cgpu' has no attribute {name!r}")


__all__ = ["CgptConfig", "CgptForCausalLM", *_LAZY]
