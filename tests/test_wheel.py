"""The package as pip installs it: build the wheel, install it non-editable into a fresh virtual environment (its
dependencies from this interpreter's site-packages), and train from it outside the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, cwd=out)
    return next(out.glob("hf_cgpu-*.whl"))


def test_wheel_holds_every_subpackage_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    source = {p.relative_to(REPO).as_posix() for p in (REPO / "hf_cgpu").rglob("*")
              if p.suffix in (".py", ".json") and "__pycache__" not in p.parts}
    assert source <= names, f"missing from the wheel: {sorted(source - names)[:10]}"
    cards = {n.rsplit("/", 1)[-1] for n in names if "/model_cards/" in n}
    assert {"gpt.md", "flow.md", "lora.md"} <= cards


def test_installed_wheel_trains_outside_the_checkout(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    env = {**os.environ, "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false", "HF_CGPU_CACHE": str(tmp_path / "c")}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, env=env)
    script = (
        "import json, hf_cgpu, sys\n"
        "from hf_cgpu.loop import fit\n"
        "from hf_cgpu.settings import TrainSettings, parse_settings\n"
        "from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings\n"
        "assert '/venv/' in hf_cgpu.__file__, hf_cgpu.__file__\n"
        "gpt, train = parse_settings((GPTSettings, TrainSettings), sys.argv[1:], family='gpt')\n"
        "r = fit(CausalLMTask(gpt), train)\n"
        "print(json.dumps({'val_bpc': r['val_bpc'], 'steps': r['steps']}))\n"
    )
    args = ["--preset", "tiny", "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--seq_len", "32",
            "--vocab_size", "300", "--max_steps", "4", "--eval_steps", "2", "--eval_batches", "1",
            "--checkpointing_steps", "0", "--progress", "false", "--output_dir", str(tmp_path / "run")]
    done = subprocess.run([str(py), "-c", script, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert '"steps": 4' in done.stdout
    card = (tmp_path / "run" / "README.md").read_text()  # the card template came from the installed data files
    assert "hf_cgpu" in card and "val_bpc" in card
