"""What a run prints is about the run: no library hint that asks nothing of the user, no advice meant for another
run, no cadence the run never reaches, no figure without the warning it needs."""

from __future__ import annotations

import logging

import hf_cgpu


def test_the_bitsandbytes_kernels_hint_alone_is_dropped(caplog):
    log = logging.getLogger(hf_cgpu.BNB_KERNELS_LOGGER)
    with caplog.at_level(logging.WARNING):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
                    "`pip install kernels` and the kernels >= 0.11.1", "No module named 'kernels'")
        log.warning("some other bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["some other bitsandbytes warning"]


def test_flow_grid_cadence_is_the_runs():
    from hf_cgpu.tasks.flow_images import grid_cadence

    assert grid_cadence(200, 20) == "sample grid at the end"  # a 20-step run never reaches step 200
    assert grid_cadence(0, 20) == "sample grid at the end"
    assert grid_cadence(5, 20) == "sample grid every 5 steps and at the end"


def test_a_weak_judge_classifier_is_named_before_its_fd(tmp_path):
    import json

    from hf_cgpu.evaluation.flow import weak_judge_warning

    (tmp_path / "all_results.json").write_text(json.dumps({"accuracy": 0.21}))
    line = weak_judge_warning(tmp_path, measured=0.95)  # the run's held-out figure wins over this split's
    assert line.startswith("warning: the classifier is 21% accurate") and "--preset cifar10" in line
    assert "\n" not in line
    (tmp_path / "all_results.json").write_text(json.dumps({"accuracy": 0.9}))
    assert weak_judge_warning(tmp_path, measured=0.1) is None
    (tmp_path / "all_results.json").unlink()
    assert "50% accurate on held-out images (on the real images here)" in weak_judge_warning(tmp_path, measured=0.5)
    assert weak_judge_warning(tmp_path, measured=None) is None
