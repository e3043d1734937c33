"""The one training loop on a toy task: schedule, data order, exact resume, guards, atomic checkpoints."""

import dataclasses
import json
import math
import pickle
import shutil
import signal

import pytest
import torch

from hf_cgpu.commands.budget import preset_shape
from hf_cgpu.errors import CheckpointError, Interrupted, SettingsError, TrainingStopped
from hf_cgpu.integrity import build_manifest, write_manifest
from hf_cgpu.optim import OPTIMIZERS
from hf_cgpu.settings import TrainSettings
from hf_cgpu.train import SampleOrder, Task, TaskPlan, fit, lr_at
from hf_cgpu.train import checkpoint as ckpt_io


class ToyTask(Task):
    """Noisy linear regression; optional NaN injection at chosen steps (counted by calls to loss)."""

    unit = "sample"
    expected_initial_loss = None
    run_shape = None

    def __init__(self, nan_calls=(), width=8):
        self.nan_calls = set(nan_calls)
        self.calls = 0
        self.width = width

    def setup(self, settings, accelerator):
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(50, self.width, generator=g)
        self.y = self.x @ torch.randn(self.width, 1, generator=g)
        torch.manual_seed(settings.seed)
        model = torch.nn.Sequential(torch.nn.Linear(self.width, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
        return TaskPlan(model, expected_initial_loss=self.expected_initial_loss, shape=self.run_shape)

    def num_train_samples(self):
        return 50

    def train_batch(self, indices, device, generator):
        return {"x": self.x[indices].to(device), "y": self.y[indices].to(device)}

    def loss(self, model, batch, generator):
        self.calls += 1
        noise = 0.01 * torch.randn(batch["y"].shape, generator=generator, device=batch["y"].device)
        loss = ((model(batch["x"]) - batch["y"] - noise) ** 2).mean()
        if self.calls in self.nan_calls:
            loss = loss * float("nan")
        return loss

    def units(self, batch):
        return batch["x"].shape[0]

    def evaluate(self, model, settings, device):
        return {"val_loss": ((model(self.x) - self.y) ** 2).mean().item()}

    def save_pretrained(self, model, output_dir):
        torch.save(model.state_dict(), output_dir / "toy.pt")


def settings(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=12, micro_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=1e-2, warmup_steps=3, eval_steps=0, log_steps=1, checkpointing_steps=4,
                progress=False, mixed_precision="no")
    base.update(kw)
    return TrainSettings(**base)


def losses(out_dir):
    hist = json.loads((out_dir / "history.json").read_text())
    return [(h["step"], h["train/loss"]) for h in hist if "train/loss" in h]


def test_lr_schedule_closed_form():
    s = TrainSettings(learning_rate=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, s) == pytest.approx(0.1)
    assert lr_at(9, s) == pytest.approx(1.0)
    assert lr_at(60, s) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, s) == pytest.approx(0.1)


def test_sample_order_is_a_permutation_each_epoch():
    order = SampleOrder(10, seed=3)
    first = torch.cat([order.indices(k, 5) for k in range(2)])
    second = torch.cat([order.indices(k, 5) for k in range(2, 4)])
    assert sorted(first.tolist()) == list(range(10)) == sorted(second.tolist())
    assert not torch.equal(first, second)
    # a batch straddling an epoch boundary
    assert order.indices(1, 7).tolist()[:3] == first[7:].tolist()


def test_bad_settings_are_one_line_errors():
    with pytest.raises(SettingsError, match="unknown tier 'qlorax'; choose one of"):
        TrainSettings(tier="qlorax")
    with pytest.raises(SettingsError, match="micro_batch_size must be >= 1"):
        TrainSettings(micro_batch_size=0)


@pytest.mark.parametrize("optimizer", [*OPTIMIZERS, "adamw-fused"])
def test_resume_reproduces_uninterrupted_run_bit_for_bit(tmp_path, optimizer, request):
    """Every registered optimizer. adamw-fused: CUDA's optimizer, whose steps the loop reads one step late
    (``train.update``)."""
    if optimizer == "adamw-fused":
        request.getfixturevalue("fused_adamw")
        optimizer = "adamw"
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    fit(ToyTask(), settings(full_dir, optimizer=optimizer))
    with pytest.raises(Interrupted):
        fit(InterruptAt(6), settings(cut_dir, optimizer=optimizer))  # Ctrl-C during step 6
    # the interrupt saved step 6; drop it to resume from the periodic checkpoint at step 4 (mid-epoch)
    shutil.rmtree(ckpt_io.checkpoint_root(cut_dir) / "step_0000006")
    assert [p.name for p in ckpt_io.list_checkpoints(cut_dir)] == ["step_0000004"]
    fit(ToyTask(), settings(cut_dir, optimizer=optimizer, resume_from_checkpoint="latest"))
    assert_same_run(full_dir, cut_dir, range(5, 13))


def another_value(f: dataclasses.Field):
    """A valid value other than the field's default, for an optimizer's own setting."""
    default = f.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, float):
        return default / 2 if default else 0.5
    if isinstance(default, int):
        return default + 1
    choices = f.metadata.get("choices")
    choices = choices() if callable(choices) else choices
    if choices:
        return next(c for c in choices if c != default)
    raise AssertionError(f"{f.name}: no other value to try; teach another_value its type")


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_every_optimizers_own_settings_and_name_are_in_the_fingerprint(tmp_path, optimizer):
    """A resume with another value of any of the optimizer's own settings, or with another optimizer, is refused in
    one line naming it and both values: each would continue with other updates."""
    spec = OPTIMIZERS[optimizer]
    fit(ToyTask(), settings(tmp_path, optimizer=optimizer, max_steps=2, checkpointing_steps=1))
    resume = settings(tmp_path, optimizer=optimizer, max_steps=3, resume_from_checkpoint="latest")
    for f in dataclasses.fields(spec.settings) if spec.settings else ():
        value = another_value(f)
        changed = dataclasses.replace(resume, optimizer_options=dataclasses.replace(spec.settings(), **{f.name: value}))
        with pytest.raises(CheckpointError) as err:
            fit(ToyTask(), changed)
        assert f"{f.name!r}: ({f.default!r}, {value!r})" in str(err.value) and "\n" not in str(err.value), f.name
    other = next(name for name in OPTIMIZERS if name != optimizer)
    with pytest.raises(CheckpointError, match=f"'optimizer': \\('{optimizer}', '{other}'\\)"):
        fit(ToyTask(), settings(tmp_path, optimizer=other, max_steps=3, resume_from_checkpoint="latest"))


