"""Applying a step without waiting for the device (``hf_cgpu.train.update``): a non-finite step is skipped by the
fused optimizer's ``found_inf`` and the EMA's flag exactly as the host-side skip does, and the loop reads step k's
figures only after step k+1 is queued."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from hf_cgpu.optim import build_optimizer
from hf_cgpu.optim.muon_optimizer import MuonWithAdamW
from hf_cgpu.settings import TrainSettings
from hf_cgpu.train import EMA, fit
from hf_cgpu.train.step import StepResult
from hf_cgpu.train.update import Updater, skips_on_device
from test_loop import ToyTask, settings

CPU = SimpleNamespace(device=torch.device("cpu"), scaler=None, distributed_type="NO", num_processes=1)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _train(deferred: bool, bad_steps=(2,), steps=6):
    """``steps`` updates of fixed gradients (NaN at ``bad_steps``) through an Updater; the outcomes in the order
    they came back, the weights, the optimizer's state and the EMA."""
    model = _model()
    optimizer = build_optimizer(model, TrainSettings(learning_rate=0.05, weight_decay=0.1), fused=True)  # the GPU's optimizer
    ema = EMA(model, decay=0.5)
    updater = Updater(CPU, optimizer, ema, deferred=deferred)
    seen, x = [], torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        loss = (model(x) ** 2).mean() * (float("nan") if step in bad_steps else 1.0)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        seen += [(step, o) for o in updater.apply(step, 0.05, StepResult(loss.detach(), grad_norm, 16))]
    seen += [(steps, o) for o in updater.flush()]
    state = [t.clone() for s in optimizer.state.values() for t in s.values()]
    return seen, [p.detach().clone() for p in model.parameters()], state, dict(ema.shadow)


def test_fused_adamw_skips_on_the_device_and_others_do_not():
    model = _model()
    assert skips_on_device(CPU, build_optimizer(model, TrainSettings(learning_rate=1e-3), fused=True))  # what CUDA builds
    assert not skips_on_device(CPU, build_optimizer(model, TrainSettings(learning_rate=1e-3)))  # the CPU's (foreach)
    assert not skips_on_device(CPU, MuonWithAdamW([{"params": [model[0].weight], "use_muon": True},
                                                   {"params": [model[0].bias], "use_muon": False}], lr=1e-3))
    fp16 = SimpleNamespace(**{**vars(CPU), "scaler": object()})  # GradScaler sets found_inf itself
    assert not skips_on_device(fp16, build_optimizer(model, TrainSettings(learning_rate=1e-3), fused=True))


def test_sync_steps_switch(monkeypatch):
    monkeypatch.setenv("HF_CGPU_SYNC_STEPS", "1")
    assert not skips_on_device(CPU, build_optimizer(_model(), TrainSettings(learning_rate=1e-3), fused=True))


def test_device_skip_equals_host_skip_and_reads_one_step_late():
    deferred, weights, state, ema = _train(deferred=True)
    host, weights_h, state_h, ema_h = _train(deferred=False)
    # host: each step read when applied; device: the first at once, then step k when step k+1 is applied
    assert [(when, o.step) for when, o in host] == [(k, k) for k in range(6)]
    assert [(when, o.step) for when, o in deferred] == [(0, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 5)]
    assert [o.finite for _, o in deferred] == [True, True, False, True, True, True]
    for (_, a), (_, b) in zip(deferred, host):
        assert (a.step, a.units, a.finite) == (b.step, b.units, b.finite)
        assert a.finite is False or (a.loss == b.loss and a.grad_norm == b.grad_norm)
    for a, b in zip(weights + state, weights_h + state_h):
        assert torch.equal(a, b)  # the fused kernel skipped step 2 whole: moments and step count too
    for n in ema:
        torch.testing.assert_close(ema[n], ema_h[n], rtol=1e-6, atol=1e-7)  # lerp vs sub-mul-add rounding


