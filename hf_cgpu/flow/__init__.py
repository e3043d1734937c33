"""Flow matching for small images: the math, a UNet, Euler/Heun schedulers and a diffusers pipeline.

Time convention everywhere: t = 0 is noise, t = 1 is data, xt = (1 - t) x0 + t x1, velocity ut = x1 - x0
(see ``matching``). The model, scheduler and pipeline files import only torch/diffusers so they can be copied
next to saved weights for ``trust_remote_code`` loading.
"""

from .matching import (
    FlowMatcher,
    conditional_velocity,
    drop_labels,
    from_diffusers_timestep,
    guided_velocity,
    interpolate,
    to_diffusers_timestep,
    to_diffusers_velocity,
)
from .pipeline_flow_match import FlowMatchPipeline, save_for_remote_code
from .scheduling_flow_match import (
    FlowMatchEulerScheduler,
    FlowMatchHeunScheduler,
    FlowMatchSchedulerOutput,
    sample_ode,
    time_grid,
)
from .unet import FlowUNet2DModel, FlowUNet2DOutput, sinusoidal_embedding

__all__ = [
    "FlowMatcher",
    "FlowMatchEulerScheduler",
    "FlowMatchHeunScheduler",
    "FlowMatchPipeline",
    "FlowMatchSchedulerOutput",
    "FlowUNet2DModel",
    "FlowUNet2DOutput",
    "conditional_velocity",
    "drop_labels",
    "from_diffusers_timestep",
    "guided_velocity",
    "interpolate",
    "sample_ode",
    "save_for_remote_code",
    "sinusoidal_embedding",
    "time_grid",
    "to_diffusers_timestep",
    "to_diffusers_velocity",
]
