"""What a finished run leaves in ``output_dir``: the model (EMA weights when EMA is on, or the best weights),
``all_results.json`` (the final figures and every setting), ``history.json``, ``training_curves.png``, the sample
grid the card shows (image runs) and the card.

Everything but the card is written into ``output_dir/.tmp-model`` first and sealed there by a ``manifest.json``
(``hf-cgpu verify DIR`` re-checks it; the card, re-rendered by ``hf-cgpu push``, is documentation and left out);
then each file is renamed into place and the manifest moved last. A kill before the staging folder is sealed leaves
the old sealed model; a kill while the files move leaves an unsealed folder (``verify`` refuses it) beside a sealed
staging folder, which the next run in that folder finishes moving and checks against the manifest before it seals
the model (``finish_interrupted_save``): the old complete model or the new one, never a silently mixed one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..integrity import MANIFEST, IntegrityError, atomic_output, atomic_write_json, build_manifest, fsync_dir
from ..integrity import check_inside, read_manifest, sha256_file, update_manifest, write_manifest
from ..hub.cards import render_model_card
from .ema import EMA, ema_weights

STAGING = ".tmp-model"


def load_saved_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load ``save_pretrained`` output (a peft adapter, or transformers/diffusers safetensors) into ``model``."""
    folder = Path(folder)
    if (folder / "adapter_model.safetensors").is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(folder / "adapter_model.safetensors")))
        return
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"{folder} does not match the model (missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]})")


