"""hf-cgpu train flow-distill on the synthetic CIFAR-shaped set (CPU): a teacher flow run, its distillation into a
step-size conditioned student, the saved folder's defaults (Euler, 2 steps, one network evaluation each), exact
resume, and the folder loading through diffusers where hf_cgpu is absent."""

import json
import shutil

import numpy as np
import pytest
import torch
from isolation import run_without_hf_cgpu
from safetensors.torch import load_file, save_file

from hf_cgpu import FlowMatchPipeline
from hf_cgpu.budget.card import CPU
from hf_cgpu.cli import main as cli_main
from hf_cgpu.commands.budget import price
from hf_cgpu.commands.budget import run as run_budget
from hf_cgpu.flow.scheduling_flow_match import FlowMatchEulerScheduler
from hf_cgpu.integrity import update_manifest
from hf_cgpu.train.checkpoint import list_checkpoints


def _train(name, out, *argv):
    assert cli_main(["train", name, "--preset", "tiny", "--output_dir", str(out), "--progress", "false", *argv]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data):
    root = tmp_path_factory.mktemp("distill")
    _train("flow", root / "teacher", "--dataset", str(synthetic_data), "--base_channels", "8", "--max_steps", "4",
           "--checkpointing_steps", "0", "--limit", "64", "--guidance_interval", "0.2:0.9")
    _train("flow-distill", root / "student", "--teacher", str(root / "teacher"), "--dataset", str(synthetic_data))
    return root


