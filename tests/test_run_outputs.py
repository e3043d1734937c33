"""What a run tells and leaves: the MFU denominator (measured once on a first CUDA run, then reused), the run's mean
throughput, compile skipped on the CPU with a note, the cache announced, no empty output folder after a failure."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hf_cgpu import bench
from hf_cgpu.train import fit
from test_loop import ToyTask, settings

CUDA = SimpleNamespace(type="cuda")


def fake_bench(name: str, peak: float) -> bench.BenchResult:
    return bench.BenchResult(device_name=name, total_memory_bytes=16 * 2**30, capability="sm_120",
                             copy_bandwidth_gbs=800.0, matmul_tflops={4096: peak * 0.9, 8192: peak},
                             measured_at="2026-12-01T00:00:00")


def test_first_cuda_run_measures_the_peak_stores_it_and_the_next_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 5070 Ti")
    calls, logs = [], []

    def measure():
        calls.append(1)
        return fake_bench("NVIDIA GeForce RTX 5070 Ti", 180.0)

    path = tmp_path / "bench.json"
    peak, source = bench.training_peak(0.0, CUDA, logs.append, measure, path)
    assert (peak, len(calls)) == (180.0, 1) and "measured at the start of this run" in source
    assert bench.load_measured_peak(path) == 180.0  # stored where `hf-cgpu bench` stores it
    peak, source = bench.training_peak(0.0, CUDA, logs.append, measure, path)
    assert (peak, len(calls)) == (180.0, 1) and source.startswith("hf-cgpu bench of 2026-12-01")
    assert sum("MFU denominator: 180.0 TFLOP/s" in line for line in logs) == 2  # the log says which figure, each run


def test_a_stored_bench_of_another_gpu_is_measured_again(tmp_path, monkeypatch):
    path = tmp_path / "bench.json"
    bench.save_result(fake_bench("NVIDIA H200", 700.0), path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 5070 Ti")
    peak, _ = bench.training_peak(0.0, CUDA, lambda m: None, lambda: fake_bench("NVIDIA GeForce RTX 5070 Ti", 175.0),
                                  path)
    assert peak == 175.0 and bench.load_result(path).device_name.endswith("5070 Ti")


def test_explicit_peak_wins_and_cpu_has_no_mfu(tmp_path):
    def never():
        raise AssertionError("must not measure")

    assert bench.training_peak(99.0, CUDA, lambda m: None, never, tmp_path / "b.json") == (99.0, "--peak_tflops")
    peak, source = bench.training_peak(0.0, torch.device("cpu"), lambda m: None, never, tmp_path / "b.json")
    assert peak == 0.0 and "CUDA" in source


def test_run_reports_its_mean_throughput_not_the_last_window(tmp_path, monkeypatch):
    """On a fake clock: a slow first window counts in the run's mean, the evaluation between steps does not."""
    import hf_cgpu.train.metrics as metrics

    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: clock.t))

    class Clocked(ToyTask):
        def loss(self, model, batch, generator):
            clock.t += 1.0 if self.calls == 0 else 0.1  # the first micro-batch is slow (a compile, say)
            return super().loss(model, batch, generator)

        def evaluate(self, model, settings, device):
            clock.t += 5.0
            return super().evaluate(model, settings, device)

    # 8 steps x 2 micro-batches of 4: window 1 = 1.0 + 7 x 0.1 s, an evaluation (5 s), window 2 = 8 x 0.1 s
    results = fit(Clocked(), settings(tmp_path, max_steps=8, log_steps=4, eval_steps=4, checkpointing_steps=0))
    windows = [h["train/sample_per_s"] for h in json.loads((tmp_path / "history.json").read_text())
               if "train/sample_per_s" in h]
    assert windows == [pytest.approx(32 / 1.7), pytest.approx(32 / 0.8)]
    assert results["sample_per_s"] == pytest.approx(64 / 2.5)
    assert results["sample_per_s_after_first_step"] == pytest.approx(56 / 1.4)  # the slow first step left out
    assert results["step_seconds"] == pytest.approx(1.4 / 7)  # the same window, per optimizer step
    assert results["device"].startswith("CPU")


def test_compile_is_skipped_on_the_cpu_with_a_note_and_the_cache_is_announced(tmp_path, capsys, monkeypatch):
    import hf_cgpu.train.prepare as prepare

    monkeypatch.setenv("HF_CGPU_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "packed").mkdir(parents=True)
    (tmp_path / "cache" / "packed" / "x.bin").write_bytes(b"\0" * 3_000_000)
    monkeypatch.setattr(prepare, "_ANNOUNCED", set())
    compiled = []
    monkeypatch.setattr(prepare, "apply_tiers", lambda model, *a, compile, **k: compiled.append(compile) or model)
    fit(ToyTask(), settings(tmp_path / "run", compile=True, max_steps=2, checkpointing_steps=0))
    fit(ToyTask(), settings(tmp_path / "run2", compile=True, max_steps=2, checkpointing_steps=0))
    out = capsys.readouterr().out
    assert compiled == [False, False] and out.count("compile: skipped on cpu") == 2
    assert out.count(f"cache: {tmp_path / 'cache'} holds 3 MB") == 1  # once per process


def test_a_failed_run_leaves_no_empty_output_folder(tmp_path):
    class Broken(ToyTask):
        def setup(self, settings, accelerator):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fit(Broken(), settings(tmp_path / "new" / "run"))
    assert not (tmp_path / "new" / "run").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError):
        fit(Broken(), settings(tmp_path / "old"))
    assert (tmp_path / "old" / "notes.txt").is_file()  # a folder that was there before is left alone


def test_the_card_says_how_long_it_trained_and_what_the_ledger_predicted():
    from hf_cgpu.hub.cards import _summary

    line = _summary({"train_seconds": 426.0, "ledger": {"card": "NVIDIA H100 (hf-cgpu bench of this machine)",
                                                        "step_seconds": 0.15, "measured_step_seconds": 0.171}}, 0)
    assert "trained in 7.1 minutes" in line
    assert "0.171 s a step, where the ledger (`hf-cgpu budget`) predicted 0.15 s on NVIDIA H100" in line
    assert "ledger" not in _summary({"train_seconds": 60.0}, 0) and "trained in" not in _summary({}, 0)


def test_the_forecast_counts_a_resumed_processs_own_steps():
    from hf_cgpu.train.forecast import Forecast

    time = SimpleNamespace(step=SimpleNamespace(seconds=0.1), steps=4000, minutes=7.0, limited_by_minutes=True)
    f = Forecast("H100 (bench)", time, 2**30, start_step=5000)
    led = f.checked({"steps": 9000, "step_seconds": 0.125, "peak_reserved_gib": 1.25})
    assert led["measured_steps"] == 4000 and led["steps_in_minutes"] == 4000  # this process's, not the run's total
    assert led["step_error"] == pytest.approx(0.1 / 0.125 - 1) and led["reserved_error"] == pytest.approx(-0.2)
    assert "reserved_gib" not in Forecast("cpu", time, None).checked({"steps": 10})
