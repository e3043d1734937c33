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
from .carry import carried_source

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
    """The scheduler class registered as ``name``, checked: a diffusers ``SchedulerMixin`` in our time convention
    (``timesteps_are_t``, ``call_plan``: ``FlowMatchScheduler`` gives both), whose file a saved pipeline can carry
    (``carry.carried_source``); anything else is one line naming the fix."""
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    check_sampler(name)
    found = SAMPLERS[name]
    if isinstance(found, str):
        module, _, cls = found.partition(":")
        found = getattr(importlib.import_module(module), cls)
    if not (isinstance(found, type) and issubclass(found, SchedulerMixin) and getattr(found, "timesteps_are_t", False)
            and callable(getattr(found, "call_plan", None))):
        raise SettingsError(f"sampler {name!r} is {found!r}, not a scheduler in hf_cgpu's time convention; subclass "
                            "hf_cgpu.flow.scheduling_flow_match.FlowMatchScheduler (docs/extending.md)")
    problem = _uncarried(found)
    if problem:
        raise SettingsError(f"sampler {name!r}: a saved pipeline could not carry its code: {problem}")
    return found


@lru_cache(maxsize=None)
def _uncarried(scheduler_class: type) -> str:
    """Why a saved pipeline could not carry the class's module ('' when it can)."""
    try:
        carried_source(scheduler_class, {__name__.split(".")[0], scheduler_class.__module__.split(".")[0]})
    except ValueError as err:
        return str(err)
    return ""


@lru_cache(maxsize=None)
def _calls(scheduler_class: type, steps: int, interval: tuple[float, float] | None) -> tuple[int, int]:
    """(model calls, of which guided) of ``steps`` steps, counted from the scheduler's own call plan."""
    scheduler = scheduler_class()
    scheduler.set_timesteps(steps)
    plan = scheduler.call_plan(interval)
    return len(plan), sum(guided for _, _, guided in plan)


def evaluations_per_image(name: str, steps: int, guidance_scale: float = 1.0,
                          guidance_interval: tuple[float, float] | None = None) -> int:
    """Network evaluations of one image: the model calls of ``steps`` steps of the sampler; a call guided by
    classifier-free guidance (scale != 1, t inside ``guidance_interval``) counts two, a conditional and a null row."""
    calls, guided = _calls(sampler_class(name), steps, guidance_interval)
    return calls + (guided if guidance_scale != 1 else 0)


def steps_within(evaluations: int, name: str, guidance_scale: float = 1.0,
                 guidance_interval: tuple[float, float] | None = None) -> int:
    """The most steps whose ``evaluations_per_image`` fit ``evaluations`` (at least 1)."""
    steps = 1
    while evaluations_per_image(name, steps + 1, guidance_scale, guidance_interval) <= evaluations:
        steps += 1
    return steps


def parse_interval(text: str, flag: str = "--guidance_interval") -> tuple[float, float] | None:
    """'LO:HI' (0 <= LO < HI <= 1, t = 0 noise, t = 1 data) -> (LO, HI); '' or 'full' -> None (every step)."""
    if text.strip() in ("", "full"):
        return None
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise SettingsError(f"{flag} {text!r}; write LO:HI in t (0 = noise, 1 = data), e.g. 0.15:0.8, or full"
                            ) from None
    if not 0 <= lo < hi <= 1:
        raise SettingsError(f"{flag} {text!r}: LO and HI must lie in [0, 1] (t: 0 = noise, 1 = data) with LO < HI; "
                            "write e.g. 0.15:0.8")
    return (lo, hi)


def format_interval(interval) -> str:
    """The inverse of ``parse_interval``: None -> 'full', (lo, hi) -> 'lo:hi'."""
    return "full" if interval is None else f"{interval[0]:g}:{interval[1]:g}"


__all__ = ["SAMPLERS", "check_sampler", "evaluations_per_image", "format_interval", "parse_interval", "sampler_class",
           "sampler_names", "steps_within"]
