"""Flow matching for small images: the math, a UNet, Euler/Heun schedulers and a diffusers pipeline.

Time convention everywhere: t = 0 is noise, t = 1 is data, xt = (1 - t) x0 + t x1, velocity ut = x1 - x0
(see ``matching``). The model, scheduler and pipeline files import only torch/diffusers so they can be copied
next to saved weights for ``trust_remote_code`` loading.

Exports resolve lazily (PEP 562): ``diffusers.pipelines`` alone takes seconds to import on a small CPU, and the
2D toy, which only needs the math and the schedulers, should not pay for it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "matching": [
        "FlowMatcher",
        "conditional_velocity",
        "drop_labels",
        "from_diffusers_timestep",
        "guided_velocity",
        "interpolate",
        "to_diffusers_timestep",
        "to_diffusers_velocity",
    ],
    "scheduling_flow_match": [
        "FlowMatchEulerScheduler",
        "FlowMatchHeunScheduler",
        "FlowMatchScheduler",
        "FlowMatchSchedulerOutput",
        "sample_ode",
        "time_grid",
    ],
    "unet": ["FlowUNet2DModel", "FlowUNet2DOutput", "sinusoidal_embedding"],
    "pipeline_flow_match": ["FlowMatchPipeline", "save_for_remote_code"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hf_cgpu.flow' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
