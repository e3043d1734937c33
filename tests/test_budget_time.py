"""The time ledger: a step's work priced on a card (closed forms), the cards and the bench file it reads, and its
figures pinned for the shipped presets so that a change to the arithmetic is seen."""

from __future__ import annotations

import json
import platform

import pytest

from hf_cgpu.bench import BENCH_FORMAT, BenchResult, save_result
from hf_cgpu.budget.card import CARDS, CPU, Card, card_of_device, find_card, resolve_card, with_peak
from hf_cgpu.budget.time import (ATTENTION_EFFICIENCY, ATTENTION_HALF_SEQ, DEVICE_KERNEL_FACTOR, HOST_KERNEL_FACTOR,
                                 run_time, step_time)
from hf_cgpu.budget.work import Gemm, StepWork
from hf_cgpu.cli import main as cli_main
from hf_cgpu.commands.budget import describe_run, lm_run_time, run
from hf_cgpu.errors import SettingsError
from hf_cgpu.settings import TrainSettings

FLAT = Card("flat", 16, 100.0, 1000.0, launch_us=10.0, graph_launch_us=1.0,
            matmul_curve=((256, 100.0), (8192, 100.0)))
"""100 TFLOP/s at every size, 1,000 GB/s, 10 us a bare op, 1 us a graph kernel."""


def test_a_product_takes_its_flops_at_the_cards_rate_or_its_bytes_at_the_bandwidth():
    big = Gemm(8192, 8192, 8192)
    t = step_time(StepWork((big,)), FLAT)
    assert t.rows[0].seconds == pytest.approx(2 * 8192**3 / 100e12)
    skinny = Gemm(65536, 16, 4096)  # a LoRA product: its bytes, not its FLOPs, set its time
    t = step_time(StepWork((skinny,)), FLAT)
    bytes_moved = 2 * (65536 * 4096 + 4096 * 16 + 65536 * 16)
    assert t.rows[0].seconds == pytest.approx(bytes_moved / 1000e9)
    batched = Gemm(768, 768, 768, count=12, batch=12)  # Muon's stacked products run as one larger one
    card = find_card("RTX 5070 Ti")
    alone = step_time(StepWork((Gemm(768, 768, 768, count=12),)), card).rows[0].seconds
    assert step_time(StepWork((batched,)), card).rows[0].seconds < alone


def test_attention_efficiency_grows_with_the_sequence():
    flops = 1e12
    times = {}
    for seq in (256, 1024, 16384):
        times[seq] = step_time(StepWork((), attention_flops=flops, seq_len=seq), FLAT).rows[1].seconds
        eff = ATTENTION_EFFICIENCY * seq / (seq + ATTENTION_HALF_SEQ)
        assert times[seq] == pytest.approx(flops / (100e12 * eff))
    assert times[256] > times[1024] > times[16384]


def test_memory_bytes_at_the_bandwidth_and_kernels_on_device_and_host():
    work = StepWork((), memory_bytes=(("a", 2e9), ("b", 1e9)), kernels=1000, optimizer_kernels=20)
    t = step_time(work, FLAT)
    assert t.rows[2].seconds == pytest.approx(3e9 / 1000e9)
    assert t.rows[3].seconds == pytest.approx(1020 * DEVICE_KERNEL_FACTOR * 1e-6)
    assert t.host_seconds == pytest.approx(1000 * 10e-6 * HOST_KERNEL_FACTOR["eager"])
    compiled = step_time(StepWork((), kernels=1000, compiled=True), FLAT)
    assert compiled.host_seconds == pytest.approx(1000 * 10e-6 * HOST_KERNEL_FACTOR["compiled"])
    assert step_time(work, FLAT, cuda_graphs=True).host_seconds == 0.0


