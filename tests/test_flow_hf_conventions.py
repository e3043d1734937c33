"""FlowMatchPipeline / schedulers behave like diffusers' own where library code relies on it (issue 11).

diffusers' PipelineTesterMixin (tests/pipelines/test_pipelines_common.py) and SchedulerCommonTest
(tests/schedulers/test_schedulers.py) are not in the diffusers 0.42.1 release files (its sdist ships only
tests/testing_utils.py), so their key checks are written out here for our classes (see tests/upstream/README.md);
mixin checks that do not apply are listed as skips with the reason.
"""

import json
import os
from unittest import mock

import numpy as np
import pytest
import torch
from diffusers import (
    DDPMScheduler,
    DEISMultistepScheduler,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FlowMatchHeunDiscreteScheduler,
    UniPCMultistepScheduler,
)

from hf_cgpu.flow.pipeline_flow_match import FlowMatchPipeline, save_for_remote_code
from hf_cgpu.flow.samplers import SAMPLERS, sampler_class
from hf_cgpu.flow.scheduling_flow_match import FlowMatchEulerScheduler, FlowMatchHeunScheduler

SCHEDULERS = [sampler_class(name) for name in SAMPLERS]  # every registered sampler


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_unet(seed=0):
    from hf_cgpu.flow.unet import FlowUNet2DModel

    torch.manual_seed(seed)
    return FlowUNet2DModel(sample_size=8, base_channels=8, time_embed_dim=16, num_classes=3).eval()


