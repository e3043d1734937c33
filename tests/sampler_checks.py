"""What every registered sampler must do, by name: tests/test_flow_schedulers.py runs each check for every entry of
``SAMPLERS``, and tests/test_extending.py for a sampler added in a file of its own.

- its grid: N steps walk N intervals from t = 0 to t = 1, at N to ``order`` x N model calls, one ``call_plan`` entry a
  call; a constant velocity is integrated exactly;
- its order: the error on a smooth nonlinear flow falls at least as fast as (1/2)^order when the steps double;
- its evaluation count: the UNet calls a pipeline makes per image, with and without guidance and a guidance
  interval, are ``evaluations_per_image``, and ``steps_within`` inverts it;
- its round trip: the scheduler's config saves and loads (and another sampler loads it), and a pipeline saved with it
  loads with the same class and samples the same, with hf_cgpu and (``remote_samples``) without it.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from isolation import run_without_hf_cgpu

from hf_cgpu.flow.pipeline_flow_match import FlowMatchPipeline, save_for_remote_code
from hf_cgpu.flow.samplers import SAMPLERS, evaluations_per_image, sampler_class, steps_within
from hf_cgpu.flow.scheduling_flow_match import sample_ode


def field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A smooth nonlinear velocity in (x, t), our convention."""
    t = t.reshape(-1, *([1] * (x.dim() - 1)))
    return torch.sin(2 * x) * (1 + t) - 0.3 * x**2 + torch.cos(3 * t)


X0 = torch.randn(16, 2, generator=torch.Generator().manual_seed(0))


@lru_cache(maxsize=1)
def exact() -> torch.Tensor:
    """``field``'s flow from X0 to t = 1: classic RK4 in fp64 with 2,000 steps (error far below the samplers')."""
    x, h = X0.double(), 1 / 2000
    for k in range(2000):
        t = torch.full((len(x),), k * h, dtype=torch.float64)
        k1 = field(x, t)
        k2 = field(x + h / 2 * k1, t + h / 2)
        k3 = field(x + h / 2 * k2, t + h / 2)
        k4 = field(x + h * k3, t + h)
        x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return x


def check_grid_and_calls(name: str) -> None:
    cls = sampler_class(name)
    for steps in (1, 2, 5, 8):
        for spacing, shift in (("uniform", 1.0), ("diffusers", 3.0)):
            sched = cls(timestep_spacing=spacing, shift=shift)
            sched.set_timesteps(steps)
            grid, calls = sched.t_grid, len(sched.timesteps)
            assert len(grid) == steps + 1, f"{name}: {steps} steps walk {len(grid) - 1} grid intervals"
            assert grid[0] == 0 and abs(float(grid[-1]) - 1) < 1e-6 and torch.all(grid[1:] > grid[:-1]), grid
            assert steps <= calls <= cls.order * steps, f"{name}: {steps} steps make {calls} model calls (order " \
                                                        f"{cls.order}: {steps} to {cls.order * steps})"
            assert len(sched.call_plan()) == calls and all(0 <= t < 1 for t, _, _ in sched.call_plan())
            v = torch.randn(3, 4, generator=torch.Generator().manual_seed(steps))
            x0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(steps + 1))
            got, made = sample_ode(lambda x, t: v, cls(timestep_spacing=spacing, shift=shift), x0, steps)
            assert made == calls and torch.allclose(got, x0 + v, atol=1e-5), f"{name}: does not reach t = 1"


def check_order(name: str) -> None:
    cls = sampler_class(name)
    errors = [float((sample_ode(field, cls(), X0, n)[0].double() - exact()).abs().max()) for n in (16, 32)]
    measured = math.log2(errors[0] / errors[1])
    assert measured > cls.order - 0.25, f"{name}: declares order {cls.order}, converges at order {measured:.2f}"


def tiny_pipeline(name: str) -> FlowMatchPipeline:
    from hf_cgpu.flow.unet import FlowUNet2DModel

    torch.manual_seed(0)
    unet = FlowUNet2DModel(sample_size=8, base_channels=8, time_embed_dim=16, num_classes=3).eval()
    pipe = FlowMatchPipeline(unet=unet, scheduler=sampler_class(name)(), num_inference_steps=3)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sample(pipe: FlowMatchPipeline) -> np.ndarray:
    """What the saved folder draws for two classes, guided: what ``remote_samples`` draws too."""
    return pipe(2, generator=torch.Generator().manual_seed(0), class_labels=[0, 2], guidance_scale=2.0,
                output_type="np").images


