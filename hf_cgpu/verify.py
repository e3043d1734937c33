"""``hf-cgpu verify DIR``: check a model, best-weights or checkpoint folder (or a whole output folder) against the
checksum manifests hf_cgpu wrote, file by file.

    hf-cgpu verify runs/gpt              # the final model, best/, tokenizer/ and every checkpoint
    hf-cgpu verify runs/gpt/checkpoints/step_0001000

One line per folder (``ok`` or ``BAD`` with the file that differs); exit 0 when every folder verifies, else the usual
one-line error and exit 2. A model, best/ or tokenizer/ folder without its manifest is BAD ("unsealed"): its files
cannot be checked (a save cut off before its manifest, or files put there by hand), and so is one whose final save
was cut off while its files moved (a sealed staging save pending).

``check_saved`` is what every command that reads a saved folder (``sample``, ``eval``, ``generate``, ``export``, a
``--teacher``, a ``--guidance_model``, a fine-tune's ``--model``, an adapter's base) checks first, by its
``--verify`` (``options.VERIFY_MODES``): a folder with a manifest must match it, one that hf_cgpu wrote without a
valid seal is refused, and a folder hf_cgpu did not write (no manifest, no trace of a run) is read as it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .errors import ArgumentParser, IntegrityError, MissingPathError, about
from .integrity import MANIFEST, read_manifest, verify_folder
from .options import VERIFY_MODES, check_choice
from .train.artifacts import STAGING
from .train.checkpoint import checkpoint_root, list_checkpoints
from .train.checkpoint import verify as verify_checkpoint
from .train.outdir import LOCK_NAME, MODEL_FILES

HASH_LIMIT = 512 * 2**20
"""``--verify auto`` checks the SHA-256 of every file of a folder whose files total at most this many bytes (a flow
pipeline, an adapter, a small GPT), only their sizes above it (``--verify full``: always)."""


def folders_to_check(d: Path) -> list[Path]:
    """``d`` itself when it has a manifest, holds a model's files or has a final save pending, its ``best/`` and
    ``tokenizer/``, and its sealed checkpoints (or, for a checkpoints/ folder, the checkpoints in it)."""
    if d.name == "checkpoints":
        return list_checkpoints(d.parent)
    model = any((d / name).is_file() for name in (MANIFEST, *MODEL_FILES, f"{STAGING}/{MANIFEST}"))
    out = [d] if model else []
    out += [d / sub for sub in ("best", "tokenizer") if (d / sub).is_dir()]
    return out + list_checkpoints(d)


def unsealed(folder: Path) -> str | None:
    """Why ``folder``, written by hf_cgpu, has no seal to check (None: it has its manifest, or no trace of a run:
    its lock file, a staging save or a checkpoint)."""
    if (folder / MANIFEST).is_file():
        return None
    if (folder / STAGING / MANIFEST).is_file():
        return ("unsealed, its final save was cut off while its files moved; the next run in this folder finishes it: "
                "resume it with --resume_from_checkpoint latest (a --save_pipeline folder: save it again)")
    if (folder / LOCK_NAME).is_file() or (folder / STAGING).is_dir() or list_checkpoints(folder):
        return (f"unsealed, no {MANIFEST}: the run that wrote it did not finish its final save; resume it with "
                "--resume_from_checkpoint latest")
    return None


def _lists(run: Path, name: str) -> bool:
    """Whether the manifest of ``run`` (or of its pending staging save) lists files under ``name/``."""
    for folder in (run, run / STAGING):
        if (folder / MANIFEST).is_file() and any(rel.startswith(f"{name}/") for rel in read_manifest(folder).files):
            return True
    return False


def check_saved(path: str | os.PathLike, mode: str = "auto", what: str = "") -> None:
    """Refuse, in one line naming the fix, a saved folder (or a file in one) that hf_cgpu wrote and that does not
    verify: ``mode`` (``options.VERIFY_MODES``) auto checks the sizes of the files its manifest lists, and their
    SHA-256 for a folder of at most ``HASH_LIMIT`` bytes; sizes, full and off as they say. A folder without a
    manifest and without a trace of a run (a plain transformers or diffusers folder) is read as it is, and a path
    that does not exist (a Hub id) is left to the loader. A component folder (``RUN/unet``, ``RUN/merged``) is
    checked through its run's manifest. ``what`` names the path in the message (a flag, say)."""
    check_choice("--verify", mode, VERIFY_MODES)
    if not os.fspath(path):
        return
    path = Path(path).expanduser()
    if not path.exists():
        return
    folder = path if path.is_dir() else path.parent
    if not (folder / MANIFEST).is_file() and not unsealed(folder) and _lists(folder.parent, folder.name):
        folder = folder.parent
    label = f"{what} {path}" if what else str(path)
    if mode == "off":
        if (folder / MANIFEST).is_file() or unsealed(folder):
            print(f"note: --verify off: {label} is read without checking it against its {MANIFEST}", file=sys.stderr)
        return
    where = label if folder == path else f"{label}: {folder}"  # the folder whose seal is checked, once
    reason = unsealed(folder)
    if reason:
        raise IntegrityError(f"{where} is {reason}; or pass --verify off to read it as it is")
    if not (folder / MANIFEST).is_file():
        return  # not written by hf_cgpu: nothing to check it against
    try:
        verify_folder(folder, check_hashes=mode != "sizes", hash_limit=HASH_LIMIT if mode == "auto" else None)
    except IntegrityError as err:
        raise IntegrityError(f"{where}: {str(err).removeprefix(f'{folder}: ')}; `hf-cgpu verify {folder}` checks "
                             "every file: resume or retrain the run that wrote it, or pass --verify off to read it as "
                             "it is") from None