def test_distilled_folder_samples_in_two_evaluations_with_guidance_baked_in(runs):
    out = runs / "student"
    results = json.loads((out / "all_results.json").read_text())
    assert results["steps"] == 12 and results["card"] == "flow-distill" and "base_val_loss" in results
    assert results["teacher_guidance_scale"] == 2.5 and results["teacher_guidance_interval"] == "0.2:0.9"
    priced = price("flow-distill", ["--preset", "tiny", "--teacher", str(runs / "teacher")], CPU)
    assert results["ledger"]["step_seconds"] == pytest.approx(priced["step_s"], rel=1e-4)  # as `hf-cgpu budget`
    pipe = FlowMatchPipeline.from_pretrained(out)
    assert isinstance(pipe.scheduler, FlowMatchEulerScheduler) and pipe.unet.config.step_size_embedding
    assert pipe.config.num_inference_steps == 2 and pipe.config.guidance_scale == 1.0
    seen = []
    pipe.unet.register_forward_pre_hook(lambda m, a, kw: seen.append((a[0].shape[0], kw["step_size"].tolist())),
                                        with_kwargs=True)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(class_labels=[1, 2], generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (2, 32, 32, 3)
    assert seen == [(2, [0.5, 0.5]), (2, [0.5, 0.5])]  # two calls, one row an image, each told its step of 1/2
    teacher = FlowMatchPipeline.from_pretrained(runs / "teacher")
    saved = load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors"))
    assert set(saved) - set(teacher.unet.state_dict()) == {k for k in saved if k.startswith("step_mlp.")} != set()
    card = (out / "README.md").read_text()
    assert "flow-distill" in card and "shortcut" in card


def test_the_card_states_the_folders_own_figures(runs, synthetic_data, tmp_path):
    """Parameters, steps, evaluations and the guidance baked in, each as the folder holds it: a 1-step student's
    card says 1 step, a teacher's guidance scale and interval are named, the snippet asks for the run's classes."""
    pipe = FlowMatchPipeline.from_pretrained(runs / "student")
    card = " ".join((runs / "student" / "README.md").read_text().split())  # the template's line breaks as spaces
    assert f"{sum(p.numel() for p in pipe.unet.parameters()):,} parameters; 12 optimizer steps" in card
    assert "2 Euler steps (one network evaluation each" in card
    assert "classifier-free guidance (scale 2.5, t in 0.2:0.9) is baked in" in card
    assert "class_labels=list(range(10))).images # the saved default: 2 steps" in card
    _train("flow-distill", tmp_path / "one", "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data),
           "--max_steps", "1", "--sample_steps", "1", "--guidance_scale", "3", "--guidance_interval", "full")
    card = " ".join((tmp_path / "one" / "README.md").read_text().split())
    assert "1 Euler step (one network evaluation" in card and "the saved default: 1 step " in card
    assert "classifier-free guidance (scale 3, t in full) is baked in" in card


def _died_after_first_checkpoint(run, tmp_path):
    """A copy of the finished ``run`` as if it had died after its first checkpoint (step 6)."""
    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    for p in list_checkpoints(cut)[1:]:
        shutil.rmtree(p)
    for name in ("all_results.json", "history.json"):
        (cut / name).unlink()
    return cut


def test_resume_from_mid_run_checkpoint_is_bit_identical(runs, synthetic_data, tmp_path):
    full = runs / "student"
    cut = _died_after_first_checkpoint(full, tmp_path)
    _train("flow-distill", cut, "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data),
           "--resume_from_checkpoint", "latest")
    a = {h["step"]: h["train/loss"] for h in json.loads((full / "history.json").read_text()) if "train/loss" in h}
    b = {h["step"]: h["train/loss"] for h in json.loads((cut / "history.json").read_text()) if "train/loss" in h}
    assert sorted(b) == list(range(1, 13)) and all(a[k] == b[k] for k in b)
    wa = load_file(str(full / "unet" / "diffusion_pytorch_model.safetensors"))
    wb = load_file(str(cut / "unet" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_resume_after_the_teacher_changed_is_refused(runs, synthetic_data, tmp_path, capsys):
    """Same --teacher path, other weights: written over its sealed file, the teacher's manifest refuses it; retrained
    in place (sealed again), the fingerprint's teacher hash does."""
    teacher, student = tmp_path / "teacher", tmp_path / "student"
    shutil.copytree(runs / "teacher", teacher)
    common = ["--teacher", str(teacher), "--dataset", str(synthetic_data)]
    _train("flow-distill", student, *common, "--max_steps", "2", "--checkpointing_steps", "2")
    unet = teacher / "unet" / "diffusion_pytorch_model.safetensors"
    save_file({k: v + 1e-3 for k, v in load_file(str(unet)).items()}, str(unet))
    resume = ["train", "flow-distill", "--preset", "tiny", "--output_dir", str(student), "--progress", "false",
              *common, "--max_steps", "4", "--resume_from_checkpoint", "latest"]
    rc = cli_main(resume)
    err = capsys.readouterr().err
    assert rc == 2 and "--teacher" in err and "unet/diffusion_pytorch_model.safetensors" in err, err
    update_manifest(teacher, ["unet/diffusion_pytorch_model.safetensors"])
    rc = cli_main(resume)
    err = capsys.readouterr().err
    assert rc == 2 and "teacher_weights" in err and len(err.strip().splitlines()) == 1, err
    assert "(--" not in err  # a content hash: no flag sets it, so none is suggested


def test_a_resume_after_the_teachers_saved_guidance_changed_is_refused(runs, synthetic_data, tmp_path, capsys):
    """Same weights, another saved guidance (the teacher folder re-saved at scale 4 after a kill): the student bakes
    in the guidance it resolves from the folder, so a resume took 2.5 for its first steps and 4 for the rest while the
    card said 4. The resolved scale and interval are the run's fixed settings: the resume is refused naming the flag
    that resumes it, and with that flag it resumes at the recorded guidance."""
    teacher, student = tmp_path / "teacher", tmp_path / "student"
    shutil.copytree(runs / "teacher", teacher)
    common = ["--teacher", str(teacher), "--dataset", str(synthetic_data), "--max_steps", "4"]
    _train("flow-distill", student, *common[:-2], "--max_steps", "2", "--checkpointing_steps", "2")
    assert json.loads((student / "all_results.json").read_text())["settings"]["guidance_scale"] == 2.5
    index = teacher / "model_index.json"
    saved = json.loads(index.read_text())
    for changed, named in (({"guidance_scale": 4.0}, "'guidance_scale': (2.5, 4.0)"),
                           ({"guidance_interval": [0.1, 0.9]}, "'guidance_interval': ('0.2:0.9', '0.1:0.9')")):
        index.write_text(json.dumps({**saved, **changed}))
        update_manifest(teacher, ["model_index.json"])  # re-saved as hf_cgpu saves: sealed again
        capsys.readouterr()
        rc = cli_main(["train", "flow-distill", "--preset", "tiny", "--output_dir", str(student), "--progress",
                       "false", *common, "--resume_from_checkpoint", "latest"])
        err = capsys.readouterr().err
        assert rc == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert "(--guidance_interval 0.2:0.9)" in err
    _train("flow-distill", student, *common, "--resume_from_checkpoint", "latest", "--guidance_interval", "0.2:0.9")
    results = json.loads((student / "all_results.json").read_text())
    assert results["steps"] == 4 and results["teacher_guidance_scale"] == 2.5
    assert results["teacher_guidance_interval"] == "0.2:0.9"


def test_bad_teacher_is_one_line_and_exit_2(runs, synthetic_data, tmp_path, capsys):
    coded, cut = tmp_path / "coded", tmp_path / "cut"
    shutil.copytree(runs / "teacher", coded)
    index = json.loads((coded / "model_index.json").read_text())
    (coded / "model_index.json").write_text(json.dumps({**index, "unet": ["my_unet", "MyUNet"]}))
    update_manifest(coded, ["model_index.json"])  # sealed: the loader, not the seal, refuses its code
    shutil.copytree(runs / "teacher", cut)
    weights = cut / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    for teacher, words in (("", "--teacher"), (str(tmp_path), "model_index.json"),
                           (str(runs / "student"), "already a distilled"), (str(coded), "never runs"),
                           (str(cut), "truncated")):  # the seal sees the cut before the loader
        rc = cli_main(["train", "flow-distill", "--preset", "tiny", "--output_dir", str(tmp_path / "x"),
                       "--teacher", teacher, "--dataset", str(synthetic_data), "--progress", "false"])
        err = capsys.readouterr().err
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("run", [pytest.param("student", marks=pytest.mark.slow),
                                 pytest.param("gan", marks=pytest.mark.slow)])
def test_loads_through_diffusers_without_hf_cgpu(run, request, tmp_path):
    """The distilled folder, and the adversarial stage's (its discriminator stays in the checkpoints): plain diffusers
    samples them as hf_cgpu does."""
    folder = request.getfixturevalue("runs") / run
    if run == "gan":
        request.getfixturevalue("gan")
        assert not [p for p in folder.iterdir() if p.name.endswith(".safetensors")]
        assert sorted(p.name for p in (folder / "unet").iterdir() if p.suffix == ".safetensors") == [
            "diffusion_pytorch_model.safetensors"]
    local = FlowMatchPipeline.from_pretrained(folder)
    local.set_progress_bar_config(disable=True)
    expected = local(class_labels=[0, 1], generator=torch.Generator().manual_seed(42), output_type="np").images
    run_without_hf_cgpu(
        f"""
        import numpy as np, torch
        from diffusers import DiffusionPipeline
        d = {str(folder)!r}
        pipe = DiffusionPipeline.from_pretrained(d, custom_pipeline=d, trust_remote_code=True)
        pipe.set_progress_bar_config(disable=True)
        assert type(pipe.unet).__module__.startswith("diffusers_modules"), type(pipe.unet).__module__
        assert pipe.unet.config.step_size_embedding and pipe.config.num_inference_steps == 2
        images = pipe(class_labels=[0, 1], generator=torch.Generator().manual_seed(42), output_type="np").images
        np.save({str(tmp_path / "out.npy")!r}, images)
        print("OK")
        """,
        tmp_path,
    )
    assert np.allclose(np.load(tmp_path / "out.npy"), expected, atol=1e-5)


def test_a_teacher_saved_with_autoguidance_is_distilled_as_it_samples(runs, synthetic_data, tmp_path, monkeypatch):
    """A teacher folder written by `hf-cgpu sample --guidance_model raw --save_pipeline` is distilled with its
    autoguidance (the teacher's velocity is the one its pipeline samples with), and the run records which guide."""
    from hf_cgpu.tasks.flow_distill import FlowDistillTask

    guided = tmp_path / "guided"
    assert cli_main(["sample", str(runs / "teacher"), "--num_images", "1", "--class_labels", "0", "--guidance_model",
                     "raw", "--guidance_scale", "2", "--output_dir", str(tmp_path / "png"),
                     "--save_pipeline", str(guided)]) == 0
    tasks, setup = [], FlowDistillTask.setup
    monkeypatch.setattr(FlowDistillTask, "setup", lambda self, *a: (tasks.append(self), setup(self, *a))[1])
    _train("flow-distill", tmp_path / "student", "--teacher", str(guided), "--dataset", str(synthetic_data),
           "--max_steps", "2")
    results = json.loads((tmp_path / "student" / "all_results.json").read_text())
    assert results["teacher_guidance_model"] == "raw (step_0000004)" and results["teacher_guidance_scale"] == 2.0
    card = " ".join((tmp_path / "student" / "README.md").read_text().split())
    assert "autoguidance by raw (step_0000004) (scale 2, t in 0.2:0.9) is baked in" in card
    assert "classifier-free" not in card
    pipe = FlowMatchPipeline.from_pretrained(guided)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    with torch.no_grad():
        for t in (0.5, 0.1):  # inside the saved interval 0.2:0.9 guided, outside the teacher alone
            want = pipe._velocity(x, torch.tensor(t), y, 2.0 if 0.2 <= t <= 0.9 else 1.0)
            torch.testing.assert_close(tasks[0].teacher_fn(x, torch.full((2,), t), y), want)


def test_a_guide_for_the_distilled_folder_needs_a_scale(runs, tmp_path, capsys):
    """The distilled folder saves guidance scale 1 (its guidance is baked in): a --guidance_model given without
    --guidance_scale would guide nothing at the cost of a second network call, so it is refused in one line; with a
    scale it guides (two evaluations a step, one of them the early checkpoint's)."""
    early = list_checkpoints(runs / "student")[0]
    common = ["--num_images", "2", "--class_labels", "c3,1", "--guidance_model", str(early), "--output_dir",
              str(tmp_path / "png")]
    capsys.readouterr()
    assert cli_main(["sample", str(runs / "student"), *common]) == 2
    err = capsys.readouterr().err
    assert "--guidance_scale" in err and len(err.strip().splitlines()) == 1, err
    assert cli_main(["sample", str(runs / "student"), *common, "--guidance_scale", "3", "--num_inference_steps", "1"]
                    ) == 0


def test_a_guidance_scale_for_an_unconditional_teacher_without_a_guide_is_refused(synthetic_data, tmp_path, capsys):
    """With no class (and no saved guide) there is nothing to guide with: --guidance_scale 3 was silently distilled at
    scale 1; now one line naming the fix."""
    _train("flow", tmp_path / "u", "--dataset", str(synthetic_data), "--base_channels", "8", "--max_steps", "1",
           "--checkpointing_steps", "0", "--limit", "32", "--class_conditional", "false")
    capsys.readouterr()
    rc = cli_main(["train", "flow-distill", "--preset", "tiny", "--output_dir", str(tmp_path / "d"), "--progress",
                   "false", "--teacher", str(tmp_path / "u"), "--dataset", str(synthetic_data), "--guidance_scale", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "--guidance_model" in err and len(err.strip().splitlines()) == 1, err


def test_save_pipeline_never_overwrites_another_run(runs, tmp_path, capsys):
    """`sample TEACHER --save_pipeline STUDENT` would have replaced the distilled run's weights by the teacher's."""
    unet = runs / "student" / "unet" / "diffusion_pytorch_model.safetensors"
    before = unet.read_bytes()
    capsys.readouterr()
    assert cli_main(["sample", str(runs / "teacher"), "--num_images", "1", "--output_dir", str(tmp_path / "png"),
                     "--save_pipeline", str(runs / "student")]) == 2
    err = capsys.readouterr().err
    assert "training run" in err and len(err.strip().splitlines()) == 1, err
    assert unet.read_bytes() == before


# ----------------------------------------------------------------------------------------- guidance as an input
RANGE = ["--guidance_range", "1:3"]


@pytest.fixture(scope="module")
def guided(runs, synthetic_data):
    """The student trained over guidance 1..3 (each example its own w): 12 steps, checkpoints at 6 and 12."""
    _train("flow-distill", runs / "guided", "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data),
           *RANGE)
    return runs / "guided"


def _task(monkeypatch):
    """The FlowDistillTask instances set up while the monkeypatch holds (appended to the returned list)."""
    from hf_cgpu.tasks.flow_distill import FlowDistillTask

    tasks, setup = [], FlowDistillTask.setup
    monkeypatch.setattr(FlowDistillTask, "setup", lambda self, *a: (tasks.append(self), setup(self, *a))[1])
    return tasks


def test_the_teacher_guides_each_example_at_its_own_scale(runs, synthetic_data, tmp_path, monkeypatch):
    """With --guidance_range the teacher's target of each row is v_u + w_i (v_c - v_u) with the row's own w (the
    saved interval 0.2:0.9 still applies: outside it the conditional velocity), two scales in one batch."""
    tasks = _task(monkeypatch)
    _train("flow-distill", tmp_path / "d", "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data),
           *RANGE, "--max_steps", "1", "--checkpointing_steps", "0")
    unet = FlowMatchPipeline.from_pretrained(runs / "teacher").unet
    g = torch.Generator().manual_seed(0)
    x, y, w = torch.randn(3, 3, 32, 32, generator=g), torch.tensor([1, 3, 3]), torch.tensor([1.5, 2.75, 2.75])
    t = torch.tensor([0.5, 0.5, 0.1])  # the third row outside the interval
    with torch.no_grad():
        cond, uncond = unet(x, t, y).sample, unet(x, t, torch.full_like(y, 10)).sample
        want = uncond + w[:, None, None, None] * (cond - uncond)
        want[2] = cond[2]
        torch.testing.assert_close(tasks[0].teacher_fn(x, t, (y, w)), want, rtol=1e-4, atol=1e-5)
    told = []  # the student is told each row's own w, drawn in the range
    student = FlowMatchPipeline.from_pretrained(tmp_path / "d").unet
    student.register_forward_pre_hook(lambda m, a, kw: told.append(kw.get("guidance")), with_kwargs=True)
    with torch.no_grad():
        tasks[0].shortcut_loss(student, {"x1": torch.randn(8, 3, 32, 32, generator=g), "labels": torch.arange(8)}, g)
    w = told[-1]  # the loss's own call on every row (the targets' calls come first)
    assert w is not None and w.shape == (8,) and len(set(w.tolist())) == 8 and 1 <= w.min() <= w.max() <= 3


def test_the_student_takes_the_guidance_scale_once_trained(guided, runs):
    """At init the zero-initialised guidance input changes nothing (the student is the teacher at every w); after
    the run's steps its velocity depends on w. The folder records the range and the teacher's scale as default."""
    from hf_cgpu.flow.unet import FlowUNet2DModel

    pipe = FlowMatchPipeline.from_pretrained(guided)
    assert pipe.unet.config.guidance_embedding and pipe.takes_guidance
    assert pipe.config.guidance_range == [1.0, 3.0] and pipe.config.guidance_scale == 2.5
    results = json.loads((guided / "all_results.json").read_text())
    assert results["settings"]["guidance_range"] == "1:3" and results["settings"]["sample_guidance"] == 2.5
    priced = price("flow-distill", ["--preset", "tiny", "--teacher", str(runs / "teacher"), *RANGE], CPU)
    assert results["ledger"]["step_seconds"] == pytest.approx(priced["step_s"], rel=1e-4)  # as `hf-cgpu budget`
    card = " ".join((guided / "README.md").read_text().split())
    assert "classifier-free guidance (t in 0.2:0.9) is an input: trained over scales w in 1:3" in card, card
    assert "saved default 2.5;" in card and "baked in" not in card
    teacher = FlowMatchPipeline.from_pretrained(runs / "teacher").unet
    start = FlowUNet2DModel(**{**teacher.config, "step_size_embedding": True, "guidance_embedding": True}).eval()
    start.load_state_dict(teacher.state_dict(), strict=False)
    x, t, y, d = torch.randn(2, 3, 32, 32), torch.tensor([0.3, 0.6]), torch.tensor([0, 5]), torch.tensor([0.5, 1.0])
    with torch.no_grad():
        for model, differ in ((start, False), (pipe.unet, True)):
            a = model(x, t, y, step_size=d, guidance=1.0).sample
            b = model(x, t, y, step_size=d, guidance=3.0).sample
            assert (not torch.equal(a, b)) == differ


def test_the_guided_student_resumes_bit_identical(guided, runs, synthetic_data, tmp_path):
    """Killed after step 6 and resumed with the range on: every example's w is drawn from the run's generator, so
    every later loss and the saved student are the uninterrupted run's, bit for bit."""
    cut = _died_after_first_checkpoint(guided, tmp_path)
    _train("flow-distill", cut, "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data), *RANGE,
           "--resume_from_checkpoint", "latest")
    a = {h["step"]: h["train/loss"] for h in json.loads((guided / "history.json").read_text()) if "train/loss" in h}
    b = {h["step"]: h["train/loss"] for h in json.loads((cut / "history.json").read_text()) if "train/loss" in h}
    assert sorted(b) == list(range(1, 13)) and all(a[k] == b[k] for k in b), (a, b)
    wa = load_file(str(guided / "unet" / "diffusion_pytorch_model.safetensors"))
    wb = load_file(str(cut / "unet" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_without_the_range_the_loss_is_the_fixed_scales(runs, synthetic_data, tmp_path, monkeypatch):
    """Off (the default), a step's loss is the objective's with the one baked-in scale and the student told no w,
    drawing the same random numbers: the plain run's weights stay those it had before the option existed."""
    from hf_cgpu.flow.shortcut import guided_teacher

    tasks = _task(monkeypatch)
    _train("flow-distill", tmp_path / "d", "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data),
           "--max_steps", "1", "--checkpointing_steps", "0")
    task = tasks[0]
    model = FlowMatchPipeline.from_pretrained(tmp_path / "d").unet
    assert "guidance_range" not in json.loads((tmp_path / "d" / "model_index.json").read_text())
    assert model.guidance_mlp is None and task.cfg.sample_guidance == 0.0
    g = torch.Generator().manual_seed(0)
    batch = {"x1": torch.randn(8, 3, 32, 32, generator=g), "labels": torch.arange(8) % 10}
    teacher = guided_teacher(lambda x, t, y: task.teacher(x, t, y).sample, 10, 2.5, (0.2, 0.9))
    with torch.no_grad():
        got = task.shortcut_loss(model, batch, torch.Generator().manual_seed(1))
        gen = torch.Generator().manual_seed(1)
        t_flow = task.matcher.sample_time(task.objective.flow_rows(8), "cpu", gen)
        want = task.objective.loss(lambda x, t, d, y: model(x, t, y, step_size=d).sample, teacher, batch["x1"],
                                   t_flow, gen, batch["labels"])
    assert torch.equal(got, want)


@pytest.mark.slow  # a subprocess loading the folder through plain diffusers: the slow tier
def test_the_guided_folder_samples_at_any_w_with_one_call_a_step(guided, tmp_path):
    """guidance_scale is the student's input: two scales give two different images, each step one UNet call of one
    row an image told that w; plain diffusers without hf_cgpu samples the same images at both scales."""
    pipe = FlowMatchPipeline.from_pretrained(guided)
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe.unet.register_forward_pre_hook(lambda m, a, kw: seen.append((a[0].shape[0], kw["guidance"].tolist())),
                                        with_kwargs=True)
    images = {}
    for w in (1.0, 3.0):
        images[w] = pipe(class_labels=[0, 1], guidance_scale=w, generator=torch.Generator().manual_seed(42),
                         output_type="np").images
    assert seen == [(2, [1.0, 1.0])] * 2 + [(2, [3.0, 3.0])] * 2  # 2 steps each, one row an image
    assert np.abs(images[1.0] - images[3.0]).max() > 1e-3
    run_without_hf_cgpu(
        f"""
        import numpy as np, torch
        from diffusers import DiffusionPipeline
        d = {str(guided)!r}
        pipe = DiffusionPipeline.from_pretrained(d, custom_pipeline=d, trust_remote_code=True)
        pipe.set_progress_bar_config(disable=True)
        assert pipe.unet.config.guidance_embedding and pipe.config.guidance_range == [1.0, 3.0]
        out = [pipe(class_labels=[0, 1], guidance_scale=w, generator=torch.Generator().manual_seed(42),
                    output_type="np").images for w in (1.0, 3.0)]
        np.save({str(tmp_path / "out.npy")!r}, np.stack(out))
        print("OK")
        """,
        tmp_path,
    )
    theirs = np.load(tmp_path / "out.npy")
    assert np.allclose(theirs[0], images[1.0], atol=1e-5) and np.allclose(theirs[1], images[3.0], atol=1e-5)
    assert cli_main(["sample", str(guided), "--class_labels", "0,1", "--num_images", "2", "--guidance_scale", "1.5",
                     "--output_dir", str(tmp_path / "png")]) == 0  # any w of the range from the command line


def test_a_guided_student_takes_its_scale_without_labels_and_a_plain_folder_does_not(guided, runs, tmp_path,
                                                                                     capsys):
    """The student is told w, so `sample --guidance_scale` needs no class labels or guidance model for it (nor does
    `budget --task sample`); a folder whose UNet is not told w still refuses a scale with nothing to guide by, in one
    line, before any image is written."""
    assert cli_main(["sample", str(guided), "--num_images", "2", "--guidance_scale", "1.5", "--output_dir",
                     str(tmp_path / "w")]) == 0
    assert "images/s" in run_budget(["--task", "sample", str(guided), "--guidance_scale", "1.5"])
    capsys.readouterr()
    for argv in (["sample", str(runs / "student"), "--guidance_scale", "2", "--output_dir", str(tmp_path / "x")],
                 ["budget", "--task", "sample", str(runs / "student"), "--guidance_scale", "2"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--guidance_scale needs --class_labels" in err[0], err
    assert not (tmp_path / "x").exists()


def test_bad_guidance_ranges_are_one_line_and_exit_2(guided, runs, synthetic_data, tmp_path, capsys):
    """A range below 1 or upside down, a saved default outside it, a range on an unconditional teacher without a
    guidance model: one line, exit 2, no output folder. At sampling time a w outside the trained range is refused
    the same way (sample and eval), nothing written."""
    _train("flow", tmp_path / "u", "--dataset", str(synthetic_data), "--base_channels", "8", "--max_steps", "1",
           "--checkpointing_steps", "0", "--limit", "32", "--class_conditional", "false")
    cases = [(["--guidance_range", "0.5:3"], "1 <= LO <= HI"), (["--guidance_range", "3:2"], "1 <= LO <= HI"),
             (["--guidance_range", "1:3", "--sample_guidance", "4"], "--sample_guidance 4"),
             (["--guidance_range", "1:2"], "--sample_guidance within it"),
             (["--guidance_range", "1:3", "--teacher", str(tmp_path / "u")], "--guidance_model"),
             (["--guidance_range", "1:3", "--adversarial_weight", "0.1"], "--adversarial_weight")]
    for extra, words in cases:
        out = tmp_path / "x"
        capsys.readouterr()
        rc = cli_main(["train", "flow-distill", "--preset", "tiny", "--output_dir", str(out), "--progress", "false",
                       "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data), *extra])
        err = capsys.readouterr().err
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, (words, err)
        assert not out.exists()
    cut = tmp_path / "cut"  # a resume with another range: the fingerprint refuses it
    shutil.copytree(guided, cut)
    capsys.readouterr()
    rc = cli_main(["train", "flow-distill", "--preset", "tiny", "--output_dir", str(cut), "--progress", "false",
                   "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data), "--guidance_range", "1:4",
                   "--max_steps", "14", "--resume_from_checkpoint", "latest"])
    err = capsys.readouterr().err
    assert rc == 2 and "'guidance_range': ('1:3', '1:4')" in err and len(err.strip().splitlines()) == 1, err
    from hf_cgpu.evaluation.classifier import ClassifierConfig, CifarResNet, save_classifier

    save_classifier(CifarResNet(ClassifierConfig(widths=[8, 8, 8, 8])), tmp_path / "judge")
    png, scores = tmp_path / "png", tmp_path / "scores"
    for argv in (["sample", str(guided), "--class_labels", "0", "--guidance_scale", "4", "--output_dir", str(png)],
                 ["eval", str(guided), "--classifier", str(tmp_path / "judge"), "--dataset", str(synthetic_data),
                  "--guidance_scale", "3.5", "--output_dir", str(scores)],
                 ["eval", str(guided), "--classifier", str(tmp_path / "judge"), "--dataset", str(synthetic_data),
                  "--sweep", "--sweep_steps", "1", "--sweep_guidance", "1,4", "--output_dir", str(scores)]):
        rc = cli_main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and "1:3" in err and len(err.strip().splitlines()) == 1, err
    assert not png.exists() and not scores.exists()


# ---------------------------------------------------------------------------------------------- the adversarial stage
GAN = ["--adversarial_weight", "0.5", "--disc_width", "16"]


@pytest.fixture(scope="module")
def gan(runs, synthetic_data):
    """The adversarial stage started from the distilled student: 12 steps, checkpoints at 6 and 12."""
    _train("flow-distill", runs / "gan", "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data),
           "--init_student", str(runs / "student"), *GAN)
    return runs / "gan"


@pytest.mark.slow  # trains the adversarial stage (the slow tier: `-m slow`)
def test_the_adversarial_stage_trains_a_discriminator_and_starts_from_the_student(gan, runs):
    """The checkpoints hold the heads and their optimizer beside the student; the student moved from its start; the
    run's ledger prices the stage, as `hf-cgpu budget` does."""
    results = json.loads((gan / "all_results.json").read_text())
    assert results["steps"] == 12 and results["settings"]["adversarial_weight"] == 0.5
    argv = ["--preset", "tiny", "--teacher", str(runs / "teacher"), *GAN]
    priced, plain = (price("flow-distill", argv + more, CPU)["step_s"] for more in ([], ["--adversarial_weight", "0"]))
    assert results["ledger"]["step_seconds"] == pytest.approx(priced, rel=1e-4)
    assert priced > 1.5 * plain  # the fake samples' student calls and the critic on top of the shortcut term
    ckpt = list_checkpoints(gan)[0]
    heads = load_file(str(ckpt / "model_1.safetensors"))
    assert any(k.startswith("heads.2.") for k in heads) and (ckpt / "optimizer_1.bin").is_file()
    assert any(not torch.equal(heads[k], v) for k, v in load_file(str(list_checkpoints(gan)[1] /
                                                                      "model_1.safetensors")).items())
    start = load_file(str(runs / "student" / "unet" / "diffusion_pytorch_model.safetensors"))
    end = load_file(str(gan / "unet" / "diffusion_pytorch_model.safetensors"))
    base = json.loads((gan / "all_results.json").read_text())["base_val_loss"]
    assert base == json.loads((runs / "student" / "all_results.json").read_text())["val_loss"]  # its start
    assert set(start) == set(end) and any(not torch.equal(start[k], end[k]) for k in start)


@pytest.mark.slow  # trains the adversarial stage (the slow tier: `-m slow`)
def test_the_adversarial_stage_resumes_bit_identical(gan, runs, synthetic_data, tmp_path):
    """Killed after step 6 and resumed: the discriminator's weights and moments come back, so every later loss and
    the saved student are the uninterrupted run's, bit for bit."""
    cut = _died_after_first_checkpoint(gan, tmp_path)
    _train("flow-distill", cut, "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data),
           "--init_student", str(runs / "student"), *GAN, "--resume_from_checkpoint", "latest")
    a = {h["step"]: h["train/loss"] for h in json.loads((gan / "history.json").read_text()) if "train/loss" in h}
    b = {h["step"]: h["train/loss"] for h in json.loads((cut / "history.json").read_text()) if "train/loss" in h}
    assert sorted(b) == list(range(1, 13)) and all(a[k] == b[k] for k in b), (a, b)
    for name in ("unet/diffusion_pytorch_model.safetensors", "checkpoints/step_0000012/model_1.safetensors"):
        wa, wb = load_file(str(gan / name)), load_file(str(cut / name))
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name


def test_a_discriminator_checkpoint_that_does_not_fit_is_one_line(gan, runs, synthetic_data, tmp_path, capsys):
    """Heads of another width in the checkpoint (sealed again, so only their shapes are wrong): refused in one line,
    exit 2, and the run's folder is left as it was."""
    cut = tmp_path / "cut"
    shutil.copytree(gan, cut)
    ckpt = list_checkpoints(cut)[-1]
    heads = load_file(str(ckpt / "model_1.safetensors"))
    save_file({k: torch.cat([v, v]) for k, v in heads.items()}, str(ckpt / "model_1.safetensors"))
    update_manifest(ckpt, ["model_1.safetensors"])
    before = sorted(str(p.relative_to(cut)) for p in cut.rglob("*"))
    capsys.readouterr()
    rc = cli_main(["train", "flow-distill", "--preset", "tiny", "--output_dir", str(cut), "--progress", "false",
                   "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data), "--init_student",
                   str(runs / "student"), *GAN, "--resume_from_checkpoint", "latest"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(str(p.relative_to(cut)) for p in cut.rglob("*")) == before


@pytest.mark.slow  # trains the adversarial stage (the slow tier: `-m slow`)
def test_bad_inputs_of_the_adversarial_stage_are_one_line(runs, synthetic_data, tmp_path, capsys):
    """A student folder of another kind or shape, a teacher of another resolution than the real images, real images
    of other classes, a judge of other classes: one line, exit 2, no output folder."""
    import datasets
    import numpy as np
    from datasets import ClassLabel, Dataset, Features
    from datasets import Image as ImageFeature
    from PIL import Image

    from hf_cgpu.evaluation.classifier import ClassifierConfig, CifarResNet, save_classifier

    def folder(name, classes):
        out = tmp_path / name
        out.mkdir()
        feats = Features({"img": ImageFeature(), "label": ClassLabel(names=[f"c{k}" for k in range(classes)])})
        imgs = [Image.fromarray(np.full((32, 32, 3), 25 * k, np.uint8)) for k in range(classes)] * 2
        for split in ("train", "test"):
            Dataset.from_dict({"img": imgs, "label": list(range(classes)) * 2}, features=feats).to_parquet(
                out / f"{split}.parquet")
        return out

    _train("flow", tmp_path / "wide", "--dataset", str(synthetic_data), "--base_channels", "16", "--max_steps", "1",
           "--checkpointing_steps", "0", "--limit", "32")
    _train("flow-distill", tmp_path / "wide_student", "--teacher", str(tmp_path / "wide"), "--dataset",
           str(synthetic_data), "--max_steps", "1", "--checkpointing_steps", "0")
    small = tmp_path / "small"  # a teacher of another resolution (its UNet config says 16 px, sealed again)
    shutil.copytree(runs / "teacher", small)
    config = small / "unet" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "sample_size": 16}))
    update_manifest(small, ["unet/config.json"])
    judge = tmp_path / "judge5"
    save_classifier(CifarResNet(ClassifierConfig(num_classes=5, widths=[8, 8, 8, 8])), judge)
    cases = [(["--init_student", str(runs / "teacher")], "not a distilled pipeline"),
             (["--init_student", str(tmp_path / "wide_student")], "base_channels 16 vs 8"),
             (["--teacher", str(small)], "3x32x32 images, the teacher was trained on 3x16x16"),
             (["--dataset", str(folder("five", 5))], "5 classes, the teacher 10"),
             (["--judge", str(judge)], "tells 5 classes apart")]
    datasets.disable_progress_bars()  # the new parquet folder's first decode would draw a bar above the error
    for extra, words in cases:
        out = tmp_path / "x"
        argv = ["--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data), *GAN, *extra]  # the last wins
        capsys.readouterr()
        rc = cli_main(["train", "flow-distill", "--preset", "tiny", "--output_dir", str(out), "--progress", "false",
                       *argv])
        err = capsys.readouterr().err
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, (words, err)
        assert not out.exists()
    datasets.enable_progress_bars()


@pytest.mark.slow  # trains the adversarial stage (the slow tier: `-m slow`)
def test_the_judge_reports_the_rarest_class_and_the_card_states_it(runs, synthetic_data, tmp_path):
    """A judge that sees class 3 everywhere: the rarest class holds 0% of the samples, the asked class is found in a
    tenth of them; both reach all_results.json, and the card says the rarest class's share."""
    from hf_cgpu.evaluation.classifier import ClassifierConfig, CifarResNet, save_classifier

    judge = CifarResNet(ClassifierConfig(widths=[8, 8, 8, 8]))
    with torch.no_grad():
        judge.head.weight.zero_()
        judge.head.weight[3] = 1.0  # pooled ReLU features are >= 0: class 3 wins wherever any feature is on
    save_classifier(judge, tmp_path / "judge")
    _train("flow-distill", tmp_path / "d", "--teacher", str(runs / "teacher"), "--dataset", str(synthetic_data),
           "--max_steps", "2", "--judge", str(tmp_path / "judge"), "--judge_images", "20")
    results = json.loads((tmp_path / "d" / "all_results.json").read_text())
    assert results["rarest_class_share"] == 0.0 and results["judged_label_accuracy"] == 0.1
    card = " ".join((tmp_path / "d" / "README.md").read_text().split())
    assert "rarest class holds 0.0% of 20 samples" in card, card
