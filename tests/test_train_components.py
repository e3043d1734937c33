"""The loop's components one by one (EMA, step and clipping, guards, stopping, metrics, validation, checkpoint state),
and the loop features each planted bug of issue 9 broke while the suite stayed green."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from hf_cgpu import budget
from hf_cgpu.commands.budget import preset_shape
from hf_cgpu.errors import SettingsError, TrainingStopped
from hf_cgpu.settings import TrainSettings
from hf_cgpu.train import EMA, SampleOrder, fit
from hf_cgpu.train import checkpoint as ckpt_io
from hf_cgpu.train import stopping as stopping_mod
from hf_cgpu.train.ema import ema_weights
from hf_cgpu.train.guards import LabelLeakGuard, NonFiniteGuard, OOMGuard, SpikeGuard, Verdict
from hf_cgpu.train.metrics import Metrics
from hf_cgpu.train.step import Stepper
from hf_cgpu.train.stopping import Stopping
from test_loop import ToyTask, settings


# ---------------------------------------------------------------------------------------------------- EMA


def test_ema_update_moves_one_minus_decay_towards_the_weights():
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, decay=0.9)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(step=10**6)  # past the warm-up: decay_at = 0.9
    for n, p in model.named_parameters():
        assert torch.allclose(ema.shadow[n], 0.9 * start[n] + 0.1 * p.detach(), atol=1e-6), n
    ema.update(step=0)  # warm-up: decay_at(0) = 0.1, the shadow jumps most of the way
    for n, p in model.named_parameters():
        expected = 0.1 * (0.9 * start[n] + 0.1 * p.detach()) + 0.9 * p.detach()
        assert torch.allclose(ema.shadow[n], expected, atol=1e-6), n


@pytest.mark.parametrize("decay, reached", [(0.999, 8990), (0.998, 4490), (0.9999, 89990), (0.9, 80), (0.1, 0)])
def test_ema_decay_is_reached_where_the_warm_up_meets_it(decay, reached):
    """(1 + s) / (10 + s) >= d  <=>  s >= (10 d - 1) / (1 - d): before that step the warm-up sets the average, so a
    run shorter than it gets the same EMA for any larger decay (what made 0.998 and 0.999 one run on zh-poetry)."""
    ema = EMA(torch.nn.Linear(2, 2), decay)
    assert ema.decay_reached_at() == reached
    assert ema.decay_at(reached) == pytest.approx(decay, abs=1e-12)
    if reached:
        assert ema.decay_at(reached - 1) < decay
        assert EMA(torch.nn.Linear(2, 2), 0.99999).decay_at(reached - 1) == ema.decay_at(reached - 1)
        note = ema.warmup_note(max_steps=reached - 1)
        assert f"step {reached:,}" in note and "--max_steps" in note
    assert ema.warmup_note(max_steps=reached) is None


@pytest.mark.parametrize("recipe, argv, noted", [
    ("flow", ["--preset", "tiny"], False), ("gpt", ["--preset", "zh-poetry-modern"], False),
    ("gpt", ["--preset", "auto"], False), ("flow", ["--preset", "tiny", "--ema_decay", "0.99"], True)])
def test_the_ema_warm_up_note_is_for_a_typed_decay_not_a_presets(recipe, argv, noted, tmp_path, capsys):
    """A shipped preset's decay outlasts its runs by design (the warm-up sets their average): no note on every run
    of it. The same decay typed on the command line, in a run too short for it, gets the note."""
    from hf_cgpu.recipes import RECIPES, parse

    train = parse(RECIPES[recipe], [*argv, "--output_dir", str(tmp_path / "parsed")])[1]
    assert train.ema_decay > 0 and EMA(torch.nn.Linear(1, 1), train.ema_decay).decay_reached_at() > 4
    fit(ToyTask(), settings(tmp_path / "run", max_steps=4, ema_decay=train.ema_decay, given_flags=train.given_flags))
    assert ("is reached only at step" in capsys.readouterr().out) is noted


@pytest.mark.parametrize("decay", [1.0, 1.5, -0.1])
def test_ema_decay_outside_zero_one_is_a_one_line_error(decay, tmp_path):
    """1 or more would average the warm-up forever (decay_at never reaches it), a negative one switches the EMA off."""
    with pytest.raises(SettingsError, match=r"ema_decay=.*use 0 \(off\) or a decay in \(0, 1\)"):
        TrainSettings(output_dir=str(tmp_path), ema_decay=decay)
    TrainSettings(output_dir=str(tmp_path), ema_decay=0.0)


@pytest.mark.parametrize("bad, message", [
    (dict(log_steps=0), "--log_steps must be >= 1"), (dict(eval_steps=-1), "--eval_steps must be >= 0"),
    (dict(checkpointing_steps=-1), "--checkpointing_steps must be >= 0"), (dict(seed=-1), "--seed must be >= 0"),
    (dict(seed=2**32), "below 2\\*\\*32"), (dict(min_lr_ratio=2.0), r"--min_lr_ratio must be in \[0, 1\]"),
    (dict(max_grad_norm=-1.0), "no clipping"), (dict(weight_decay=-1.0), "--weight_decay must be >= 0"),
    (dict(adam_beta1=1.5), "--adam_beta1"), (dict(adam_beta2=1.0), "--adam_beta2"), (dict(lora_r=0), "--lora_r"),
    (dict(max_minutes=-1.0), "no time limit"), (dict(checkpoints_total_limit=0), "--checkpoints_total_limit"),
    (dict(report_to="bogus"), "no tracker accelerate knows"), (dict(report_to="tensorboard,bogus"), "bogus is no"),
])
def test_values_a_library_would_reject_or_misread_are_one_line_errors(bad, message, tmp_path):
    """A negative eval_steps evaluated at every step, min_lr_ratio 2 raised the learning rate over the cosine, a
    negative clip switched clipping off, log_steps 0 divided by zero: each is refused before anything runs."""
    with pytest.raises(SettingsError, match=message):
        TrainSettings(output_dir=str(tmp_path), **bad)
    TrainSettings(output_dir=str(tmp_path), report_to="tensorboard,wandb", min_lr_ratio=1.0, max_grad_norm=0.0)


def test_ema_weights_context_swaps_in_and_back():
    model = torch.nn.Linear(2, 2)
    ema = EMA(model, decay=0.5)
    live = model.weight.detach().clone()
    ema.shadow["weight"].fill_(7.0)
    with ema_weights(ema):
        assert torch.all(model.weight == 7.0)
    assert torch.equal(model.weight, live)
    with ema_weights(ema, enabled=False), ema_weights(None):
        assert torch.equal(model.weight, live)


class RecordsEvaluatedWeights(ToyTask):
    def evaluate(self, model, settings, device):
        self.evaluated = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return super().evaluate(model, settings, device)


def test_final_evaluation_and_saved_model_use_the_ema_weights(tmp_path):
    task = RecordsEvaluatedWeights()
    r = fit(task, settings(tmp_path, max_steps=8, ema_decay=0.8))
    last = ckpt_io.list_checkpoints(tmp_path)[-1]
    ema, live = load_file(str(last / "ema.safetensors")), load_file(str(last / "model.safetensors"))
    saved = torch.load(tmp_path / "toy.pt", weights_only=True)
    assert any(not torch.equal(ema[k], live[k]) for k in ema)  # EMA and live weights differ after 8 steps
    for k in ema:
        assert torch.equal(saved[k], ema[k]), k
        assert torch.equal(task.evaluated[k], ema[k]), k
    model = task.setup(TrainSettings(), None).model.eval()
    model.load_state_dict(ema)
    with torch.no_grad():
        assert r["val_loss"] == pytest.approx(((model(task.x) - task.y) ** 2).mean().item())


# ---------------------------------------------------------------------------------------------------- one step


class BigLoss(ToyTask):
    def loss(self, model, batch, generator):
        return 1e3 * super().loss(model, batch, generator)


def _stepper(max_grad_norm: float):
    task = BigLoss()
    model = task.setup(TrainSettings(), None).model
    accelerator = Accelerator()
    return Stepper(task, model, accelerator, SampleOrder(50, 0), seed=0, max_grad_norm=max_grad_norm), model


def _grad_norm(model) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def test_step_clips_the_global_gradient_norm_and_reports_it_unclipped():
    stepper, model = _stepper(max_grad_norm=1.0)
    result = stepper.run(step=0, micro_batch_size=4, accumulation=2)  # device tensors: read here at once
    assert float(result.grad_norm) > 10 and result.units == 8 and math.isfinite(float(result.loss))
    assert _grad_norm(model) == pytest.approx(1.0, rel=1e-4)


def test_step_without_clipping_keeps_the_gradient():
    stepper, model = _stepper(max_grad_norm=0.0)
    grad_norm = float(stepper.run(step=0, micro_batch_size=4, accumulation=2).grad_norm)
    assert _grad_norm(model) == pytest.approx(grad_norm, rel=1e-5) and grad_norm > 10


class RecordsGradients(BigLoss):
    """Notes, at each micro-batch's forward, whether every parameter already has a gradient buffer."""

    def __init__(self):
        super().__init__()
        self.had_grads = []

    def loss(self, model, batch, generator):
        self.had_grads.append(all(p.grad is not None for p in model.parameters()))
        return super().loss(model, batch, generator)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_step_under_cuda_graphs_accumulates_into_buffers_of_its_own(monkeypatch, accumulation):
    """With the model under CUDA graphs each micro-batch marks a new cudagraph-trees step, and with accumulation the
    gradients are zero buffers before the first backward (autograd then adds into them instead of keeping the
    graph's output buffers, which the next replay overwrites); gradients, norm and loss as without graphs."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    runs = []
    for graphs in (False, True):
        task = RecordsGradients()
        model = task.setup(TrainSettings(), None).model
        stepper = Stepper(task, model, Accelerator(), SampleOrder(50, 0), seed=0, max_grad_norm=0.0, cuda_graphs=graphs)
        result = stepper.run(step=0, micro_batch_size=4, accumulation=accumulation)
        runs.append((task.had_grads, [p.grad.clone() for p in model.parameters()], float(result.grad_norm),
                     float(result.loss)))
    (plain_had, plain_grads, plain_norm, plain_loss), (had, grads, norm, loss) = runs
    assert len(marks) == accumulation
    assert plain_had == [False] + [True] * (accumulation - 1)
    assert had == [accumulation > 1] + [True] * (accumulation - 1)
    for a, b in zip(grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert norm == pytest.approx(plain_norm, rel=1e-6) and loss == pytest.approx(plain_loss, rel=1e-6)


# ---------------------------------------------------------------------------------------------------- guards


def test_non_finite_guard_skips_then_stops_and_resets_on_a_good_step():
    guard, nan = NonFiniteGuard(patience=2), float("nan")
    assert guard.check(0, nan, 1.0, log=lambda m: None) is Verdict.SKIP
    assert guard.check(1, 1.0, 1.0) is Verdict.OK and guard.in_row == 0
    assert guard.check(2, 1.0, float("inf"), log=lambda m: None) is Verdict.SKIP
    assert guard.check(3, nan, nan, log=lambda m: None) is Verdict.STOP


def test_spike_guard_needs_history_then_compares_with_the_median():
    guard, said = SpikeGuard(factor=10.0), []
    assert not guard.observe(0, 1e6, said.append)  # no history yet
    for k in range(1, 25):
        guard.observe(k, 1.0, said.append)
    assert guard.observe(25, 50.0, said.append) and "step 26 grad_norm 50.00" in said[-1]  # index 25: step 26
    assert not guard.observe(26, 5.0, said.append)


def test_label_leak_guard_only_judges_the_first_step_of_a_fresh_run():
    guard, said = LabelLeakGuard(expected_initial_loss=10.0), []
    assert guard.check(0, 0, 4.0, said.append) and "label leak" in said[0]
    assert not guard.check(0, 0, 6.0, said.append)  # above half of ln(vocab)
    assert not guard.check(5, 5, 1.0, said.append)  # a resumed run
    assert not LabelLeakGuard(None).check(0, 0, 0.0, said.append)


def test_oom_guard_retries_only_in_the_first_steps_and_stops_at_micro_batch_one():
    guard = OOMGuard(enabled=True, first_step=5, advice="next rung: --recompute")
    assert [guard.may_retry(s) for s in (5, 6, 7, 8, 100)] == [True, True, True, False, False]
    assert not OOMGuard(enabled=False, first_step=0, advice="").may_retry(0)
    state = ckpt_io.TrainState(micro_batch_size=2, gradient_accumulation_steps=3)
    guard.halve(state, 5, log=lambda m: None)
    assert (state.micro_batch_size, state.gradient_accumulation_steps) == (1, 6)
    with pytest.raises(TrainingStopped, match="--recompute"):
        guard.halve(state, 6)


class OOMLater(ToyTask):
    """Out of memory from step 4 on (a leak, not a batch-size problem)."""

    def loss(self, model, batch, generator):
        if self.calls >= 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().loss(model, batch, generator)


def test_oom_after_the_first_steps_is_raised_not_retried(tmp_path, capsys):
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fit(OOMLater(), settings(tmp_path, max_steps=8, checkpointing_steps=0))
    assert "retrying" not in capsys.readouterr().out


def test_oom_advice_is_the_ladder_below_the_setup():
    full = budget.TrainSetup(micro_batch_size=1)
    text = budget.oom_advice(full)
    assert text.index("--recompute") < text.index("--seq_len") < text.index("--tier adamw8bit") < text.index("lora")
    taken = budget.oom_advice(budget.TrainSetup(micro_batch_size=1, recompute=True, tier="adamw8bit", seq_len=256))
    assert "--recompute" not in taken and "adamw8bit" not in taken and "--seq_len" not in taken
    assert "--tier lora" in taken


# ---------------------------------------------------------------------------------------------------- stopping


class FakeClock:
    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_deadline_by_the_clock():
    clock = FakeClock(tick=30.0)  # every reading is half a minute later
    with Stopping(max_minutes=1.25, catch_signals=False, clock=clock) as stop:  # from 0.5 min: until 1.75 min
        assert [stop.out_of_time() for _ in range(4)] == [False, False, True, True]  # at 1, 1.5, 2, 2.5 min
    with Stopping(max_minutes=0, catch_signals=False, clock=clock) as stop:
        assert not stop.out_of_time()


def test_max_minutes_ends_the_run_and_still_evaluates_and_saves(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(stopping_mod, "now", FakeClock(tick=60.0))  # a minute per reading
    r = fit(ToyTask(), settings(tmp_path, max_steps=50, max_minutes=2.5, checkpointing_steps=0))
    assert r["steps"] == 3 and r["val_loss"] > 0  # readings at 1, 2, 3 minutes after the start at 0
    assert "--max_minutes 2.5 reached at step 3" in capsys.readouterr().out
    assert (tmp_path / "toy.pt").is_file() and ckpt_io.list_checkpoints(tmp_path)[-1].name == "step_0000003"


def test_sigterm_is_caught_inside_and_the_handler_restored():
    before = signal.getsignal(signal.SIGTERM)
    with Stopping(max_minutes=0) as stop:
        assert not stop.signalled
        signal.raise_signal(signal.SIGTERM)
        assert stop.signalled
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("when", ["before", "inside"])
def test_ctrl_c_names_the_stop_whenever_the_launchers_sigterm_is_handled(when, monkeypatch):
    """accelerate's launcher answers Ctrl-C with a SIGTERM to its child at once: handled before the SIGINT, or
    between two lines of its handler (here: while it writes its message), the stop is still the Ctrl-C."""
    import hf_cgpu.train.stopping as stopping

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here (a background process)")
    write = stopping.os.write
    with Stopping(max_minutes=0) as stop, monkeypatch.context() as patch:  # os.write restored while SIGTERM is caught
        if when == "before":
            signal.raise_signal(signal.SIGTERM)
        else:
            patch.setattr(stopping.os, "write", lambda fd, b: (signal.raise_signal(signal.SIGTERM), write(fd, b)))
        signal.raise_signal(signal.SIGINT)
    assert stop.signalled and stop.signal_name == "SIGINT"


@pytest.mark.parametrize("mine, theirs, name", [
    ("SIGTERM", "SIGINT", "SIGINT"), ("", "SIGINT", "SIGINT"), ("", "SIGTERM", "SIGTERM (another process)"),
    ("SIGINT", "SIGTERM", "SIGINT")])
def test_processes_agree_on_the_stop_and_a_ctrl_c_anywhere_names_it(mine, theirs, name):
    """Several processes: a launcher hands the terminal's Ctrl-C to each of them; a rank whose SIGINT had not arrived
    (or whose launcher SIGTERM was handled first) when the flags were summed stops as interrupted (Ctrl-C) too."""
    other = torch.tensor([1, 0, int(theirs == "SIGINT")])  # the other rank's flags: signalled, out of time, Ctrl-C
    acc = SimpleNamespace(num_processes=2, device=torch.device("cpu"), reduce=lambda t, reduction: t + other)
    stop = Stopping(max_minutes=0, catch_signals=False)
    stop.signalled, stop.signal_name = bool(mine), mine
    assert stop.poll(acc) == (True, False) and stop.signal_name == name


class TermAt(ToyTask):
    def loss(self, model, batch, generator):
        if self.calls == 2 * 4:  # during step 5 (two micro-batches a step)
            os.kill(os.getpid(), signal.SIGTERM)
        return super().loss(model, batch, generator)


def test_sigterm_checkpoints_and_stops_the_run(tmp_path):
    with pytest.raises(TrainingStopped, match="SIGTERM at step 5.*--resume_from_checkpoint latest"):
        fit(TermAt(), settings(tmp_path, max_steps=12, checkpointing_steps=0))
    last = ckpt_io.list_checkpoints(tmp_path)[-1]
    assert last.name == "step_0000005" and json.loads((last / "trainer_state.json").read_text())["step"] == 5
    ckpt_io.verify(last)


# ---------------------------------------------------------------------------------------------------- metrics


def test_metrics_window_logs_at_its_cadence_with_mfu_from_the_rate():
    s = TrainSettings(max_steps=7, log_steps=3, progress=False)
    metrics = Metrics(Accelerator(), s, "tok", flops_per_unit=6e6, peak_tflops=(100.0, "--peak_tflops"))
    for step in range(1, 8):
        metrics.record(step, loss=float(step), lr=0.1, grad_norm=1.0, units=10, epoch=step / 7)
    assert [h["step"] for h in metrics.history] == [3, 6, 7]  # every log_steps, and the last step
    assert [h["train/loss"] for h in metrics.history] == [2.0, 5.0, 7.0]  # mean over each window
    for h in metrics.history:
        assert h["train/mfu"] == pytest.approx(6e6 * h["train/tok_per_s"] / 100e12)
    assert metrics.summary()["mfu_peak_source"] == "--peak_tflops"


# ---------------------------------------------------------------------------------------------------- checkpoint state


def test_train_state_reads_checkpoints_written_before_the_rename():
    state = ckpt_io.TrainState.from_dict({"step": 4, "micro_batch_size": 2, "accumulation": 8, "skipped_steps": 1,
                                          "fingerprint": {"w": 1}, "units_seen": 64})
    assert (state.step, state.gradient_accumulation_steps, state.effective_batch) == (4, 8, 16)


# ---------------------------------------------------------------------------------------------------- autofit


def test_autofit_applies_the_tier_it_chose():
    shape = budget.RunShape(preset_shape("770m"), seq_len=1024, loss_chunk_size=1024)
    asked = TrainSettings(micro_batch_size=16, gradient_accumulation_steps=8, memory_cap="14GB")
    fitted = budget.autofit_settings(asked, shape, None, log=lambda m: None)
    assert (fitted.tier, fitted.recompute) == ("adamw8bit", True) and asked.tier == "full"
    assert budget.ledger(shape.model, shape.setup(fitted), 14 * 2**30).fits
    without = dataclasses.replace(fitted, tier="full")
    assert not budget.ledger(shape.model, shape.setup(without), 14 * 2**30).fits  # the tier is what makes it fit


class Shaped(ToyTask):
    run_shape = budget.RunShape(preset_shape("770m"), seq_len=1024, loss_chunk_size=1024)


def test_the_loop_trains_with_the_settings_autofit_returns(tmp_path, capsys):
    r = fit(Shaped(), settings(tmp_path, max_steps=2, micro_batch_size=16, gradient_accumulation_steps=8,
                               autofit=True, memory_cap="16GB", checkpointing_steps=0))
    recorded = json.loads((tmp_path / "all_results.json").read_text())["settings"]
    assert (r["micro_batch_size"], r["gradient_accumulation_steps"]) == (1, 128)
    assert (recorded["micro_batch_size"], recorded["gradient_accumulation_steps"], recorded["autofit"]) == (1, 128, True)
    assert r["samples_seen"] == 2 * 128
    assert "autofit: fits" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------- the card


def test_the_card_of_a_run_states_its_validation_loss(tmp_path):
    class Carded(ToyTask):
        card = "gpt"

    r = fit(Carded(), settings(tmp_path, max_steps=4))
    card = (tmp_path / "README.md").read_text()
    assert f"validation loss {r['val_loss']:.4g}" in card


def test_rate_after_first_step_leaves_out_the_first_step_of_every_process(monkeypatch):
    """Fake clock: each process's first step takes 10 s (a compile), the others 1 s; a resume carries the sums."""
    import hf_cgpu.train.metrics as metrics_module

    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    s = TrainSettings(max_steps=8, log_steps=2, progress=False)

    def process(first: int, last: int, state=None) -> Metrics:
        m = Metrics(Accelerator(), s, "tok", flops_per_unit=0.0, peak_tflops=(0.0, "none"))
        if state is not None:
            m.load_state_dict(state)
        with m.progress(first - 1):
            for step in range(first, last + 1):
                clock.t += 10.0 if step == first else 1.0
                m.record(step, loss=1.0, lr=0.1, grad_norm=1.0, units=100, epoch=0.0)
        return m

    one = process(1, 4)
    two = process(5, 8, one.state_dict())
    assert two.mean_rate() == pytest.approx(800 / 26)  # 2 x (10 + 3 x 1) s
    assert two.rate_after_first_step() == pytest.approx(600 / 6)


def test_compile_mode_reaches_torch_compile_and_a_wrong_one_is_refused(tmp_path, monkeypatch):
    import hf_cgpu.train.prepare as prepare

    monkeypatch.setenv("HF_CGPU_COMPILE_ON_CPU", "inductor")
    seen = []
    monkeypatch.setattr(prepare, "apply_tiers", lambda model, s, compile, backend="inductor":
                        seen.append((compile, None if s.compile_mode == "default" else s.compile_mode)) or model)
    fit(ToyTask(), settings(tmp_path / "a", compile=True, compile_mode="reduce-overhead", max_steps=1,
                            checkpointing_steps=0))
    fit(ToyTask(), settings(tmp_path / "b", compile=True, max_steps=1, checkpointing_steps=0))
    assert seen == [(True, "reduce-overhead"), (True, None)]
    with pytest.raises(SettingsError, match="compile_mode='fast'; choose one of default, reduce-overhead"):
        settings(tmp_path / "c", compile_mode="fast")