def pipe_with(scheduler=None, unet=None) -> FlowMatchPipeline:
    pipe = FlowMatchPipeline(unet=unet or tiny_unet(), scheduler=scheduler or FlowMatchEulerScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def gen(seed=42):
    return torch.Generator().manual_seed(seed)


def sample(pipe, steps=4, labels=(0, 2), **kw):
    return pipe(num_inference_steps=steps, generator=gen(), class_labels=list(labels), output_type="pt", **kw).images


def unet_params(pipe):
    return torch.cat([p.detach().float().flatten() for p in pipe.unet.parameters()])


# ---------------------------------------------------------------------------- loader arguments
def test_dtype_per_component_and_for_all(tmp_path):
    pipe_with().save_pretrained(tmp_path)
    for dtype in ({"unet": torch.bfloat16}, {"default": torch.bfloat16}, torch.bfloat16):
        assert FlowMatchPipeline.from_pretrained(tmp_path, dtype=dtype).unet.dtype == torch.bfloat16, dtype
    assert FlowMatchPipeline.from_pretrained(tmp_path, dtype={"scheduler": torch.bfloat16}).unet.dtype == torch.float32
    assert FlowMatchPipeline.from_pretrained(tmp_path).unet.dtype == torch.float32
    with pytest.raises(ValueError, match="not components of this pipeline"):
        FlowMatchPipeline.from_pretrained(tmp_path, dtype={"unte": torch.bfloat16})


def test_dtype_dict_on_a_remote_code_folder(tmp_path):
    save_for_remote_code(pipe_with(), tmp_path)
    loaded = FlowMatchPipeline.from_pretrained(tmp_path, dtype={"unet": torch.bfloat16, "default": torch.float32})
    assert loaded.unet.dtype == torch.bfloat16
    images = sample(loaded)
    assert images.dtype == torch.float32 and torch.isfinite(images).all()


def test_variant_selects_the_variant_files(tmp_path):
    default, other = pipe_with(unet=tiny_unet(0)), pipe_with(unet=tiny_unet(1))
    default.save_pretrained(tmp_path)
    other.unet.save_pretrained(tmp_path / "unet", variant="fp16")
    assert (tmp_path / "unet" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    assert torch.equal(unet_params(FlowMatchPipeline.from_pretrained(tmp_path)), unet_params(default))
    assert torch.equal(unet_params(FlowMatchPipeline.from_pretrained(tmp_path, variant="fp16")), unet_params(other))
    with pytest.raises(ValueError, match="variant"):
        FlowMatchPipeline.from_pretrained(tmp_path, variant="int8")


def test_save_and_load_a_variant_only_folder(tmp_path):
    """PipelineTesterMixin.test_serialization_with_variants / test_loading_with_variants."""
    pipe = pipe_with()
    pipe.save_pretrained(tmp_path, variant="fp16")
    assert [f for f in os.listdir(tmp_path / "unet") if ".fp16." in f]
    loaded = FlowMatchPipeline.from_pretrained(tmp_path, variant="fp16")
    assert torch.equal(unet_params(loaded), unet_params(pipe))


def test_use_safetensors(tmp_path):
    pipe_with().save_pretrained(tmp_path, safe_serialization=False)
    assert (tmp_path / "unet" / "diffusion_pytorch_model.bin").is_file()
    FlowMatchPipeline.from_pretrained(tmp_path)  # falls back to the .bin
    with pytest.raises((OSError, EnvironmentError, ValueError), match="safetensors"):
        FlowMatchPipeline.from_pretrained(tmp_path, use_safetensors=True)


def _fake_hub_cache(cache, repo, revisions):
    """The huggingface_hub cache layout (refs/<name> -> snapshots/<commit>/...), filled by save_pretrained."""
    root = cache / f"models--{repo.replace('/', '--')}"
    for i, (ref, pipe) in enumerate(revisions.items()):
        commit = f"{i + 1:040x}"
        pipe.save_pretrained(root / "snapshots" / commit)
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)


def test_hub_arguments_reach_the_snapshot(tmp_path, monkeypatch):
    v1, v2 = pipe_with(unet=tiny_unet(0)), pipe_with(unet=tiny_unet(1))
    _fake_hub_cache(tmp_path / "cache", "someone/flow", {"main": v1, "v2": v2})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kw = dict(cache_dir=tmp_path / "cache", local_files_only=True)
    assert torch.equal(unet_params(FlowMatchPipeline.from_pretrained("someone/flow", **kw)), unet_params(v1))
    loaded = FlowMatchPipeline.from_pretrained("someone/flow", revision="v2", dtype={"unet": torch.bfloat16}, **kw)
    assert loaded.unet.dtype == torch.bfloat16
    assert torch.equal(unet_params(loaded), unet_params(v2).bfloat16().float())

    import huggingface_hub

    with mock.patch.object(huggingface_hub, "snapshot_download", wraps=huggingface_hub.snapshot_download) as spy:
        FlowMatchPipeline.from_pretrained("someone/flow", revision="v2", token="hf_not_used_offline", **kw)
    call = spy.call_args
    assert call.args == ("someone/flow",)
    assert {k: call.kwargs[k] for k in ("revision", "token", "local_files_only")} == dict(
        revision="v2", token="hf_not_used_offline", local_files_only=True)
    with pytest.raises(Exception, match="(?i)cache|offline|not found|revision"):
        FlowMatchPipeline.from_pretrained("someone/flow", revision="v3", **kw)


# ---------------------------------------------------------------------------- batch size
def test_batch_size_follows_class_labels():
    pipe = pipe_with()
    inferred = sample(pipe, labels=(1, 2, 0))
    assert inferred.shape[0] == 3
    assert torch.equal(inferred, sample(pipe, labels=(1, 2, 0), batch_size=3))
    assert pipe(num_inference_steps=2, class_labels=1, output_type="pt").images.shape[0] == 1
    assert pipe(num_inference_steps=2, output_type="pt").images.shape[0] == 1
    assert pipe(batch_size=2, num_inference_steps=2, class_labels=1, output_type="pt").images.shape[0] == 2
    with pytest.raises(ValueError, match="leave batch_size out"):
        pipe(batch_size=2, num_inference_steps=2, class_labels=[0, 1, 2])
    with pytest.raises(ValueError, match="batch_size=0"):
        pipe(batch_size=0)


# ---------------------------------------------------------------------------- diffusers' schedulers in our pipeline
@pytest.mark.parametrize("ours, theirs, atol", [(FlowMatchEulerScheduler, FlowMatchEulerDiscreteScheduler, 1e-5),
                                                (FlowMatchHeunScheduler, FlowMatchHeunDiscreteScheduler, 1e-4)])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_diffusers_flow_match_schedulers_give_our_samples(ours, theirs, atol, shift):
    """Same method, same grid (ours with timestep_spacing="diffusers"), sigma = 1 - t: the same images."""
    unet = tiny_unet()
    mine = sample(pipe_with(ours(shift=shift, timestep_spacing="diffusers"), unet), guidance_scale=2.0)
    with_theirs = sample(pipe_with(theirs(shift=shift), unet), guidance_scale=2.0)
    torch.testing.assert_close(with_theirs, mine, rtol=0, atol=atol)
    # with our default (uniform) grid the samples differ: the comparison above is not vacuous
    assert not torch.allclose(sample(pipe_with(ours(shift=shift), unet), guidance_scale=2.0), mine, atol=1e-3)


def _euler_on_sigmas(unet, sigmas, labels=(0, 2)):
    """Euler in our convention on a given sigma grid (t = 1 - sigma), written out."""
    x = torch.randn((len(labels), 3, 8, 8), generator=gen())
    y = torch.tensor(labels)
    with torch.no_grad():
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            x = x + (s - s_next) * unet(x, (1 - s).expand(len(labels)), y).sample
    return (x / 2 + 0.5).clamp(0, 1)


FLOW_SOLVER = dict(use_flow_sigmas=True, prediction_type="flow_prediction")


@pytest.mark.parametrize("solver", [
    DPMSolverMultistepScheduler(solver_order=1, **FLOW_SOLVER),
    UniPCMultistepScheduler(solver_order=1, disable_corrector=list(range(50)), **FLOW_SOLVER),
    DEISMultistepScheduler(solver_order=1, **FLOW_SOLVER),
], ids=["dpmsolver", "unipc", "deis"])
def test_first_order_multistep_solvers_are_euler_on_their_grid(solver):
    """A first-order multistep step in data prediction is the Euler step of the flow: equal samples."""
    unet = tiny_unet()
    got = sample(pipe_with(solver, unet), steps=5)
    torch.testing.assert_close(got, _euler_on_sigmas(unet, solver.sigmas), rtol=0, atol=1e-4)


def test_second_order_multistep_solvers_beat_euler():
    unet = tiny_unet()
    reference = sample(pipe_with(FlowMatchHeunScheduler(), unet), steps=64)  # second order, 8x the steps
    euler = (sample(pipe_with(FlowMatchEulerScheduler(), unet), steps=8) - reference).abs().max()
    for solver in (DPMSolverMultistepScheduler(**FLOW_SOLVER), UniPCMultistepScheduler(**FLOW_SOLVER)):
        error = (sample(pipe_with(solver, unet), steps=8) - reference).abs().max()
        assert error < 0.7 * euler, (type(solver).__name__, float(error), float(euler))


@pytest.mark.parametrize("scheduler", [DDPMScheduler(), DPMSolverMultistepScheduler()], ids=["ddpm", "dpm_no_flow"])
def test_non_flow_schedulers_are_refused_with_the_fix(scheduler):
    with pytest.raises(ValueError, match="use_flow_sigmas=True"):
        pipe_with(scheduler)(num_inference_steps=2)


def test_pipeline_with_diffusers_scheduler_saves_and_loads(tmp_path):
    pipe = pipe_with(FlowMatchHeunDiscreteScheduler(shift=2.0))
    before = sample(pipe)
    pipe.save_pretrained(tmp_path)
    loaded = FlowMatchPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded.scheduler) is FlowMatchHeunDiscreteScheduler and loaded.scheduler.config.shift == 2.0
    torch.testing.assert_close(sample(loaded), before, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- PipelineTesterMixin equivalents
def test_dict_tuple_outputs_equivalent():
    pipe = pipe_with()
    (as_tuple,) = pipe(num_inference_steps=3, generator=gen(), class_labels=[0, 1], output_type="np",
                       return_dict=False)
    assert np.array_equal(as_tuple, pipe(num_inference_steps=3, generator=gen(), class_labels=[0, 1],
                                         output_type="np").images)


def test_inference_batch_single_identical():
    """Each image of a batch equals the same image made alone (its own generator)."""
    pipe = pipe_with(FlowMatchHeunScheduler())
    labels = [0, 1, 2]
    batch = pipe(num_inference_steps=3, generator=[gen(s) for s in (1, 2, 3)], class_labels=labels,
                 guidance_scale=1.5, output_type="pt").images
    for i, (seed, label) in enumerate(zip((1, 2, 3), labels)):
        alone = pipe(num_inference_steps=3, generator=gen(seed), class_labels=[label], guidance_scale=1.5,
                     output_type="pt").images
        torch.testing.assert_close(batch[i : i + 1], alone, rtol=0, atol=1e-5)


def test_to_dtype_and_components():
    pipe = pipe_with()
    assert set(pipe.components) == {"unet", "scheduler", "guide_unet"}  # the optional autoguidance model
    assert pipe.components["guide_unet"] is None
    again = FlowMatchPipeline(**pipe.components)
    again.set_progress_bar_config(disable=True)
    assert torch.equal(sample(again), sample(pipe))
    pipe.to(torch.bfloat16)
    assert pipe.unet.dtype == torch.bfloat16 and pipe.dtype == torch.bfloat16
    low = sample(pipe)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()


def test_call_signature_and_progress_bar(capsys):
    import inspect

    params = inspect.signature(FlowMatchPipeline.__call__).parameters
    for name in ("batch_size", "num_inference_steps", "generator", "output_type", "return_dict"):
        assert name in params
    pipe = pipe_with()
    pipe.set_progress_bar_config(disable=False, desc="flow")
    pipe(num_inference_steps=2, output_type="pt")
    assert "flow" in capsys.readouterr().err
    pipe.set_progress_bar_config(disable=True)
    pipe(num_inference_steps=2, output_type="pt")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("check, reason", [
    ("test_num_images_per_prompt", "no prompts: the batch is batch_size or one image per class label"),
    ("test_callback_inputs / test_callback_cfg", "the pipeline has no callback_on_step_end"),
    ("test_attention_slicing_forward_pass", "FlowUNet2DModel has no attention layers"),
    ("test_encode_prompt_works_in_isolation", "no text encoder"),
    ("test_cpu_offload_forward_pass / test_sequential_offload", "need an accelerator"),
])
def test_pipeline_mixin_checks_that_do_not_apply(check, reason):
    pytest.skip(f"{check}: {reason}")


# ---------------------------------------------------------------------------- SchedulerCommonTest equivalents
@pytest.mark.parametrize("cls", SCHEDULERS)
def test_usable_right_after_construction(cls):
    sched = cls()
    n = sched.config.num_train_timesteps
    assert len(sched.t_grid) == n + 1
    reference = cls()
    reference.set_timesteps(n)
    assert torch.equal(sched.timesteps, reference.timesteps)
    x = torch.randn(2, 3)
    out = sched.step(torch.ones_like(x), sched.timesteps[0], x).prev_sample
    torch.testing.assert_close(out, reference.step(torch.ones_like(x), reference.timesteps[0], x).prev_sample)
    assert 0 < float((out - x).min()) and float((out - x).max()) <= 1 / n + 1e-6  # within the first interval
    with pytest.raises(ValueError, match="num_train_timesteps=0"):
        cls(num_train_timesteps=0)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_from_save_pretrained_same_steps(cls, tmp_path):
    sched = cls(shift=2.0)
    sched.save_config(tmp_path)
    loaded = cls.from_pretrained(tmp_path)
    public = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}  # noqa: E731
    assert public(loaded.config) == public(sched.config)
    x = torch.randn(2, 3, 4, 4)
    for s in (sched, loaded):
        s.set_timesteps(5)
    a = sched.step(0.1 * x, sched.timesteps[0], x).prev_sample
    b = loaded.step(0.1 * x, loaded.timesteps[0], x).prev_sample
    assert torch.equal(a, b)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_step_shape_and_tuple_output(cls):
    sched = cls()
    sched.set_timesteps(4)
    x = torch.randn(2, 3, 4, 4)
    first = sched.step(0.1 * x, sched.timesteps[0], x)
    second = sched.step(0.1 * x, sched.timesteps[1], first.prev_sample)
    assert first.prev_sample.shape == second.prev_sample.shape == x.shape
    sched.set_timesteps(4)
    (as_tuple,) = sched.step(0.1 * x, sched.timesteps[0], x, return_dict=False)
    assert torch.equal(as_tuple, first.prev_sample)


