"""Compiled runs: the recompile watch (unit, on a torch.compile'd function), a compiled loop run with no recompile
(dynamo's eager backend on the CPU: the same guards as inductor, no codegen), the fixed compile cache and the time
to the first step in all_results.json."""

import json
import os
import runpy
import sys
from pathlib import Path

import pytest
import torch

from hf_cgpu.train.compiled import RecompileWatch, describe, use_compile_cache


def test_watch_counts_a_shape_recompile_and_names_it():
    lines = []
    f = torch.compile(lambda x: (x * 2).sum(), dynamic=False, backend="eager")
    with RecompileWatch(lines.append) as watch:
        f(torch.ones(3))
        f(torch.ones(3))
        assert watch.count == 0
        watch.step = 7
        f(torch.ones(4))  # dynamic=False: a new static graph
    assert watch.count == 1 and len(lines) == 1
    assert "after step 7" in lines[0] and "size mismatch" in lines[0] and "warning: torch.compile recompiled" in lines[0]
    assert watch.events[0]["step"] == 7
    f(torch.ones(5))  # closed: not counted any more
    assert watch.count == 1


def test_watch_counts_a_grad_mode_recompile():
    f = torch.compile(lambda x: x.sin() * 3, dynamic=False, backend="eager")
    x = torch.ones(2, requires_grad=True)
    with RecompileWatch(lambda m: None) as watch:
        f(x)
        with torch.no_grad():
            f(x)
    assert watch.count == 1 and "grad_mode" in watch.events[0]["reason"]


def test_describe_reads_dynamo_message():
    msg = ("Recompiling function forward in /a/unet.py:139\n    triggered by the following guard failure(s):\n"
           "    - 0/0: GLOBAL_STATE changed: grad_mode\n    - 0/1: other")
    assert describe(msg) == ("forward in /a/unet.py:139", "0/0: GLOBAL_STATE changed: grad_mode")


def test_compile_cache_under_hf_cgpu_cache_unless_set(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("HF_CGPU_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))  # what transformers' import sets
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    chosen = use_compile_cache(lambda m: None)
    assert chosen == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c" / "inductor"),
                      "TRITON_CACHE_DIR": str(tmp_path / "c" / "triton")}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "tmine"))
    assert use_compile_cache(lambda m: None) == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine"),
                                                 "TRITON_CACHE_DIR": str(tmp_path / "tmine")}


@pytest.mark.slow
def test_compiled_flow_run_has_no_recompile(tmp_path, synthetic_data, monkeypatch, capsys):
    """Training, two evaluations (no_grad, eval(), a 9-image remainder batch, the 160-image CFG sample batch) and the
    final save: not one recompile; the first step's time is recorded."""
    monkeypatch.setenv("HF_CGPU_COMPILE_ON_CPU", "eager")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    out = tmp_path / "run"
    argv = ["train_flow.py", "--preset", "tiny", "--dataset", str(synthetic_data), "--output_dir", str(out),
            "--max_steps", "4", "--eval_steps", "2", "--checkpointing_steps", "0", "--log_steps", "2",
            "--sample_steps", "2", "--progress", "false", "--compile", "true"]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        runpy.run_path(str(Path(__file__).resolve().parents[1] / "recipes" / "train_flow.py"), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None)
    log = capsys.readouterr().out
    results = json.loads((out / "all_results.json").read_text())
    assert "recompiled" not in log, log
    assert results["recompiles"] == 0
    assert results["seconds_to_first_step"] > 0 and "start-up: first optimizer step done" in log
    assert f"compile cache: {tmp_path / 'inductor'}" in log


def test_uncompiled_run_records_no_recompile_count():
    from hf_cgpu.train.metrics import Metrics

    class Acc:
        device = torch.device("cpu")
        is_main_process = False

        def print(self, *a):
            pass

    class S:
        log_steps, max_steps, progress, report_to = 1, 1, False, "none"

    m = Metrics(Acc(), S(), "img", 0.0, (0.0, "none"))
    assert m.summary()["recompiles"] is None and m.summary()["seconds_to_first_step"] is None


@pytest.mark.slow
def test_channels_last_unet_keeps_layout_optimization_in_forward_and_backward(monkeypatch):
    """The flow UNet (channels_last) compiled by apply_compile: inductor lowers its forward and its backward graph with
    layout optimization on, which its heuristic alone turns off for this UNet (decoder convs with in >= 2 x out
    channels); off, cuDNN's backward copied activations back to channels_last (issue 12's profile). mkldnn is off so
    the CPU takes the GPU's heuristic instead of always choosing channels_last."""
    from torch._inductor.graph import GraphLowering

    decided = []
    original = GraphLowering.decide_layout_opt

    def record(gm, *, is_inference):
        decided.append(original(gm, is_inference=is_inference))
        return decided[-1]

    monkeypatch.setattr(GraphLowering, "decide_layout_opt", staticmethod(record))
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    # a cached graph would skip the lowering. The config's own patch: monkeypatch would find no attribute in the
    # module's __dict__ and delete it on undo, which hides the setting from every later compile in the process
    with torch._inductor.config.patch(fx_graph_cache=False):
        _check_layout_decisions(decided)


def _check_layout_decisions(decided: list) -> None:
    from hf_cgpu.flow.unet import FlowUNet2DModel
    from hf_cgpu.tiers import apply_compile, compile_options

    torch._dynamo.reset()

    def unet():
        torch.manual_seed(0)
        return FlowUNet2DModel(sample_size=4, base_channels=8, norm_num_groups=4).to(memory_format=torch.channels_last)

    x = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    plain = torch.compile(unet(), dynamic=False)  # torch.compile as is: the heuristic's choice
    plain(x, torch.rand(2)).sample.sum().backward()
    assert decided == [False, False]
    decided.clear()
    torch._dynamo.reset()
    model = apply_compile(unet(), True)
    model(x, torch.rand(2)).sample.sum().backward()
    assert decided == [True, True]  # forward and backward (compiled later, out of torch.compile's scope)
    torch._dynamo.reset()
    assert compile_options(unet(), "reduce-overhead") == {
        "options": {"triton.cudagraphs": True, "force_layout_optimization": True}}  # the mode is not lost
    assert compile_options(FlowUNet2DModel(sample_size=4, base_channels=8, norm_num_groups=4), None) == {"mode": None}
