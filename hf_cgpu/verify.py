"""``hf-cgpu verify DIR``: check a model, best-weights or checkpoint folder (or a whole output folder) against the
checksum manifests hf_cgpu wrote, file by file.

    hf-cgpu verify runs/gpt              # the final model, best/, tokenizer/ and every checkpoint
    hf-cgpu verify runs/gpt/checkpoints/step_0001000

One line per folder (``ok`` or ``BAD`` with the file that differs); exit 0 when every folder verifies, else the usual
one-line error and exit 2. A model, best/ or tokenizer/ folder without its manifest is BAD ("unsealed"): its files
cannot be checked (a save cut off before its manifest, or files put there by hand).
"""

from __future__ import annotations

from pathlib import Path

from .errors import ArgumentParser, IntegrityError, MissingPathError, about
from .integrity import MANIFEST, verify_folder
from .train.artifacts import STAGING
from .train.checkpoint import checkpoint_root, list_checkpoints
from .train.checkpoint import verify as verify_checkpoint
from .train.outdir import MODEL_FILES


def folders_to_check(d: Path) -> list[Path]:
    """``d`` itself when it has a manifest or holds a model's files, its ``best/`` and ``tokenizer/``, and its
    sealed checkpoints (or, for a checkpoints/ folder, the checkpoints in it)."""
    if d.name == "checkpoints":
        return list_checkpoints(d.parent)
    out = [d] if (d / MANIFEST).is_file() or any((d / name).is_file() for name in MODEL_FILES) else []
    out += [d / sub for sub in ("best", "tokenizer") if (d / sub).is_dir()]
    return out + list_checkpoints(d)


def check(folder: Path, hashes: bool = True) -> str:
    """A one-line description of a folder that verifies; raises IntegrityError otherwise."""
    if folder.parent.name == "checkpoints" and hashes:
        verify_checkpoint(folder)
    if not (folder / MANIFEST).is_file() and (folder / STAGING / MANIFEST).is_file():
        raise IntegrityError(f"{folder}: unsealed, its final save was cut off while its files moved; the next run in "
                             "this folder finishes it: resume it with --resume_from_checkpoint latest")
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


__all__ = ["check", "folders_to_check", "main"]