@pytest.mark.parametrize("cls", SCHEDULERS)
def test_public_api_and_device(cls):
    sched = cls()
    for attr in ("step", "set_timesteps", "order", "timesteps", "config", "step_index"):
        assert hasattr(sched, attr), attr
    assert "kwargs" not in __import__("inspect").signature(cls.__init__).parameters
    assert not cls._deprecated_kwargs  # diffusers' test_deprecated_kwargs: no **kwargs, so nothing deprecated
    sched.set_timesteps(3, device="meta")
    assert sched.timesteps.device.type == "meta"


@pytest.mark.parametrize("check, reason", [
    ("init_noise_sigma / scale_model_input", "flow matching starts from unit noise and never rescales the input "
                                             "(diffusers' FlowMatch* schedulers have neither)"),
    ("add_noise", "training noising is FlowMatcher's (hf_cgpu.flow.matching), not the sampler's"),
    ("trained_betas / beta_schedule", "no betas in flow matching"),
])
def test_scheduler_common_checks_that_do_not_apply(check, reason):
    pytest.skip(f"{check}: {reason}")


def test_saved_scheduler_config_names_our_class(tmp_path):
    FlowMatchHeunScheduler(shift=3.0).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "scheduler_config.json").read_text())
    assert config["_class_name"] == "FlowMatchHeunScheduler" and config["shift"] == 3.0