def test_each_phase_takes_the_longer_of_device_and_host():
    """Many small kernels: the host launching them is the step (launch-bound); the optimizer's eager launches are a
    phase of their own after the backward."""
    small = StepWork((Gemm(64, 64, 64),), kernels=10_000, optimizer_kernels=100)
    t = step_time(small, FLAT)
    assert t.bound.startswith("launch-bound")
    assert t.seconds == pytest.approx(max(t.device_seconds, t.host_seconds)
                                      + max(t.optimizer_device_seconds, t.optimizer_host_seconds))
    assert t.seconds == pytest.approx(10_000 * 10e-6 * HOST_KERNEL_FACTOR["eager"]
                                      + 100 * 10e-6 * HOST_KERNEL_FACTOR["eager"])


def test_an_optimizer_that_loops_over_its_tensors_is_priced_per_tensor_on_the_host():
    """bitsandbytes' 8-bit AdamW calls its kernel tensor by tensor from Python: its optimizer phase grows with the
    parameter tensors (not with their kernels' bytes), and a fused AdamW's does not."""
    from hf_cgpu.budget.shape import ModelShape, TrainSetup
    from hf_cgpu.budget.work import HOST_OPS_PER_TENSOR, lm_step_work

    def opt_host(layers, tier):
        shape = ModelShape(n_layer=layers, d_model=256, n_head=4, vocab_size=1000, n_positions=0)
        setup = TrainSetup(seq_len=128, micro_batch_size=2, gradient_accumulation_steps=1, tier=tier)
        return shape, step_time(lm_step_work(shape, setup), FLAT).optimizer_host_seconds

    shape, eight = opt_host(8, "adamw8bit")
    assert eight == pytest.approx(len(shape.param_tensors()) * HOST_OPS_PER_TENSOR["adamw8bit"] * 10e-6)
    assert opt_host(16, "adamw8bit")[1] > 1.8 * eight
    assert opt_host(16, "full")[1] == opt_host(8, "full")[1] < eight / 10


def test_the_minutes_hold_the_steps_their_start_up_and_evaluations_leave():
    work = StepWork((Gemm(8192, 8192, 8192, count=100),), samples=1000)
    step = step_time(work, FLAT)
    train = TrainSettings(max_steps=100_000, max_minutes=2, eval_steps=50, checkpointing_steps=0)
    rt = run_time(step, train, startup_s=30.0, eval_batches=10)
    eval_each = 10 * step.seconds / 3
    assert rt.steps == int((120 - 30) / (step.seconds + eval_each / 50))
    assert rt.limited_by_minutes and rt.seconds <= 120 + step.seconds


def test_cards_by_name_device_name_and_bench(tmp_path):
    assert find_card("rtx 5070ti") is CARDS["RTX 5070 Ti"] and find_card("cpu") is CPU
    assert card_of_device("NVIDIA GeForce RTX 5070 Ti") is CARDS["RTX 5070 Ti"]  # not the RTX 5070
    assert card_of_device("NVIDIA H100 80GB HBM3") is CARDS["H100 SXM"]
    assert card_of_device("Tesla T4") is None
    ti = CARDS["RTX 5070 Ti"]
    assert ti.matmul_tflops == pytest.approx(70 * 2.452 * 512 / 1e3 * 0.80)  # SMs x clock x 512, sustained share
    with pytest.raises(SettingsError, match="^unknown card 'RTX 9999': choose one of RTX 3060"):
        find_card("RTX 9999")
    assert with_peak(ti, 50.0).matmul_tflops == 50.0
    # the bench of this machine: read back with its curve; another machine's or an older one refused in one line
    result = BenchResult("NVIDIA GeForce RTX 5070 Ti", 16 * 2**30, "sm_120", 800.0, {1024: 30.0, 4096: 70.0},
                         launch_us=7.0, graph_launch_us=1.5, host=platform.node())
    path = save_result(result, tmp_path / "bench.json")
    card = resolve_card(bench_path=path)
    assert (card.matmul_tflops, card.launch_us, card.matmul_curve) == (70.0, 7.0, ((1024, 30.0), (4096, 70.0)))
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "host": "another-machine"}))
    with pytest.raises(SettingsError, match="measured on another machine .* run `hf-cgpu bench` here"):
        resolve_card(bench_path=path)
    path.write_text(json.dumps({**data, "format": BENCH_FORMAT - 1}))
    with pytest.raises(SettingsError, match="older hf-cgpu bench"):
        resolve_card(bench_path=path)


