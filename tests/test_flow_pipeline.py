"""FlowMatchPipeline: outputs, guidance, save/load, and loading with trust_remote_code where hf_cgpu is absent."""

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.unets.unet_2d import UNet2DOutput
from PIL import Image

from hf_cgpu.flow.matching import guided_velocity
from hf_cgpu.flow.pipeline_flow_match import FlowMatchPipeline, save_for_remote_code
from hf_cgpu.flow.samplers import evaluations_per_image
from hf_cgpu.flow.scheduling_flow_match import FlowMatchEulerScheduler, FlowMatchHeunScheduler
from hf_cgpu.flow.unet import FlowUNet2DModel


def _pipe(scheduler=None, num_classes=3) -> FlowMatchPipeline:
    torch.manual_seed(0)
    unet = FlowUNet2DModel(sample_size=8, base_channels=8, time_embed_dim=16, num_classes=num_classes).eval()
    pipe = FlowMatchPipeline(unet=unet, scheduler=scheduler or FlowMatchEulerScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(42)


def _manual(pipe, labels, steps, scale=None, interval=(0.0, 1.0)) -> torch.Tensor:
    """The sampling loop written out: Euler from the same noise, optional guidance with two separate calls, only where
    lo <= t <= hi."""
    unet = pipe.unet
    x = torch.randn((len(labels), 3, 8, 8), generator=_gen())
    sched = FlowMatchEulerScheduler()
    sched.set_timesteps(steps)
    y = torch.tensor(labels)
    with torch.no_grad():
        for t in sched.timesteps:
            v = unet(x, t.expand(len(labels)), y).sample
            if scale is not None and interval[0] <= float(t) <= interval[1]:
                v_u = unet(x, t.expand(len(labels)), torch.full_like(y, unet.config.num_classes)).sample
                v = guided_velocity(v_u, v, scale)
            x = sched.step(v, t, x).prev_sample
    return (x / 2 + 0.5).clamp(0, 1)


def test_output_types():
    pipe = _pipe()
    pil = pipe(batch_size=2, num_inference_steps=2, generator=_gen()).images
    assert len(pil) == 2 and isinstance(pil[0], Image.Image) and pil[0].size == (8, 8)
    arr = pipe(batch_size=2, num_inference_steps=2, generator=_gen(), output_type="np").images
    assert arr.shape == (2, 8, 8, 3) and 0 <= arr.min() and arr.max() <= 1
    pt = pipe(batch_size=2, num_inference_steps=2, generator=_gen(), output_type="pt").images
    assert pt.shape == (2, 3, 8, 8)
    assert np.allclose(pt.permute(0, 2, 3, 1).numpy(), arr)
    with pytest.raises(ValueError, match="output_type"):
        pipe(output_type="jpg")


def test_scale_one_is_the_conditional_model():
    pipe = _pipe()
    got = pipe(batch_size=2, num_inference_steps=3, generator=_gen(), class_labels=[0, 2], output_type="pt").images
    assert torch.allclose(got, _manual(pipe, [0, 2], 3), atol=1e-6)


def test_guidance_batches_cond_and_null_correctly():
    pipe = _pipe()
    got = pipe(2, 3, _gen(), class_labels=[1, 2], guidance_scale=2.5, output_type="pt").images
    assert torch.allclose(got, _manual(pipe, [1, 2], 3, scale=2.5), atol=1e-5)
    plain = pipe(2, 3, _gen(), class_labels=[1, 2], output_type="pt").images
    assert not torch.allclose(got, plain, atol=1e-3)


def test_labels_and_guidance_errors():
    pipe = _pipe()
    one = pipe(3, 2, _gen(), class_labels=1, output_type="pt").images
    many = pipe(3, 2, _gen(), class_labels=[1, 1, 1], output_type="pt").images
    assert torch.equal(one, many)
    with pytest.raises(ValueError, match="class_labels"):
        pipe(2, 2, _gen(), guidance_scale=3.0)
    with pytest.raises(ValueError, match="batch_size"):
        pipe(2, 2, _gen(), class_labels=[0, 1, 2])
    with pytest.raises(ValueError, match="num_classes"):
        _pipe(num_classes=None)(2, 2, _gen(), class_labels=[0, 1])
    for bad in (3, [0, -1]):  # 3 = num_classes is the null class: it silently drew unconditional images
        with pytest.raises(ValueError, match=r"class_labels in 0\.\.2"):
            pipe(2, 2, _gen(), class_labels=bad)


def test_heun_calls_the_unet_2n_minus_1_times():
    pipe = _pipe(FlowMatchHeunScheduler())
    calls = []
    pipe.unet.register_forward_hook(lambda *a: calls.append(1))
    pipe(1, 4, _gen(), output_type="pt")
    assert len(calls) == 7


def test_save_load_round_trip(tmp_path):
    pipe = _pipe(FlowMatchHeunScheduler(shift=2.0))
    before = pipe(2, 3, _gen(), class_labels=[0, 1], output_type="np").images
    pipe.save_pretrained(tmp_path)
    loaded = FlowMatchPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded.scheduler, FlowMatchHeunScheduler) and loaded.scheduler.config.shift == 2.0
    after = loaded(2, 3, _gen(), class_labels=[0, 1], output_type="np").images
    assert np.allclose(before, after, atol=1e-5)  # same weights; oneDNN kernels may differ by ~1e-6