def check_evaluation_count(name: str) -> None:
    pipe = tiny_pipeline(name)
    rows, times = [], []

    def count(module, args, kwargs):
        rows.append(len(args[0]))
        times.append(float(args[1][0]))

    pipe.unet.register_forward_pre_hook(count, with_kwargs=True)
    for steps in (1, 2, 3):
        for scale, interval in ((1.0, None), (2.0, None), (2.0, (0.3, 0.8))):
            rows.clear()
            times.clear()
            try:
                pipe(2, steps, torch.Generator().manual_seed(0), class_labels=[0, 1], guidance_scale=scale,
                     guidance_interval=interval, output_type="np")
            except ValueError as err:  # an interval holding none of the calls is refused, not a silent no-op
                pipe.scheduler.set_timesteps(steps)
                plan = [t for t, _, _ in pipe.scheduler.call_plan()]
                assert "holds none of the model calls" in str(err) and interval is not None, err
                assert not any(interval[0] <= t <= interval[1] for t in plan), (name, steps, plan)
                continue
            expected = evaluations_per_image(name, steps, scale, interval)
            per_image = sum(rows) / 2
            assert per_image == expected, f"{name}, {steps} steps, guidance {scale} on {interval}: {per_image} UNet " \
                                          f"calls per image, evaluations_per_image says {expected}"
            assert times == [t for t, _, _ in pipe.scheduler.call_plan()], name
            assert steps_within(expected, name, scale, interval) == steps


def check_scheduler_round_trip(name: str, tmp_path) -> None:
    cls = sampler_class(name)
    sched = cls(shift=2.0, timestep_spacing="diffusers")
    sched.save_pretrained(tmp_path)
    loaded = cls.from_pretrained(tmp_path)
    public = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}  # noqa: E731
    assert type(loaded) is cls and public(loaded.config) == public(sched.config)
    for s in (sched, loaded):
        s.set_timesteps(5)
    assert torch.equal(sched.timesteps, loaded.timesteps)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_ode(field, sched, x, 5)[0], sample_ode(field, loaded, x, 5)[0])
    for other in SAMPLERS:  # any sampler reads another's config: the CLI's --scheduler swaps them so
        swapped = sampler_class(other).from_config(loaded.config)
        assert (swapped.config.shift, swapped.config.timestep_spacing) == (2.0, "diffusers"), other


def check_saved_pipeline(name: str, folder) -> np.ndarray:
    """Save a pipeline with the sampler; with hf_cgpu it loads with the same class and draws the same. Returns what
    it draws (also in ``expected.npy``, for ``remote_samples``)."""
    pipe = tiny_pipeline(name)
    expected = sample(pipe)
    save_for_remote_code(pipe, folder)
    loaded = FlowMatchPipeline.from_pretrained(folder)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded.scheduler) is sampler_class(name)
    np.testing.assert_array_equal(sample(loaded), expected)
    np.save(Path(folder) / "expected.npy", expected)
    return expected


def remote_samples(folders) -> None:
    """In a fresh interpreter without hf_cgpu, each folder of ``check_saved_pipeline`` loads as diffusers loads remote
    code, with its sampler's class from the folder, and draws the images it drew before it was saved."""
    run_without_hf_cgpu(f"""
        import sys
        import numpy as np, torch
        from diffusers import DiffusionPipeline

        for folder in {[str(f) for f in folders]!r}:
            pipe = DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, trust_remote_code=True)
            pipe.set_progress_bar_config(disable=True)
            assert type(pipe.scheduler).__module__.startswith("diffusers_modules"), type(pipe.scheduler)
            images = pipe(2, generator=torch.Generator().manual_seed(0), class_labels=[0, 2], guidance_scale=2.0,
                          output_type="np").images
            np.testing.assert_array_equal(images, np.load(f"{{folder}}/expected.npy"), err_msg=folder)
        assert not [m for m, module in sys.modules.items() if m.startswith("hf_cgpu") and module is not None]
        print("OK")
        """, cwd=Path(folders[0]).parent)