def test_an_unknown_card_is_one_line_and_exit_2(capsys):
    assert cli_main(["budget", "--card", "GTX 480"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown card 'GTX 480'")


# The ledger's figures for shipped runs on an RTX 5070 Ti by its public figures: a change to the arithmetic (or to
# a preset) shows here; update them with the reason in CHANGELOG.md.
PINNED = {
    ("--preset", "zh-poetry-modern"): (0.973, 361),
    ("--preset", "124m"): (1.989, 10_000),
    ("--preset", "pythia-1.4b", "--tier", "lora"): (4.307, 1_000),
}


@pytest.mark.parametrize("argv", list(PINNED))
def test_the_time_ledger_of_shipped_runs_is_pinned(argv):
    shape, train, _ = describe_run([*argv, "--card", "RTX 5070 Ti"])
    rt = lm_run_time(shape.model, shape.setup(train), train, CARDS["RTX 5070 Ti"])
    step, steps = PINNED[argv]
    assert (round(rt.step.seconds, 3), min(rt.steps, 10_000)) == (step, steps)


def test_the_image_tasks_have_a_budget_answer():
    text = run(["--task", "flow", "--preset", "cifar10", "--card", "RTX 5070 Ti"])
    assert "images/s per GPU" in text and "verdict vs 16.00 GiB cap: FITS" in text
    assert "this run         39,000 steps x 256 images" in text
    for task in ("flow-distill", "classifier"):
        assert "images/s per GPU" in run(["--task", task, "--preset", "cifar10"])
    assert "fake samples' activations" not in run(["--task", "flow-distill", "--preset", "cifar10"])
    gan = run(["--task", "flow-distill", "--preset", "cifar10-gan"])  # the adversarial stage's rows, nothing left out
    assert "images/s per GPU" in gan and "note:" not in gan
    assert all(row in gan for row in ("discriminator heads", "fake samples' activations", "critic's activations",
                                      "peak at the discriminator step"))
    with pytest.raises(SettingsError, match="^--task 'toy2d': the ledger prices gpt, lora, dpo, flow"):
        run(["--task", "toy2d"])


def test_a_cpu_run_that_cannot_fit_the_machines_memory_is_refused_before_its_first_step():
    """The README's pretraining preset on a CPU: its fp32 tensors (the host ledger, with the per-document mask's T x T
    scores) do not fit 16 GiB free, and the run says so in one line instead of being killed mid-step; the tiny preset
    passes; a run whose minutes hold few CPU steps is told so."""
    from hf_cgpu.train.prepare import check_cpu_run

    GiB = 2**30
    shape, train, _ = describe_run(["--preset", "zh-poetry-modern"])
    with pytest.raises(SettingsError, match=r"^on the CPU this run holds about 20\.2 GiB .* 16\.0 GiB are free: train "
                                            r"--preset tiny"):
        check_cpu_run(shape.setup(train), shape.model, train, available=16 * GiB)
    said = []
    check_cpu_run(shape.setup(train), shape.model, train, said.append, available=64 * GiB)
    assert said and "--max_minutes 7 holds about 1 of them; --preset tiny is the CPU-sized run" in said[0]
    tiny, train, _ = describe_run(["--preset", "tiny"])
    said = []
    check_cpu_run(tiny.setup(train), tiny.model, train, said.append, available=4 * GiB)
    assert said == []


def test_the_cpu_card_prices_small_products_near_its_top_rate():
    """A CPU's BLAS reaches most of its rate from a few hundred rows, unlike a GPU's tiles: the assumed CPU must not
    price a small model's products as launch-bound (with the GPU curve a 256-row product ran at 0.4% of the rate)."""
    top = CPU.matmul_tflops * 1e12
    assert CPU.matmul_rate(256, 256, 256) >= 0.5 * top
    assert CPU.matmul_rate(32, 32, 32) < CPU.matmul_rate(256, 256, 256) <= CPU.matmul_rate(2048, 2048, 2048)
    assert CPU.matmul_rate(2048, 2048, 2048) == pytest.approx(top)
