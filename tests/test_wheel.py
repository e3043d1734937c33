"""The package as pip installs it: build the wheel, install it non-editable into a fresh virtual environment (its
dependencies from this interpreter's site-packages), and train from it outside the source tree with the installed
`hf-cgpu train gpt`; the card templates and presets come from the installed package (importlib.resources)."""

from __future__ import annotations

import os
import site
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


def see_the_dependencies(py: Path, env: dict[str, str]) -> None:
    """The fresh venv finds the dependencies where this interpreter has them. ``system_site_packages`` gives it the
    base interpreter's site-packages only: when the suite itself runs in a virtual environment (the README's install
    into a venv), they are in that venv's site-packages, which a ``.pth`` line then adds after the fresh venv's own
    (listed directories are not scanned for ``.pth`` files, so an editable hf_cgpu there stays out)."""
    if sys.prefix == sys.base_prefix:
        return
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "_outer_site_packages.pth").write_text("\n".join(outer) + "\n")


def test_wheel_holds_every_subpackage_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    source = {p.relative_to(REPO).as_posix() for p in (REPO / "hf_cgpu").rglob("*")
              if p.suffix in (".py", ".json") and "__pycache__" not in p.parts}
    assert source <= names, f"missing from the wheel: {sorted(source - names)[:10]}"
    cards = {p.name for p in (REPO / "model_cards").glob("*.md")}
    assert cards >= {"gpt.md", "flow.md", "lora.md"}
    assert {f"hf_cgpu/model_cards/{c}" for c in cards} <= names  # the one copy, mapped into the package
    assert not any(n.startswith(("model_cards/", "recipes/")) or "/share/" in n for n in names)


def test_installed_wheel_trains_outside_the_checkout(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    env = {**os.environ, "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false", "HF_CGPU_CACHE": str(tmp_path / "c")}
    see_the_dependencies(py, env)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, env=env)
    bin_ = env_dir / "bin"
    where = subprocess.run([str(py), "-c", "import hf_cgpu; from hf_cgpu import hub; from hf_cgpu.settings import "
                            "list_presets; print(hf_cgpu.__file__); print(hub.template_dir()); print(list_presets('gpt'))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    module, templates, presets = where.stdout.splitlines()
    site = str(env_dir / "lib")
    assert module.startswith(site) and templates.startswith(site), where.stdout  # importlib.resources, not the checkout
    assert "tiny" in presets and "124m" in presets
    assert subprocess.run([str(bin_ / "hf-cgpu"), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120).stdout.startswith("usage: hf-cgpu COMMAND")
    args = ["train", "gpt", "--preset", "tiny", "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--seq_len", "32",
            "--vocab_size", "300", "--max_steps", "4", "--eval_steps", "2", "--eval_batches", "1", "--max_new_tokens",
            "8", "--checkpointing_steps", "0", "--progress", "false", "--output_dir", str(tmp_path / "run")]
    done = subprocess.run([str(bin_ / "hf-cgpu"), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert '"steps": 4' in done.stdout and "--- sample 1" in done.stdout + done.stderr
    card = (tmp_path / "run" / "README.md").read_text()  # the card template came from the installed package
    assert "hf_cgpu" in card and "val_bpc" in card and "## Continuations" in card
