"""--emulate_card: a run trains the steps the ledger gives a named card in --max_minutes, whatever this machine's
clock says, and says so in all_results.json and on its card."""

from __future__ import annotations

import json

import pytest

from hf_cgpu.budget.card import find_card
from hf_cgpu.cli import main
from hf_cgpu.commands.budget import price

RUN = ["--preset", "tiny", "--n_layer", "2", "--n_embd", "64", "--seq_len", "64", "--vocab_size", "512",
       "--max_steps", "50", "--warmup_steps", "2", "--eval_steps", "0", "--micro_batch_size", "4", "--compile", "false",
       "--load_best_at_end", "false", "--early_stopping_patience", "0"]
CARD = "RTX 3060"
MINUTES = "0.001"  # the ledger gives the card 7 of these steps in 60 ms: far less than this CPU needs for them


def _train(tmp_path, *flags) -> int:
    return main(["train", "gpt", *RUN, *flags, "--progress", "false", "--max_new_tokens", "4", "--prompts", "The",
                 "--mixed_precision", "no", "--cache_dir", str(tmp_path / "cache"), "--output_dir",
                 str(tmp_path / "run")])


def test_an_emulated_run_trains_the_steps_the_ledger_gives_the_card(tmp_path, capsys):
    expected = price("gpt", [*RUN, "--max_minutes", MINUTES], find_card(CARD))["steps"]
    assert 2 < expected < 50
    assert _train(tmp_path, "--emulate_card", CARD, "--max_minutes", MINUTES) == 0
    out = capsys.readouterr().out
    assert f"the {expected:,} steps the ledger gives it" in out
    results = json.loads((tmp_path / "run" / "all_results.json").read_text())
    assert results["steps"] == expected  # not stopped by this machine's clock, not run to max_steps
    led = results["ledger"]
    assert led["emulated"] is True and led["card"].startswith(CARD) and led["step_error"] is None
    assert led["steps_in_minutes"] == led["measured_steps"] == expected
    assert "emulated: the" in (tmp_path / "run" / "README.md").read_text()


@pytest.mark.parametrize("flags, words", [
    (["--emulate_card", "RTX 9999", "--max_minutes", "1"], "unknown card"),
    (["--emulate_card", CARD], "add --max_minutes"),
])
def test_a_bad_emulation_is_refused_in_one_line(tmp_path, capsys, flags, words):
    assert _train(tmp_path, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()
