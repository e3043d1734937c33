"""What a new user meets first: Ctrl-C, a base model that is no model, a GGUF file to chat with, text data and its
columns, the mode of the files a run writes, one spelling of errors, and every command's --help."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
TINY = ["--preset", "tiny", "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--seq_len", "32",
        "--vocab_size", "300", "--micro_batch_size", "4", "--log_steps", "1", "--progress", "false",
        "--eval_steps", "0", "--max_new_tokens", "4", "--cpu"]


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a test runner in the background may pass SIGINT ignored


# ---------------------------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.slow
def test_ctrl_c_is_one_line_exit_130_naming_the_checkpoint_and_the_command(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hf_cgpu.cli", "train", "gpt", *TINY, "--max_steps", "5000",
           "--checkpointing_steps", "0", "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**ENV, "HF_CGPU_CACHE": str(tmp_path / "cache")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    for line in proc.stdout:
        if line.startswith("step 3:"):
            break
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and sum(line.startswith("error:") for line in stderr.splitlines()) == 1
    last = stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"error: interrupted \(Ctrl-C\) at step (\d+); checkpoint (\S+) is kept: resume with: (.+)",
                         last)
    assert found, last
    step, kept, again = int(found[1]), Path(found[2]), shlex.split(found[3])
    assert kept == out / "checkpoints" / f"step_{step:07d}" and (kept / "manifest.json").is_file()
    assert again == [Path(sys.executable).name, *cmd[1:], "--resume_from_checkpoint", "latest"]


# ---------------------------------------------------------------------------------------------------- a base model
def test_a_base_needs_weights_and_tokenizer_files_a_real_one_passes(neox_dir, tiny_base):
    from hf_cgpu.errors import SettingsError
    from hf_cgpu.finetune import check_base

    with pytest.raises(SettingsError, match="has weights but no tokenizer files"):
        check_base(str(neox_dir))  # transformers would load it with a 2-token tokenizer
    check_base(str(tiny_base))
    check_base("owner/name")  # a Hub id is checked on the Hub


# ---------------------------------------------------------------------------------------------------- a GGUF file
def test_generate_takes_a_gguf_file_and_names_the_missing_package(tmp_path, monkeypatch, capsys):
    from hf_cgpu.cli import main

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # not installed
    assert main(["generate", str(tmp_path / "model.gguf"), "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the gguf package: pip install gguf" in err, err


# ---------------------------------------------------------------------------------------------------- one spelling
def _strings(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            yield node.lineno, str(node.values[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_errors_and_warnings_are_spelled_one_way():
    """`error: ...` (run_main) and `warning: ...` / `note: ...` lines: no message of the package or its scripts starts
    with another spelling (Error:, ERROR, Warning:)."""
    other = ("Error:", "ERROR", "Warning:", "WARNING", "Note:", "NOTE:")
    files = [*sorted((ROOT / "hf_cgpu").rglob("*.py")), *sorted((ROOT / "recipes").glob("*.py"))]
    found = [f"{f.relative_to(ROOT)}:{line}: {text[:40]!r}" for f in files for line, text in _strings(f)
             if text.lstrip("\n ").startswith(other)]
    assert not found, found


# ---------------------------------------------------------------------------------------------------- file modes
def test_every_file_a_run_writes_has_an_ordinary_files_mode(tmp_path):
    """safetensors writes 0600; checkpoints, best weights and the model folder end as ordinary files (0666 less
    the umask), as the rest of the run's files."""
    from safetensors.torch import save_file

    from hf_cgpu.integrity import file_mode
    from hf_cgpu.train import fit
    from test_loop import ToyTask, settings

    class SafetensorsToy(ToyTask):
        def save_pretrained(self, model, output_dir):
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(output_dir / "toy.safetensors"))

    umask = os.umask(0o022)
    os.umask(umask)
    assert file_mode() == 0o666 & ~umask
    fit(SafetensorsToy(), settings(tmp_path, max_steps=4, eval_steps=2, save_best=True))
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != ".hf_cgpu.lock"]
    assert any(p.suffix == ".safetensors" and "checkpoints" in p.parts for p in files)
    assert (tmp_path / "toy.safetensors").is_file()
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(file_mode())}, modes


# ---------------------------------------------------------------------------------------------------- --help
def _help(argv, capsys) -> str:
    from hf_cgpu.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 0
    return capsys.readouterr().out


def _helps():
    from hf_cgpu.cli import COMMANDS
    from hf_cgpu.recipes import RECIPES

    return [[name, "--help"] for name in COMMANDS] + [["train", name, "--help"] for name in RECIPES]


@pytest.mark.parametrize("argv", _helps(), ids=" ".join)
def test_every_help_starts_with_what_the_command_does_and_an_example(argv, capsys):
    paragraphs = _help(argv, capsys).split("\n\n")
    assert paragraphs[0].startswith("usage: hf-cgpu")
    what, example = " ".join(paragraphs[1].split()), paragraphs[2].splitlines()
    assert what.endswith(".") and ". " not in what.rstrip("."), what  # one sentence
    assert example[0] in ("example:", "examples:") and example[1].startswith("  hf-cgpu "), example


def test_eval_help_covers_both_modes_with_their_own_flags(capsys):
    text = _help(["eval", "--help"], capsys)
    lm, images = text.split("=== text mode", 1)[1].split("=== image mode", 1)
    assert all(flag in lm for flag in ("--dataset", "--split", "--text_column", "--max_windows", "--data_format"))
    assert all(flag in images for flag in ("--classifier", "--sweep", "--num_images", "--scheduler"))
    assert "--classifier" not in lm and "--text_column" not in images
