"""hf-cgpu bench without a GPU: the no-CUDA exit, and the saved result that MFU and budget read back."""

from __future__ import annotations

import json

import pytest
import torch

from hf_cgpu import bench
from hf_cgpu.paths import bench_file
from hf_cgpu.cli import main as cli_main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_CGPU_CACHE", str(tmp_path))
    return tmp_path


def fake_result() -> bench.BenchResult:
    return bench.BenchResult(
        device_name="NVIDIA GeForce RTX 5070 Ti", total_memory_bytes=16 * 1024**3, capability="sm_120",
        copy_bandwidth_gbs=780.0, matmul_tflops={2048: 120.0, 4096: 158.5, 8192: 162.25},
        torch_version="2.13.0", cuda_version="12.8", measured_at="2026-11-29T12:00:00+0000",
    )


def test_no_cuda_exits_2_with_one_line(monkeypatch, capsys):
    from hf_cgpu.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no CUDA device") and "hf-cgpu bench" in err and "\n" not in err


def test_save_and_load_round_trip(cache):
    result = fake_result()
    path = bench.save_result(result)
    assert path == cache / "bench.json" == bench_file()
    data = json.loads(path.read_text())
    assert data["peak_bf16_tflops"] == 162.25 and data["matmul_tflops"]["8192"] == 162.25
    assert bench.load_result() == result
    assert bench.load_measured_peak() == 162.25


def test_missing_or_broken_result_reads_as_none(cache):
    assert bench.load_measured_peak() is None
    (cache / "bench.json").write_text("{not json")
    assert bench.load_result() is None and bench.load_measured_peak() is None
    empty = fake_result()
    empty.matmul_tflops = {}
    bench.save_result(empty)
    assert bench.load_measured_peak() is None


def test_explicit_path_wins(tmp_path):
    path = bench.save_result(fake_result(), tmp_path / "elsewhere" / "b.json")
    assert bench.load_measured_peak(path) == 162.25


def test_budget_uses_the_measured_peak(cache, capsys):
    bench.save_result(fake_result())
    assert cli_main(["budget", "--preset", "124m", "--micro_batch_size", "8"]) == 0
    out = capsys.readouterr().out
    assert "time on NVIDIA GeForce RTX 5070 Ti (162 TFLOP/s bf16, 780 GB/s; hf-cgpu bench of this machine" in out


def test_budget_without_bench_says_the_peak_is_assumed(cache, capsys):
    assert cli_main(["budget", "--preset", "124m"]) == 0
    out = capsys.readouterr().out
    assert "time on RTX 5070 Ti (70 TFLOP/s bf16, 797 GB/s; public figures: " in out
    assert "run `hf-cgpu bench` on your card for its own figures" in out


def test_format_result_lists_every_size():
    text = bench.format_result(fake_result())
    for size in ("2048", "4096", "8192", "sm_120", "GB/s"):
        assert size in text
