"""The sampler registry: name -> the scheduler class that integrates the flow from noise to data.

Every place that samples (``hf-cgpu sample``, ``hf-cgpu eval``, the training run's sample grids, the 2D toy) takes
its sampler from here, and the network evaluations an image costs are counted from the scheduler itself: the model
calls its ``timesteps`` hold after ``set_timesteps(steps)`` (Euler: one a step; Heun: two a step but the last), each
doubled by classifier-free guidance. A scheduler is a diffusers ``SchedulerMixin`` in our time convention (t = 0
noise, t = 1 data; ``hf_cgpu.flow.scheduling_flow_match``); entries may name it as ``"module:Class"`` so the settings
stay free of diffusers.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from ..errors import SettingsError
from ..registry import Registry

SAMPLERS: Registry[type | str] = Registry("sampler")
"""Every sampler the commands and settings accept: name -> the scheduler class, or the ``"module:Class"`` holding it."""
SAMPLERS.add("euler", "hf_cgpu.flow.scheduling_flow_match:FlowMatchEulerScheduler")
SAMPLERS.add("heun", "hf_cgpu.flow.scheduling_flow_match:FlowMatchHeunScheduler")


def sampler_names() -> list[str]:
    """The registered samplers' names (``--help`` lists them)."""
    return list(SAMPLERS)


def check_sampler(name: str, flag: str = "--scheduler") -> None:
    """One line naming the registered samplers when ``name`` is none of them."""
    if name not in SAMPLERS:
        raise SettingsError(f"{flag} {name!r}; choose {' or '.join(SAMPLERS)}")


def sampler_class(name: str) -> type:
    check_sampler(name)
    found = SAMPLERS[name]
    if isinstance(found, str):
        module, _, cls = found.partition(":")
        return getattr(importlib.import_module(module), cls)
    return found


@lru_cache(maxsize=None)
def _calls(scheduler_class: type, steps: int) -> int:
    scheduler = scheduler_class()
    scheduler.set_timesteps(steps)
    return len(scheduler.timesteps)


def evaluations_per_image(name: str, steps: int, guidance_scale: float = 1.0) -> int:
    """Network evaluations of one image: the model calls of ``steps`` steps of the sampler, each doubled by
    classifier-free guidance (scale != 1: a conditional and an unconditional row)."""
    return _calls(sampler_class(name), steps) * (2 if guidance_scale != 1 else 1)


def steps_within(evaluations: int, name: str, guidance_scale: float = 1.0) -> int:
    """The most steps whose ``evaluations_per_image`` fit ``evaluations`` (at least 1)."""
    steps = 1
    while evaluations_per_image(name, steps + 1, guidance_scale) <= evaluations:
        steps += 1
    return steps


__all__ = ["SAMPLERS", "check_sampler", "evaluations_per_image", "sampler_class", "sampler_names", "steps_within"]
