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
