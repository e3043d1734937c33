"""One error path: a UserError from any recipe or hf-cgpu subcommand is one line on stderr and exit code 2; any other
exception keeps its traceback; HF_CGPU_DEBUG=1 shows the traceback of user errors too."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

from hf_cgpu.cli import main as cli_main
from hf_cgpu.errors import SettingsError, UserError, run_main

ROOT = Path(__file__).resolve().parents[1]


def _raise(err):
    def main(argv):
        raise err
    return main


def test_user_error_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("HF_CGPU_DEBUG", raising=False)
    assert run_main(_raise(SettingsError("bad --tier turbo;\n  choose full")), []) == 2
    assert capsys.readouterr().err == "error: bad --tier turbo; choose full\n"


def test_internal_errors_keep_their_traceback(monkeypatch):
    monkeypatch.delenv("HF_CGPU_DEBUG", raising=False)
    with pytest.raises(RuntimeError, match="a bug"):
        run_main(_raise(RuntimeError("a bug")), [])
    with pytest.raises(ValueError):  # a plain ValueError is no user error: it is not swallowed any more
        run_main(_raise(ValueError("internal")), [])


def test_debug_shows_the_traceback_of_user_errors(monkeypatch):
    monkeypatch.setenv("HF_CGPU_DEBUG", "1")
    with pytest.raises(UserError, match="fix"):
        run_main(_raise(UserError("fix")), [])


@pytest.mark.parametrize("argv, fix", [
    (["budget", "--preset", "13b"], "choose one of tiny"),
    (["bench"], "no CUDA device"),
    (["push", "/nonexistent/run", "someone/x"], "not a directory"),
    (["eval", "/nonexistent/run", "--dataset", "builtin"], "not found"),
    (["sample", "/nonexistent/run"], "not found"),
    (["generate", "/nonexistent/run", "hello"], "not found"),
])
def test_every_subcommand_ends_bad_input_in_one_line(argv, fix, capsys, monkeypatch):
    monkeypatch.delenv("HF_CGPU_DEBUG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and fix in err and err.count("\n") == 1


@pytest.mark.parametrize("recipe, argv, fix", [
    ("train_gpt.py", ["--n_embd", "100", "--n_head", "3"], "not divisible by n_head"),
    ("train_flow.py", ["--time_sampling", "cosine"], "uniform or logit_normal"),
    ("finetune_lora.py", ["--tier", "turbo"], "unknown tier"),
    ("train_classifier.py", ["--widths", "1,2"], "four comma-separated"),
    ("flow2d.py", ["--nfe_budgets", "2;5"], "comma-separated"),
])
def test_every_recipe_ends_bad_input_in_one_line(recipe, argv, fix, capsys, monkeypatch):
    monkeypatch.delenv("HF_CGPU_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", [recipe, *argv])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "recipes" / recipe), run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and fix in err and err.count("\n") == 1