def check(folder: Path, hashes: bool = True) -> str:
    """A one-line description of a folder that verifies; raises IntegrityError otherwise."""
    if folder.parent.name == "checkpoints" and hashes:
        verify_checkpoint(folder)
    if (folder / STAGING / MANIFEST).is_file() and (reason := unsealed(folder)):
        raise IntegrityError(f"{folder}: {reason}")
    if not (folder / MANIFEST).is_file():
        raise IntegrityError(f"{folder}: unsealed, no {MANIFEST}: its files cannot be checked (a save cut off before "
                             "its manifest, or files put there by hand); resume the run that wrote it "
                             "(--resume_from_checkpoint latest) to save it again")
    manifest = verify_folder(folder, check_hashes=hashes)
    step = manifest.meta.get("step")
    return (f"{manifest.kind}, {len(manifest.files)} files, {manifest.total_bytes / 1e6:.1f} MB"
            + (f", step {step}" if step is not None else "") + ("" if hashes else ", sizes only"))


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="hf-cgpu verify", description=about(
        "Check a model, best-weights or checkpoint folder (or a whole output folder) against the checksum manifests "
        "hf_cgpu wrote, file by file.", "hf-cgpu verify runs/zh"))
    parser.add_argument("folder", help="an output folder, a model folder, best/, or a checkpoint step_N folder")
    parser.add_argument("--sizes_only", action="store_true", help="check presence and sizes, not checksums (fast)")
    args = parser.parse_args(argv)
    d = Path(args.folder)
    if not d.is_dir():
        raise MissingPathError(f"{d} is not a folder; pass an output_dir, a model folder or a checkpoint folder")
    folders = folders_to_check(d)
    if not folders:
        raise IntegrityError(f"{d} holds no {MANIFEST} and no sealed checkpoint: nothing to verify (a final save "
                             "that was cut off, or a folder written before manifests)")
    bad = []
    for folder in folders:
        try:
            print(f"ok   {folder}: {check(folder, not args.sizes_only)}")
        except IntegrityError as err:
            bad.append(str(err))
            print(f"BAD  {folder}: {err}")
    root = checkpoint_root(d if d.name != "checkpoints" else d.parent)
    leftovers = sorted(p.name for p in root.glob(".*")) if root.is_dir() else []
    if leftovers:
        print(f"note {root}: not checkpoints (interrupted or set aside): {', '.join(leftovers)}")
    if bad:
        raise IntegrityError(f"{len(bad)} of {len(folders)} folders failed verification (first: {bad[0]})")
    return 0


__all__ = ["HASH_LIMIT", "check", "check_saved", "folders_to_check", "main", "unsealed"]