def assert_same_run(full_dir, cut_dir, steps):
    """The resumed run's losses at ``steps`` and its final weights equal the uninterrupted run's, bit for bit."""
    full, cut = dict(losses(full_dir)), dict(losses(cut_dir))
    assert max(cut) == max(full)
    for step in steps:
        assert cut[step] == full[step], step
    a = torch.load(full_dir / "toy.pt", weights_only=True)
    b = torch.load(cut_dir / "toy.pt", weights_only=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k


class InterruptAt(ToyTask):
    """Ctrl-C (a real SIGINT) in the middle of step ``step`` (1-based), ``times`` times in a row."""

    def __init__(self, step, times=1):
        super().__init__()
        self.stop_step, self.times = step, times

    def loss(self, model, batch, generator):
        if self.calls == (self.stop_step - 1) * 2 + 1:  # two micro-batches per step: the second one
            for _ in range(self.times):
                signal.raise_signal(signal.SIGINT)
        return super().loss(model, batch, generator)


def test_ctrl_c_ends_the_step_checkpoints_and_names_the_resume_command(tmp_path, capfd):
    with pytest.raises(Interrupted, match=r"interrupted \(Ctrl-C\) at step 6; checkpoint \S+step_0000006 is kept: "
                                          r"resume with: .* --resume_from_checkpoint latest$"):
        fit(InterruptAt(6), settings(tmp_path, max_steps=12))
    assert "Ctrl-C again stops at once" in capfd.readouterr().err
    assert [p.name for p in ckpt_io.list_checkpoints(tmp_path)] == ["step_0000004", "step_0000006"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_stops_at_once_and_names_the_newest_checkpoint(tmp_path):
    with pytest.raises(Interrupted, match=r"interrupted \(Ctrl-C\); checkpoint \S+step_0000004 is kept"):
        fit(InterruptAt(6, times=2), settings(tmp_path, max_steps=12))
    assert [p.name for p in ckpt_io.list_checkpoints(tmp_path)] == ["step_0000004"]  # the half-done step 6: no
    with pytest.raises(Interrupted, match="before the first checkpoint; start again with: .* --resume_from_checkpoin"):
        fit(InterruptAt(2, times=2), settings(tmp_path / "early", max_steps=12))


def test_nan_step_is_skipped_and_weights_unchanged(tmp_path, skip_on):
    task = ToyTask(nan_calls={5})  # third step's first micro-batch
    fit(task, settings(tmp_path, max_steps=4, checkpointing_steps=0))
    state = json.loads((ckpt_io.list_checkpoints(tmp_path)[-1] / "trainer_state.json").read_text())
    assert state["skipped_steps"] == 1
    assert json.loads((tmp_path / "all_results.json").read_text())["skipped_steps"] == 1


def test_nan_step_leaves_weights_untouched(tmp_path, skip_on):
    class Probe(ToyTask):
        def loss(self, model, batch, generator):
            if self.calls == 4:  # first micro-batch of step 2 (0-based): snapshot the weights before it
                self.before = [p.detach().clone() for p in model.parameters()]
            if self.calls == 6:  # first micro-batch of step 3: weights must equal the snapshot
                self.after = [p.detach().clone() for p in model.parameters()]
            return super().loss(model, batch, generator)

    task = Probe(nan_calls={5})
    fit(task, settings(tmp_path, max_steps=4, checkpointing_steps=0))
    for a, b in zip(task.before, task.after):
        assert torch.equal(a, b)


def test_repeated_nan_stops_with_checkpoint_and_diagnosis(tmp_path, skip_on):
    task = ToyTask(nan_calls=set(range(5, 100)))
    with pytest.raises(TrainingStopped, match=r"mixed_precision no.*cut it tenfold"):
        fit(task, settings(tmp_path, nan_patience=3, checkpointing_steps=0))
    ckpts = ckpt_io.list_checkpoints(tmp_path)
    assert ckpts, "a checkpoint of the last good state must be written before stopping"
    ckpt_io.verify(ckpts[-1])


def test_corrupted_checkpoint_falls_back_to_previous(tmp_path, capsys):
    fit(ToyTask(), settings(tmp_path, max_steps=8))
    ckpts = ckpt_io.list_checkpoints(tmp_path)
    assert [p.name for p in ckpts] == ["step_0000004", "step_0000008"]
    weights = next(ckpts[-1].glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated write
    found = ckpt_io.find_resumable(tmp_path, "latest")
    assert found == ckpts[0]
    assert "truncated" in capsys.readouterr().out
    (ckpts[0] / "optimizer.bin").unlink()
    with pytest.raises(ckpt_io.CheckpointError, match="missing optimizer.bin"):
        ckpt_io.verify(ckpts[0])
    assert ckpt_io.find_resumable(tmp_path, "latest") is None


def test_unsealed_checkpoint_is_ignored_and_pruned(tmp_path):
    (ckpt_io.checkpoint_root(tmp_path) / ".tmp-step_0000009").mkdir(parents=True)
    fit(ToyTask(), settings(tmp_path, max_steps=12, checkpoints_total_limit=2))
    assert [p.name for p in ckpt_io.list_checkpoints(tmp_path)] == ["step_0000008", "step_0000012"]
    assert not list(ckpt_io.checkpoint_root(tmp_path).glob(".tmp-*"))


def test_checkpoint_from_other_config_is_refused(tmp_path):
    fit(ToyTask(), settings(tmp_path, max_steps=4))
    with pytest.raises(ckpt_io.CheckpointError, match="different model"):
        fit(ToyTask(width=6), settings(tmp_path, max_steps=8, resume_from_checkpoint="latest"))


def test_ema_is_checkpointed_and_resumes_exactly(tmp_path, skip_on):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    fit(ToyTask(), settings(full_dir, ema_decay=0.9))
    with pytest.raises(Interrupted):
        fit(InterruptAt(7), settings(cut_dir, ema_decay=0.9))  # Ctrl-C: a checkpoint of step 7 is written first
    assert ckpt_io.list_checkpoints(cut_dir)[-1].name == "step_0000007"
    fit(ToyTask(), settings(cut_dir, ema_decay=0.9, resume_from_checkpoint="latest"))
    a = torch.load(full_dir / "toy.pt", weights_only=True)  # EMA weights are what gets saved
    b = torch.load(cut_dir / "toy.pt", weights_only=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_label_leak_warning(tmp_path, capsys):
    class Leaky(ToyTask):
        expected_initial_loss = 40.0  # toy first loss is ~9, far below: must warn

    fit(Leaky(), settings(tmp_path, max_steps=2))
    assert "label leak" in capsys.readouterr().out


class OOMBelow(ToyTask):
    """Raises CUDA OOM for micro-batches larger than ``fits`` (what a too-big batch does on a real card)."""

    def __init__(self, fits):
        super().__init__()
        self.fits = fits

    def loss(self, model, batch, generator):
        if batch["x"].shape[0] > self.fits:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().loss(model, batch, generator)


def test_oom_retries_with_half_micro_batch_same_effective_batch(tmp_path, capsys):
    fit(OOMBelow(fits=2), settings(tmp_path, max_steps=4, micro_batch_size=8, gradient_accumulation_steps=1))
    results = json.loads((tmp_path / "all_results.json").read_text())
    assert (results["micro_batch_size"], results["gradient_accumulation_steps"]) == (2, 4)
    assert results["samples_seen"] == 4 * 8  # every step still saw the effective batch of 8
    assert "retrying with micro_batch_size 4 x accumulation 2" in capsys.readouterr().out


def test_oom_at_micro_batch_one_names_next_rung(tmp_path):
    with pytest.raises(TrainingStopped, match=r"micro_batch_size 1; next rung of the memory ladder: --recompute"):
        fit(OOMBelow(fits=0), settings(tmp_path, max_steps=4, micro_batch_size=2, gradient_accumulation_steps=1))


def test_grad_norm_spike_warns(tmp_path, capsys):
    class Spiky(ToyTask):
        def loss(self, model, batch, generator):
            loss = super().loss(model, batch, generator)
            return loss * 1e4 if self.calls == 2 * 25 + 1 else loss  # first micro-batch of step index 25: step 26

    fit(Spiky(), settings(tmp_path, max_steps=27, checkpointing_steps=0, max_grad_norm=0.0))
    out = capsys.readouterr().out
    assert "step 26 grad_norm" in out and "running median" in out  # numbered from 1, as logs and checkpoints


def test_ema_warmup_closed_form():
    from hf_cgpu.train import EMA

    ema = EMA(torch.nn.Linear(2, 2), decay=0.9999)
    assert ema.decay_at(0) == pytest.approx(0.1)
    assert ema.decay_at(90) == pytest.approx(91 / 100)
    assert ema.decay_at(10**7) == 0.9999


def test_autofit_makes_770m_fit_a_16gb_card_keeping_the_effective_batch(capsys):
    from hf_cgpu import budget

    shape = budget.RunShape(preset_shape("770m"), seq_len=1024, loss_chunk_size=1024)
    s = TrainSettings(micro_batch_size=16, gradient_accumulation_steps=8, memory_cap="16GB")
    assert budget.ledger(shape.model, shape.setup(s)).total > 16 * 2**30  # the request does not fit as given
    fitted = budget.autofit_settings(s, shape, None, log=print)
    assert (s.micro_batch_size, s.gradient_accumulation_steps) == (16, 8)  # a new object; the given one is frozen
    assert fitted.micro_batch_size * fitted.gradient_accumulation_steps == 128
    assert budget.ledger(shape.model, shape.setup(fitted)).total <= 16 * 2**30
    out = capsys.readouterr().out
    assert "autofit: micro-batch 16 -> 8" in out and "autofit: fits" in out


def test_autofit_refuses_without_cap_on_cpu():
    from hf_cgpu import budget

    shape = budget.RunShape(preset_shape("124m"), seq_len=1024, loss_chunk_size=1024)
    with pytest.raises(SettingsError, match="--memory_cap"):
        budget.autofit_settings(TrainSettings(), shape, None)
    with pytest.raises(SettingsError, match="language-model task"):
        budget.autofit_settings(TrainSettings(memory_cap="16GB"), None, None)


class _Evil:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


def test_resume_never_unpickles_code(tmp_path):
    fit(ToyTask(), settings(tmp_path, max_steps=4))
    ckpt = ckpt_io.list_checkpoints(tmp_path)[-1]
    torch.save({"state": _Evil(tmp_path / "pwned")}, ckpt / "optimizer.bin")  # a tampered checkpoint...
    write_manifest(ckpt, build_manifest(ckpt, "checkpoint", step=4))  # ...whose checksums were forged to match
    with pytest.raises(ckpt_io.CheckpointError, match="(?i)not plain tensors.*weights.only load failed") as err:
        fit(ToyTask(), settings(tmp_path, max_steps=8, resume_from_checkpoint="latest"))  # one line, exit 2
    assert "\n" not in str(err.value) and isinstance(err.value.__context__, pickle.UnpicklingError)
    assert not (tmp_path / "pwned").exists()


def test_tensorboard_tracker_and_curves_are_written(tmp_path):
    fit(ToyTask(), settings(tmp_path, max_steps=4, report_to="tensorboard"))
    assert list(tmp_path.rglob("events.out.tfevents.*")), "accelerate's TensorBoard tracker wrote no event file"
    png = tmp_path / "training_curves.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- --fit_schedule_to_time: the cosine sized to the minutes on this machine, kept for resume


@pytest.fixture
def ticking(monkeypatch):
    """The deadline's clock advances one second per reading (the loop reads it twice per step while timing)."""
    import itertools

    from hf_cgpu.train import stopping

    ticks = itertools.count(1)
    monkeypatch.setattr(stopping, "now", lambda: float(next(ticks)))


def test_fitted_length_closed_form():
    from hf_cgpu.train.schedule import calibration_step, fitted_length

    assert fitted_length(10, 2.0, 40.0, 1000) == 10 + int(0.97 * 40 / 2)  # 29
    assert fitted_length(10, 2.0, 1e9, 1000) == 1000  # never past max_steps
    assert fitted_length(10, 2.0, -5.0, 1000) == 11  # out of time: end at the next step
    assert fitted_length(10, 2.0, 40.0, 10) == 10  # timed up to max_steps: the run still ends there
    # an extra loss on in the timed steps, off after half the schedule, a step then half the cost: L such that
    # (L/2 - 10) timed steps + L/2 steps at half = 19.4 timed steps' seconds -> L = 29.4 / 0.75 = 39.2
    assert fitted_length(10, 2.0, 40.0, 1000, annealed=(0.5, 0.5)) == 39
    assert fitted_length(10, 2.0, 40.0, 1000, annealed=(0.5, 1.0)) == 29  # no cheaper: as without
    assert fitted_length(100, 2.0, 40.0, 1000, annealed=(0.1, 0.5)) == 100 + int(19.4 / 0.5)  # stopped before
    assert calibration_step(TrainSettings(warmup_steps=200, eval_steps=100)) == 200
    assert calibration_step(TrainSettings(warmup_steps=3, eval_steps=50)) == 51
    assert calibration_step(TrainSettings(warmup_steps=0, eval_steps=0, max_steps=6)) == 6
    with pytest.raises(SettingsError, match="add --max_minutes M"):
        TrainSettings(fit_schedule_to_time=True)


def fitted(tmp_path, **kw):
    return settings(tmp_path, max_steps=1000, max_minutes=1, fit_schedule_to_time=True, checkpointing_steps=4, **kw)


def test_schedule_fitted_to_the_minutes_ends_its_cosine_inside_them(tmp_path, ticking, capsys):
    results = fit(ToyTask(), fitted(tmp_path))
    # timed from the end of step 1 to step 10: 2 s a step, 40 s left of the 60 -> 19 more steps
    assert results["schedule_steps"] == 29 and results["steps"] == 29
    out = capsys.readouterr().out
    assert "the cosine ends at step 29 (max_steps 1,000)" in out
    assert "--max_minutes 1 reached" not in out  # the schedule ended the run, not the deadline
    hist = json.loads((tmp_path / "history.json").read_text())
    lr = {h["step"]: h["train/lr"] for h in hist if "train/lr" in h}
    s = fitted(tmp_path)
    assert lr[29] == pytest.approx(lr_at(28, s, 29)) and lr[29] < 1.05 * s.min_lr_ratio * s.learning_rate  # a 1000-step cosine: ~peak
    assert lr[5] == pytest.approx(lr_at(4, s))  # before the timing ends (step 10) the max_steps cosine: ~flat here
    assert lr[15] == pytest.approx(lr_at(14, s, 29))


def test_schedule_fitted_for_the_cheaper_steps_after_an_annealed_loss(tmp_path, ticking, capsys, monkeypatch):
    """A run whose extra loss (--mtp_anneal, --distill_anneal) stops at half the schedule: the steps after it cost
    what the ledger says (here half a timed step), and the cosine is fitted to hold them, not to end early."""
    from types import SimpleNamespace

    from hf_cgpu.train import loop

    ledger = SimpleNamespace(annealed=(0.5, 0.5), line=lambda: "", checked=lambda results: {})
    monkeypatch.setattr(loop, "_forecast", lambda run, task, step: ledger)
    results = fit(ToyTask(), fitted(tmp_path))
    assert results["schedule_steps"] == 39  # test_fitted_length_closed_form's case; 29 without the anneal
    assert "the steps after 0.5 of the schedule at 0.50 of that" in capsys.readouterr().out


def test_schedule_fitted_early_when_the_timing_would_end_after_the_deadline(tmp_path, ticking, capsys):
    """A 200-step warmup at 2 s a step never reaches its timing point in 60 s: the schedule is fixed from the first
    steps, the warmup cut to fit, and the learning rate still ends at its floor."""
    s = fitted(tmp_path, warmup_steps=200)
    results = fit(ToyTask(), s)
    # timed from step 1 to 2 (2 s a step), 57 s left -> 2 + int(0.97 * 57 / 2) = 29; warmup cut to 29 // 2
    assert results["schedule_steps"] == 29 and results["steps"] == 29
    assert "the cosine ends at step 29 (max_steps 1,000), warmup cut to 14 steps" in capsys.readouterr().out
    hist = json.loads((tmp_path / "history.json").read_text())
    lr = {h["step"]: h["train/lr"] for h in hist if "train/lr" in h}
    assert lr[14] == pytest.approx(s.learning_rate)  # the peak is reached
    assert lr[29] == pytest.approx(lr_at(28, s, 29, 14)) and lr[29] < 1.1 * s.min_lr_ratio * s.learning_rate
    state = json.loads((ckpt_io.list_checkpoints(tmp_path)[-1] / "trainer_state.json").read_text())
    assert (state["schedule_steps"], state["schedule_warmup"]) == (29, 14)  # a resumed run keeps both


def test_fitted_schedule_resumes_with_the_saved_length(tmp_path, ticking):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    fit(ToyTask(), fitted(full_dir))
    with pytest.raises(Interrupted):
        fit(InterruptAt(18), fitted(cut_dir))
    state = ckpt_io.list_checkpoints(cut_dir)[-1]
    assert json.loads((state / "trainer_state.json").read_text())["schedule_steps"] == 29
    fit(ToyTask(), fitted(cut_dir, resume_from_checkpoint="latest"))  # the clock is later now: no new timing
    assert max(dict(losses(full_dir))) == 29
    assert_same_run(full_dir, cut_dir, range(18, 30))