REMOTE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys
    import numpy as np, torch

    class NoHfCgpu(importlib.abc.MetaPathFinder):
        # Even if hf_cgpu were pip-installed, this process must load everything from the saved folder.
        def find_spec(self, name, path=None, target=None):
            if name == "hf_cgpu" or name.startswith("hf_cgpu."):
                raise ModuleNotFoundError(f"blocked {name}")
            return None

    sys.meta_path.insert(0, NoHfCgpu())
    try:
        import hf_cgpu  # noqa: F401
        sys.exit("hf_cgpu importable: the test would prove nothing")
    except ModuleNotFoundError:
        pass

    from diffusers import DiffusionPipeline

    folder, out = sys.argv[1], sys.argv[2]
    pipe = DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, trust_remote_code=True)
    pipe.set_progress_bar_config(disable=True)
    for obj in (pipe, pipe.unet, pipe.scheduler):
        assert type(obj).__module__.startswith("diffusers_modules"), type(obj).__module__
    gen = torch.Generator().manual_seed(42)
    images = pipe(2, 3, gen, class_labels=[0, 1], guidance_scale=2.0, output_type="np").images
    assert not [m for m in sys.modules if m.startswith("hf_cgpu")]
    np.save(out, images)
    print(type(pipe).__name__, type(pipe.unet).__name__, type(pipe.scheduler).__name__)
    """
)


@pytest.mark.slow
def test_loads_with_trust_remote_code_without_hf_cgpu(tmp_path):
    pipe = _pipe(FlowMatchHeunScheduler())
    expected = pipe(2, 3, _gen(), class_labels=[0, 1], guidance_scale=2.0, output_type="np").images
    folder = tmp_path / "saved"
    save_for_remote_code(pipe, folder)
    assert (folder / "pipeline.py").is_file() and (folder / "unet" / "hf_cgpu.flow.unet.py").is_file()
    assert (folder / "scheduler" / "hf_cgpu.flow.scheduling_flow_match.py").is_file()

    # With hf_cgpu installed the same folder loads with our classes and without running the folder's code.
    local = FlowMatchPipeline.from_pretrained(folder)
    local.set_progress_bar_config(disable=True)
    assert type(local.unet) is FlowUNet2DModel and type(local.scheduler) is FlowMatchHeunScheduler
    again = local(2, 3, _gen(), class_labels=[0, 1], guidance_scale=2.0, output_type="np").images
    assert np.allclose(again, expected, atol=1e-5)

    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "remote_load.py").write_text(REMOTE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    # -I: isolated mode, so neither the cwd, the script folder nor PYTHON* variables reach sys.path.
    proc = subprocess.run(
        [sys.executable, "-I", str(work / "remote_load.py"), str(folder), str(tmp_path / "out.npy")],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FlowMatchPipeline FlowUNet2DModel FlowMatchHeunScheduler" in proc.stdout
    assert np.allclose(np.load(tmp_path / "out.npy"), expected, atol=1e-5)


def test_guidance_interval_guides_only_inside_and_counts_one_call_outside():
    pipe = _pipe()
    rows = []
    pipe.unet.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    out = pipe(2, 5, _gen(), class_labels=[0, 2], guidance_scale=3.0, guidance_interval=(0.3, 0.7),
               output_type="pt").images
    assert rows == [2, 2, 4, 4, 2]  # t = 0, 0.2 unguided; 0.4, 0.6 guided (two rows each); 0.8 unguided
    assert sum(rows) // 2 == evaluations_per_image("euler", 5, 3.0, (0.3, 0.7)) == 7
    assert torch.allclose(out, _manual(pipe, [0, 2], 5, 3.0, (0.3, 0.7)), atol=1e-5)
    full = pipe(2, 5, _gen(), class_labels=[0, 2], guidance_scale=3.0, guidance_interval=None, output_type="pt").images
    assert not torch.allclose(out, full, atol=1e-3)  # the interval changed the samples
    assert torch.allclose(full, _manual(pipe, [0, 2], 5, 3.0), atol=1e-5)


def test_saved_sampling_defaults_round_trip(tmp_path):
    """steps, guidance scale and interval are saved in model_index.json and used when a call leaves them out."""
    pipe = _pipe()
    pipe.register_to_config(num_inference_steps=5, guidance_scale=3.0, guidance_interval=[0.3, 0.7])
    pipe.save_pretrained(tmp_path)
    loaded = FlowMatchPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.config.guidance_interval == [0.3, 0.7] and loaded.config.num_inference_steps == 5
    out = loaded(2, generator=_gen(), class_labels=[0, 2], output_type="pt").images
    assert torch.allclose(out, _manual(pipe, [0, 2], 5, 3.0, (0.3, 0.7)), atol=1e-5)
    plain = loaded(2, generator=_gen(), output_type="pt").images  # no labels: unguided, the saved scale unused
    assert plain.shape == (2, 3, 8, 8)


def test_step_size_embedding_is_off_by_default_and_starts_as_the_base_model():
    torch.manual_seed(0)
    base = FlowUNet2DModel(sample_size=8, base_channels=8, time_embed_dim=16, num_classes=3).eval()
    student = FlowUNet2DModel(**{**base.config, "step_size_embedding": True}).eval()
    missing = student.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert set(base.state_dict()) < set(student.state_dict()) and all(k.startswith("step_mlp.") for k in missing)
    x, t, y = torch.randn(2, 3, 8, 8), torch.tensor([0.1, 0.6]), torch.tensor([0, 3])
    with torch.no_grad():
        assert torch.equal(student(x, t, y, step_size=torch.tensor([0.5, 1.0])).sample, base(x, t, y).sample)
        student.step_mlp[2].weight.normal_()  # trained: the output now depends on d
        assert not torch.allclose(student(x, t, y, step_size=0.5).sample, student(x, t, y, step_size=0.0).sample)
    with pytest.raises(ValueError, match="step_size_embedding"):
        base(x, t, y, step_size=0.5)


def test_guidance_embedding_is_off_by_default_and_starts_as_the_model(tmp_path):
    """The guidance input is built last and zero-initialised: with it every other weight draws the initial values it
    draws without it, and the output is the model's at any w until trained; without it a w is refused, and a config
    saved before the option existed loads as the model it was."""
    kw = dict(sample_size=8, base_channels=8, time_embed_dim=16, num_classes=3, step_size_embedding=True)
    torch.manual_seed(0)
    plain = FlowUNet2DModel(**kw).eval()
    torch.manual_seed(0)
    told = FlowUNet2DModel(**kw, guidance_embedding=True).eval()
    ours = told.state_dict()
    assert {k for k in ours if k not in plain.state_dict()} == {k for k in ours if k.startswith("guidance_mlp.")}
    assert all(torch.equal(v, ours[k]) for k, v in plain.state_dict().items())
    x, t, y, d = torch.randn(2, 3, 8, 8), torch.tensor([0.1, 0.6]), torch.tensor([0, 3]), torch.tensor([0.5, 1.0])
    with torch.no_grad():
        for w in (1.0, torch.tensor([2.0, 3.5])):
            assert torch.equal(told(x, t, y, step_size=d, guidance=w).sample, plain(x, t, y, step_size=d).sample)
        told.guidance_mlp[2].weight.normal_()  # trained: the output now depends on w
        assert not torch.allclose(told(x, t, y, step_size=d, guidance=1.0).sample,
                                  told(x, t, y, step_size=d, guidance=3.0).sample)
    with pytest.raises(ValueError, match="guidance_embedding"):
        plain(x, t, y, step_size=d, guidance=2.0)
    plain.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["guidance_embedding"]  # as saved before the option existed
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = FlowUNet2DModel.from_pretrained(tmp_path)
    assert loaded.guidance_mlp is None and loaded.state_dict().keys() == plain.state_dict().keys()


# ----------------------------------------------------------------------------- autoguidance
class LinearField(ModelMixin, ConfigMixin):
    """A 'UNet' with a known velocity: v(x, t, y) = a x + b t + c y (y = the label, the null class included)."""

    @register_to_config
    def __init__(self, sample_size=8, in_channels=3, out_channels=3, num_classes=3, a=0.0, b=0.0, c=0.0):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # device and dtype for the pipeline

    def forward(self, x, t, class_labels=None):
        y = class_labels if class_labels is not None else torch.full((x.shape[0],), self.config.num_classes)
        c = self.config
        v = c.a * x + c.b * t.reshape(-1, 1, 1, 1) + c.c * y.reshape(-1, 1, 1, 1).float()
        return UNet2DOutput(sample=v)


def test_autoguidance_matches_the_closed_form_of_two_known_fields():
    """Euler with v = v_weak + w (v_strong - v_weak) of two linear fields is a linear recursion on x: the pipeline's
    samples equal it written out, guided only inside the interval, the same label through both models."""
    strong, weak = LinearField(a=-0.5, b=0.8, c=0.1), LinearField(a=0.3, b=-0.4, c=-0.2)
    pipe = FlowMatchPipeline(unet=strong, scheduler=FlowMatchEulerScheduler(), guide_unet=weak, guidance_model="weak")
    pipe.set_progress_bar_config(disable=True)
    w, steps, interval, labels = 2.5, 5, (0.3, 0.7), [0, 2]
    out = pipe(2, steps, _gen(), class_labels=labels, guidance_scale=w, guidance_interval=interval,
               output_type="pt").images
    x = torch.randn((2, 3, 8, 8), generator=_gen()).double()
    y = torch.tensor(labels, dtype=torch.float64).reshape(-1, 1, 1, 1)
    for k in range(steps):
        t = k / steps
        field = lambda m: m.a * x + m.b * t + m.c * y  # noqa: E731
        vs, vw = field(strong.config), field(weak.config)
        v = vw + w * (vs - vw) if interval[0] <= t <= interval[1] else vs
        x = x + v / steps
    assert torch.allclose(out.double(), (x / 2 + 0.5).clamp(0, 1), atol=1e-5)
    uncond = pipe(2, steps, _gen(), guidance_scale=w, guidance_interval=None, output_type="pt").images
    x = torch.randn((2, 3, 8, 8), generator=_gen()).double()
    for k in range(steps):  # no labels: both models unconditional (the null class), guided at every call
        t, null = k / steps, 3.0
        vs, vw = (m.a * x + m.b * t + m.c * null for m in (strong.config, weak.config))
        x = x + (vw + w * (vs - vw)) / steps
    assert torch.allclose(uncond.double(), (x / 2 + 0.5).clamp(0, 1), atol=1e-5)


@pytest.mark.parametrize("scheduler", ["euler", "heun"])
def test_autoguidance_counts_two_evaluations_per_guided_call(scheduler):
    pipe = _pipe(FlowMatchHeunScheduler() if scheduler == "heun" else None)
    pipe.set_guidance_model(copy.deepcopy(pipe.unet), "copy")
    rows = {"unet": [], "guide": []}
    pipe.unet.register_forward_pre_hook(lambda m, args: rows["unet"].append(args[0].shape[0]))
    pipe.guide_unet.register_forward_pre_hook(lambda m, args: rows["guide"].append(args[0].shape[0]))
    pipe(2, 5, _gen(), class_labels=[0, 2], guidance_scale=3.0, guidance_interval=(0.3, 0.7), output_type="pt")
    evaluations = (sum(rows["unet"]) + sum(rows["guide"])) // 2
    assert evaluations == evaluations_per_image(scheduler, 5, 3.0, (0.3, 0.7))
    assert set(rows["unet"]) == {2} and rows["guide"]  # never the doubled null-class batch
    assert len(rows["guide"]) == sum(g for _, _, g in pipe.scheduler.call_plan((0.3, 0.7)))


def test_a_guide_identical_to_the_model_gives_exactly_the_unguided_samples():
    pipe = _pipe()
    plain = pipe(2, 3, _gen(), class_labels=[0, 2], output_type="pt").images
    plain_uncond = pipe(2, 3, _gen(), output_type="pt").images
    pipe.set_guidance_model(copy.deepcopy(pipe.unet), "itself")
    assert torch.equal(pipe(2, 3, _gen(), class_labels=[0, 2], guidance_scale=4.0, output_type="pt").images, plain)
    assert torch.equal(pipe(2, 3, _gen(), guidance_scale=4.0, output_type="pt").images, plain_uncond)
    with torch.no_grad():
        next(pipe.guide_unet.parameters()).mul_(0.5)  # a weaker model: now guidance moves the samples
    assert not torch.allclose(pipe(2, 3, _gen(), class_labels=[0, 2], guidance_scale=4.0, output_type="pt").images,
                              plain, atol=1e-3)


def test_a_guide_of_another_shape_or_class_count_is_refused():
    pipe = _pipe()
    other = FlowUNet2DModel(sample_size=8, base_channels=8, time_embed_dim=16, num_classes=5)
    with pytest.raises(ValueError, match="num_classes 5 vs 3"):
        pipe.set_guidance_model(other)
    with pytest.raises(ValueError, match="sample_size 16 vs 8"):
        pipe.set_guidance_model(FlowUNet2DModel(sample_size=16, base_channels=8, time_embed_dim=16, num_classes=3))
    with pytest.raises(ValueError, match="guide_unet"):
        _pipe(num_classes=None)(2, 2, _gen(), guidance_scale=3.0)  # no labels, no guide: nothing to guide with
    # a distilled (step-size conditioned) UNet predicts the average velocity of a step, the flow UNet the
    # instantaneous one: neither guides the other
    distilled = FlowUNet2DModel(sample_size=8, base_channels=8, time_embed_dim=16, num_classes=3,
                                step_size_embedding=True)
    with pytest.raises(ValueError, match="step_size_embedding True vs False"):
        pipe.set_guidance_model(distilled)


@pytest.mark.parametrize("interval", [(0.8, 0.2), (0.5, 0.5), (-0.1, 0.5), (0.2, 1.5), (0.5,), "0.2:0.8"])
def test_a_bad_guidance_interval_is_refused_not_silently_unguided(interval):
    """LO >= HI would guide no call at all, silently; the constructor (a saved config) and a call both refuse it."""
    with pytest.raises(ValueError, match="0 <= lo < hi <= 1"):
        _pipe()(2, 2, _gen(), class_labels=[0, 1], guidance_scale=3.0, guidance_interval=interval)
    with pytest.raises(ValueError, match="0 <= lo < hi <= 1"):
        FlowMatchPipeline(unet=_pipe().unet, scheduler=FlowMatchEulerScheduler(), guidance_interval=interval)


def _guided_pipe() -> FlowMatchPipeline:
    pipe = _pipe(FlowMatchHeunScheduler())
    weak = copy.deepcopy(pipe.unet)
    with torch.no_grad():
        for p in weak.parameters():
            p.mul_(0.7)
    pipe.set_guidance_model(weak, "checkpoints/step_0000010")
    pipe.register_to_config(num_inference_steps=3, guidance_scale=2.0, guidance_interval=[0.2, 0.9])
    return pipe


def test_autoguidance_save_load_round_trip(tmp_path):
    """The guide is saved as a component and the setting in model_index.json: the loaded folder samples the same
    way with no arguments; a folder saved without a guide loads without one."""
    pipe = _guided_pipe()
    expected = pipe(2, generator=_gen(), class_labels=[0, 1], output_type="pt").images
    save_for_remote_code(pipe, tmp_path / "g")
    assert (tmp_path / "g" / "guide_unet" / "hf_cgpu.flow.unet.py").is_file()
    loaded = FlowMatchPipeline.from_pretrained(tmp_path / "g")
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded.guide_unet) is FlowUNet2DModel and loaded.config.guidance_model == "checkpoints/step_0000010"
    assert torch.allclose(loaded(2, generator=_gen(), class_labels=[0, 1], output_type="pt").images, expected,
                          atol=1e-5)
    loaded.set_guidance_model(None)
    loaded.save_pretrained(tmp_path / "off")
    off = FlowMatchPipeline.from_pretrained(tmp_path / "off")
    assert off.guide_unet is None and off.config.guidance_model is None


@pytest.mark.slow
def test_autoguided_folder_loads_with_trust_remote_code_without_hf_cgpu(tmp_path):
    pipe = _guided_pipe()
    pipe.register_to_config(num_inference_steps=8, guidance_scale=1.0, guidance_interval=None)
    expected = pipe(2, 3, _gen(), class_labels=[0, 1], guidance_scale=2.0, output_type="np").images  # the script's call
    folder = tmp_path / "saved"
    save_for_remote_code(pipe, folder)
    checks = "for obj in (pipe, pipe.unet, pipe.scheduler):"
    assert checks in REMOTE_SCRIPT  # the guide, too, is loaded from the folder's code
    (tmp_path / "remote_load.py").write_text(REMOTE_SCRIPT.replace(checks, checks[:-2] + ", pipe.guide_unet):"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    script = [sys.executable, "-I", str(tmp_path / "remote_load.py"), str(folder), str(tmp_path / "o.npy")]
    proc = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.allclose(np.load(tmp_path / "o.npy"), expected, atol=1e-5)


# ----------------------------------------------------------------------------- hf-cgpu sample on a saved folder
def _folder(path, scheduler=None, **defaults):
    """A tiny class-conditional pipeline folder as a run saves it (with its code), ``defaults`` its sampling ones."""
    pipe = _pipe(scheduler or FlowMatchHeunScheduler())
    pipe.register_to_config(**defaults)
    save_for_remote_code(pipe, path)
    return path


def _sample(argv, capsys) -> tuple[int, str]:
    from hf_cgpu.cli import main as cli_main

    capsys.readouterr()
    rc = cli_main(["sample", *map(str, argv)])
    return rc, capsys.readouterr().err


def test_an_interval_holding_no_call_is_refused_not_a_silent_no_op():
    """0.8:0.95 at 4 steps (calls at t = 0, 0.25, 0.5, 0.75) guides no call: the samples were the unguided ones, byte
    for byte, at a guidance scale the caller asked for. Refused naming the calls' t and the fix; at 8 steps (a call
    at t = 0.875) it guides; at scale 1 nothing is asked."""
    labels = dict(class_labels=[0, 2], guidance_interval=(0.8, 0.95), output_type="pt")
    for scheduler in (FlowMatchEulerScheduler(), FlowMatchHeunScheduler()):
        with pytest.raises(ValueError, match=r"holds none of the model calls of 4 FlowMatch(Euler|Heun)Scheduler steps "
                                             r"\(t = 0, 0.25, 0.5, 0.75\).*raise num_inference_steps"):
            _pipe(scheduler)(2, 4, _gen(), guidance_scale=3.0, **labels)
    pipe = _pipe()
    guided = pipe(2, 8, _gen(), guidance_scale=3.0, **labels).images
    assert not torch.allclose(guided, pipe(2, 8, _gen(), guidance_scale=1.0, **labels).images, atol=1e-3)
    assert pipe(2, 4, _gen(), guidance_scale=1.0, **labels).images.shape == (2, 3, 8, 8)


def test_sample_refuses_an_interval_holding_no_call_before_writing(tmp_path, capsys):
    """hf-cgpu sample: a --guidance_interval (or a folder's saved one) holding none of the steps' t is one line naming
    the t and the flags to change, exit 2, and nothing is written; with more steps it samples."""
    folder = _folder(tmp_path / "pipe", num_inference_steps=4, guidance_scale=2.5)
    out = tmp_path / "png"
    common = [folder, "--class_labels", "0,1", "--num_images", "2", "--output_dir", out]
    rc, err = _sample([*common, "--guidance_interval", "0.8:0.95"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "(t = 0, 0.25, 0.5, 0.75)" in err and "--guidance_interval" in err and "--num_inference_steps" in err
    assert not out.exists()
    saved = _folder(tmp_path / "saved", num_inference_steps=4, guidance_scale=2.5, guidance_interval=[0.8, 0.95])
    rc, err = _sample([saved, *common[1:]], capsys)
    assert rc == 2 and "0.8:0.95 holds none" in err and not out.exists(), err
    rc, err = _sample([folder, *common[1:], "--save_pipeline", tmp_path / "new", "--class_labels", "",
                       "--guidance_interval", "0.8:0.95"], capsys)
    assert rc == 2 and "0.8:0.95 holds none" in err and not (tmp_path / "new").exists(), err  # the defaults it saves
    rc, err = _sample([*common, "--guidance_interval", "0.8:0.95", "--num_inference_steps", "8"], capsys)
    assert rc == 0 and (out / "grid.png").is_file(), err


def _custom_code(folder, marker):
    """The folder's unet recorded as a module of its own, which would write ``marker`` when run."""
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "unet": ["my_unet", "MyUNet"]}))
    (folder / "unet" / "my_unet.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                                "from diffusers import UNet2DModel as MyUNet\n")


def _custom_pipeline(folder, marker):
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": ["my_pipeline", "MyPipeline"]}))
    (folder / "my_pipeline.py").write_text(f"open({str(marker)!r}, 'w').close()\n")


def _pickled_unet(folder, marker):
    unet = FlowUNet2DModel.from_pretrained(folder / "unet")
    (folder / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    unet.save_pretrained(folder / "unet", safe_serialization=False)


def _cut_unet(folder, marker):
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _language_model(folder, marker):
    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM

    shutil.rmtree(folder)
    CgptForCausalLM(CgptConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8)).save_pretrained(folder)


@pytest.mark.parametrize("as_guide, damage, words", [
    (False, _custom_code, "my_unet.MyUNet, code of the folder's own, which hf_cgpu never runs"),
    (False, _custom_pipeline, "names the pipeline class my_pipeline.MyPipeline, not FlowMatchPipeline"),
    (False, _pickled_unet, "only as a pickle (diffusion_pytorch_model.bin), which hf_cgpu never loads"),
    (False, _cut_unet, "weights cannot be read"),
    (True, _pickled_unet, "only as a pickle (diffusion_pytorch_model.bin), which hf_cgpu never loads"),
    (True, _cut_unet, "weights cannot be read"),
    (True, _language_model, "holds a language model (cgpt), not a FlowUNet2DModel"),
    (True, _custom_code, None),  # a guide is read as a UNet folder with hf_cgpu's class: the folder's code never runs
], ids=["code", "pipeline-code", "pickle", "cut", "guide-pickle", "guide-cut", "guide-language-model", "guide-code"])
def test_a_folder_that_does_not_load_as_saved_is_one_line_and_nothing_of_it_runs(as_guide, damage, words, tmp_path,
                                                                                  capsys):
    """A pipeline folder (MODEL_DIR or --guidance_model) with code of its own, pickled weights, weights cut off, or a
    language model where a UNet belongs gave tracebacks, or had its .bin unpickled silently; now one line naming the
    fix, exit 2, and the folder's code never runs."""
    marker = tmp_path / "ran"
    bad = _folder(tmp_path / "bad", guidance_interval=[0.2, 0.9])  # two numbers in model_index.json, no component
    damage(bad, marker)
    good = _folder(tmp_path / "good", guidance_interval=[0.2, 0.9])
    argv = [good, "--guidance_model", bad, "--guidance_scale", "2"] if as_guide else [bad]
    rc, err = _sample([*argv, "--class_labels", "0", "--num_images", "1", "--output_dir", tmp_path / "png"], capsys)
    assert not marker.exists()
    if words is None:
        assert rc == 0 and (tmp_path / "png" / "grid.png").is_file(), err
        return
    assert rc == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert words in err and not (tmp_path / "png").exists(), err


def test_sample_replaces_links_in_what_it_writes_never_writes_through_them(tmp_path, capsys):
    """samples_cli/grid.png linked to another file: that file was overwritten. Every file sample writes (the grid,
    each image, the --save_pipeline folder's files) replaces what is there whole: the link goes, the file behind it
    keeps its bytes."""
    folder = _folder(tmp_path / "pipe")
    (folder / "class_names.txt").write_text("a\nb\nc\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "png"
    out.mkdir()
    for name in ("grid.png", "0000.png"):
        (out / name).symlink_to(victim)
    saved = _folder(tmp_path / "saved")  # an earlier saved pipeline, its files linked
    for name in ("model_index.json", "unet/config.json", "class_names.txt"):
        (saved / name).unlink(missing_ok=True)
        (saved / name).symlink_to(victim)
    rc, err = _sample([folder, "--class_labels", "0,1", "--num_images", "2", "--output_dir", out, "--save_pipeline",
                       saved], capsys)
    assert rc == 0, err
    assert victim.read_bytes() == b"keep me"
    assert not any(p.is_symlink() for p in [*out.iterdir(), *saved.rglob("*")])
    assert Image.open(out / "grid.png").size == (2 * 10 + 2, 10 + 2) and Image.open(out / "0000.png").size == (8, 8)
    assert FlowMatchPipeline.from_pretrained(saved).config.num_inference_steps == 8
    assert (saved / "class_names.txt").read_text() == "a\nb\nc\n"
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    rc, err = _sample([folder, "--num_images", "1", "--output_dir", out, "--save_pipeline", other], capsys)
    assert rc == 2 and "holds other files" in err and (other / "todo.txt").read_text() == "mine", err