def final_results(steps: int, unit: str, units_seen: int, final: dict[str, float], keeper, use_best: bool,
                  history: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """The figures of all_results.json: the final (or best) evaluation, the last logged training loss, the
    evaluation before the first step as ``base_*`` (a fine-tune's base), ``extra`` (the metrics' summary: the run's
    mean throughput and MFU, the device, memory)."""
    last = next((h for h in reversed(history) if "train/loss" in h), {})
    before = next((h for h in history if h.get("step") == 0 and any(k.startswith("eval/") for k in h)), {})
    best = keeper.step is not None
    kept, saved = (keeper.step, keeper.metrics) if use_best else (steps, final)
    # the over-fit the saved weights carry: validation loss against the training loss of the logging window that
    # ended at or just before their step (dropout on in training, so the gap understates the memorisation)
    window = next((h for h in reversed(history) if "train/loss" in h and h.get("step", 0) <= (kept or 0)), None)
    gap = ({"train_loss_at_model_step": window["train/loss"], "val_train_gap": saved["val_loss"] - window["train/loss"]}
           if window is not None and isinstance(saved.get("val_loss"), float) else {})
    return {
        "steps": steps,
        f"{unit}s_seen": units_seen,
        "train_loss": last.get("train/loss"),
        **(keeper.metrics if use_best else final),
        **{f"base_{k.split('/', 1)[1]}": v for k, v in before.items() if k.startswith("eval/")},
        **({f"best_{keeper.metric}": keeper.value, "best_step": keeper.step} if best else {}),
        **({f"last_{k}": v for k, v in final.items()} if use_best else {}),
        "model_step": keeper.step if use_best else steps,
        **gap,
        **extra,
    }


FEW_VALIDATION_TOKENS = 1000
"""Below this many scored tokens a validation loss is mostly noise: which examples were held out moves it more than
the training does."""


def against_base(results: dict[str, Any]) -> str | None:
    """A warning where the weights a fine-tune saves validate no better than its base did before the first step
    (``base_val_loss``, ``final_results``), saying why that may be; None where they improved or nothing compares."""
    base, now, tokens = results.get("base_val_loss"), results.get("val_loss"), results.get("val_tokens")
    if not isinstance(base, float) or not isinstance(now, float) or now < base:
        return None
    if isinstance(tokens, int) and tokens < FEW_VALIDATION_TOKENS:
        why = (f"on {tokens:,} validation tokens the difference is mostly noise; give a validation split with more "
               "examples for a figure that means something")
    else:
        why = ("training fitted its examples at the held-out ones' expense; fewer steps or a lower learning rate, "
               "or --eval_steps N with --load_best_at_end true, keep better weights")
    return f"warning: validation loss {now:.4f} is not below the base model's {base:.4f} (before training): {why}"


def save_run(task, model: torch.nn.Module, ema: EMA | None, use_best: bool, output_dir: Path,
             results: dict[str, Any], settings: dict[str, Any], history: list[dict[str, Any]], log=print) -> None:
    """Write the model, all_results.json, history.json, the curves (sealed by a manifest) and the card (main
    process only)."""
    staging = output_dir / STAGING
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    with ema_weights(ema, enabled=not use_best):  # the best weights were evaluated (and saved) with EMA in place
        log(f"saving the model to {output_dir}")
        task.save_pretrained(model, staging)
        results.update(task.on_saved(model, output_dir, log) or {})  # into the caller's results too
    grid = results.get("sample_grid")
    if grid and (output_dir / grid).is_file():  # the picture the card shows is sealed (and pushed) with the model
        (staging / grid).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(output_dir / grid, staging / grid)
    results["settings"] = settings  # into the caller's results too: fit returns what all_results.json holds
    (staging / "all_results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False))
    (staging / "history.json").write_text(json.dumps(history))
    plot_history(history, staging / "training_curves.png", task.unit, log=lambda msg: None)
    install_model(staging, output_dir, step=results.get("steps"))
    if (output_dir / "training_curves.png").is_file():
        log(f"training curves: {output_dir / 'training_curves.png'}")
    if task.card:
        render_card(task.card, output_dir, log)


def install_model(staging: Path, output_dir: Path, **meta: Any) -> None:
    """Seal ``staging`` (hash its files into its manifest), then move its files into ``output_dir``, manifest last."""
    manifest = build_manifest(staging, "model", exclude=("README.md",), **meta)  # the card is re-rendered later
    for rel in manifest.files:
        with open(staging / rel, "rb") as fh:
            os.fsync(fh.fileno())
    write_manifest(staging, manifest)
    fsync_dir(staging)
    _move_staged(staging, output_dir, manifest)


def _move_staged(staging: Path, output_dir: Path, manifest) -> None:
    (output_dir / MANIFEST).unlink(missing_ok=True)  # until the new one is in place, the folder says "unsealed"
    card = ["README.md"] if (staging / "README.md").is_file() else []  # a library's card (peft): replaced later
    for rel in [*manifest.files, *card]:
        src, dst = staging / rel, output_dir / rel
        if not src.exists() and rel in manifest.files:  # moved before an interruption
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        os.replace(src, dst)
    for folder in {(output_dir / rel).parent for rel in manifest.files}:
        fsync_dir(folder)
    os.replace(staging / MANIFEST, output_dir / MANIFEST)
    fsync_dir(output_dir)
    shutil.rmtree(staging, ignore_errors=True)


def finish_interrupted_save(output_dir: Path, log=print) -> bool:
    """Finish a final save that a kill cut off while its files moved: ``output_dir`` has no manifest and the staging
    folder a sealed one. The moved and the still staged files are checked against that manifest before it is put in
    place; files that do not match leave the folder unsealed (``verify`` refuses it) and the staging folder is removed.
    Returns whether a save was finished."""
    staging = output_dir / STAGING
    if (output_dir / MANIFEST).is_file() or not (staging / MANIFEST).is_file():
        return False
    try:
        manifest = read_manifest(staging)
        check_inside(output_dir, manifest.files)
        _check_split(staging, output_dir, manifest)
    except IntegrityError as err:
        log(f"warning: an interrupted final save in {output_dir} cannot be finished ({err}); it stays unsealed")
        shutil.rmtree(staging, ignore_errors=True)
        return False
    _move_staged(staging, output_dir, manifest)
    log(f"finished the final save a kill interrupted in {output_dir} (step {manifest.meta.get('step')})")
    return True


def _check_split(staging: Path, output_dir: Path, manifest) -> None:
    """Each listed file, wherever it is now (still staged or moved), has the manifest's size and hash."""
    for rel, entry in manifest.files.items():
        path = staging / rel if (staging / rel).is_file() else output_dir / rel
        if path.is_symlink() or not path.is_file() or path.stat().st_size != entry.size or \
                sha256_file(path) != entry.sha256:
            raise IntegrityError(f"{rel} is missing or does not match its checksum")


def update_results(output_dir: str | Path, **fields: Any) -> dict[str, Any]:
    """Add ``fields`` to a finished run's all_results.json (atomically, and into its manifest)."""
    output_dir = Path(output_dir)
    path = output_dir / "all_results.json"
    results = {**json.loads(path.read_text()), **fields}
    atomic_write_json(path, results)
    if (output_dir / MANIFEST).is_file():
        update_manifest(output_dir, ["all_results.json"])
    return results


def plot_history(history: list[dict[str, Any]], path: Path, unit: str, log=print) -> None:
    """Loss (train and validation), learning rate, gradient norm and throughput against step, one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is a convenience
        return
    panels = [("loss", ["train/loss", "eval/val_loss"]), ("learning rate", ["train/lr"]),
              ("gradient norm", ["train/grad_norm"]), (f"{unit}/s", [f"train/{unit}_per_s"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            pts = [(h["step"], h[key]) for h in history if key in h]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key.startswith("eval") else None, label=key.split("/")[-1])
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(keys) > 1:
            ax.legend()
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    log(f"training curves: {path}")


def render_card(kind: str, output_dir: Path, log=print) -> None:
    try:
        render_model_card(kind, output_dir)
    except Exception as err:  # a card is documentation: never let it fail a finished run
        log(f"warning: model card not written ({err})")