def test_a_skipped_step_changes_nothing_on_the_device():
    _, before, state_before, ema_before = _train(deferred=True, bad_steps=(), steps=2)
    _, after, state_after, ema_after = _train(deferred=True, bad_steps=(2,), steps=3)
    for a, b in zip(before + state_before, after + state_after):
        assert torch.equal(a, b)
    for n in ema_before:
        assert torch.equal(ema_before[n], ema_after[n])


def test_without_the_flag_the_nan_step_would_have_moved_the_weights():
    """The check above can fail: with ``found_inf`` left out, the same NaN step poisons the weights."""
    model = _model()
    optimizer = build_optimizer(model, TrainSettings(learning_rate=0.05), fused=True)
    (model(torch.randn(3, 4)).sum() * float("nan")).backward()
    optimizer.step()
    assert not all(torch.isfinite(p).all() for p in model.parameters())


class Timeline(ToyTask):
    """Records the order of forward passes and of the guards' reading of each step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.events: list[tuple[str, int]] = []

    def loss(self, model, batch, generator):
        self.events.append(("loss", self.calls))
        return super().loss(model, batch, generator)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_loop_reads_a_step_after_the_next_one_is_queued(optimizer, tmp_path, monkeypatch, fused_adamw):
    """With fused AdamW the guards see step k after step k+1's forward has run (no wait for the device between
    steps), except in a run of non-finite steps; with Muon (host-side skip) before it. Same skipped step either
    way."""
    from hf_cgpu.train import guards as guards_mod

    task = Timeline(nan_calls={5}, width=8)  # step 2's first micro-batch
    original = guards_mod.Guards.check

    def check(self, step, loss, grad_norm):
        task.events.append(("read", step))
        return original(self, step, loss, grad_norm)

    monkeypatch.setattr(guards_mod.Guards, "check", check)
    s = settings(tmp_path, max_steps=6, checkpointing_steps=0, optimizer=optimizer)
    results = fit(task, s)
    assert results["skipped_steps"] == 1
    reads = [i for i, e in enumerate(task.events) if e[0] == "read"]
    losses = [i for i, e in enumerate(task.events) if e[0] == "loss"]
    # two micro-batches a step: step k's forwards are losses[2k], losses[2k+1]. Fused AdamW: read one step late,
    # but the step queued behind the non-finite step 2 (3) is read at once, before step 4 runs
    for k in range(1, 5):
        read_k = next(i for i in reads if task.events[i] == ("read", k))
        if optimizer == "adamw" and k != 3:
            assert losses[2 * (k + 1)] < read_k, f"step {k} was read before step {k + 1} ran"
        else:
            assert read_k < losses[2 * (k + 1)], f"step {k} was read only after step {k + 1} ran"
    assert [e for e in task.events if e[0] == "read"] == [("read", k) for k in range(6)]


def test_a_non_finite_streak_stops_where_the_host_side_skip_stops(tmp_path, monkeypatch):
    """Step k is read late, but once a step is non-finite every later one is read before the next is queued: the
    stop comes at the same step, with the same checkpoint, as when every step is read at once."""
    from hf_cgpu.errors import TrainingStopped
    from hf_cgpu.train import checkpoint as ckpt_io
    from hf_cgpu.train import prepare

    def run(out, fused: bool):
        monkeypatch.setattr(prepare, "build_optimizer",
                            lambda *a, **k: build_optimizer(*a, **{**k, "fused": fused}))
        with pytest.raises(TrainingStopped) as stop:
            fit(ToyTask(nan_calls=set(range(7, 100))), settings(out, nan_patience=3, checkpointing_steps=0))
        last = ckpt_io.list_checkpoints(out)[-1]
        return str(stop.value), last.name, load_file(last / "model.safetensors")

    host, device = run(tmp_path / "host", False), run(tmp_path / "device", True)
    assert host[0].startswith("training stopped at step 6:") and host[1] == "step_0000006"  # one numbering
    assert device[:2] == host[:2]
    for name, weight in host[2].items():  # the same weights (fused vs foreach rounding): nothing applied after
        torch.testing.assert_close(device[2][name], weight, rtol=1e-6, atol=1e-7)
