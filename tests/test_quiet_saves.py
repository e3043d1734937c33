"""quiet_saves: transformers' bars off inside and restored after; accelerate's shared-tensor warning dropped only
for the model's own tied names."""

from __future__ import annotations

import logging

from transformers.utils import logging as hf_logging

from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.train.quiet import ACCELERATE_SAVE_LOGGER, quiet_saves, tied_names


def tiny(tie: bool = True) -> CgptForCausalLM:
    return CgptForCausalLM(CgptConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                      tie_word_embeddings=tie))


def warn_shared(names: str, caplog) -> list[str]:
    caplog.clear()
    logging.getLogger(ACCELERATE_SAVE_LOGGER).warning(  # as accelerate's adapter writes it
        f"[RANK 0] Removed shared tensor {names} while saving. This should be OK, but check by verifying that you "
        "don't receive any warning while reloading")
    return [r.getMessage() for r in caplog.records]


def test_tied_names_follow_the_config():
    assert tied_names(tiny()) == {"lm_head.weight"}
    assert tied_names(tiny(tie=False)) == frozenset() and tied_names(None) == frozenset()


def test_only_the_tied_head_warning_is_dropped(caplog):
    caplog.set_level(logging.WARNING, logger=ACCELERATE_SAVE_LOGGER)
    with quiet_saves(tiny()):
        assert warn_shared("{'lm_head.weight'}", caplog) == []
        assert warn_shared("{'module.lm_head.weight'}", caplog) == []  # under a wrapper's prefix
        assert len(warn_shared("{'lm_head.weight', 'h.0.mlp.fc.weight'}", caplog)) == 1  # a real share is told
        logging.getLogger(ACCELERATE_SAVE_LOGGER).warning("something else")
        assert [r.getMessage() for r in caplog.records][-1] == "something else"
    assert len(warn_shared("{'lm_head.weight'}", caplog)) == 1  # outside, accelerate speaks as before
    with quiet_saves(tiny(tie=False)):  # nothing is tied: nothing is dropped
        assert len(warn_shared("{'lm_head.weight'}", caplog)) == 1


def test_progress_bars_are_off_inside_and_restored():
    hf_logging.enable_progress_bar()
    with quiet_saves(None):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with quiet_saves(None):
            pass
        assert not hf_logging.is_progress_bar_enabled()  # a user's own choice stays
    finally:
        hf_logging.enable_progress_bar()
