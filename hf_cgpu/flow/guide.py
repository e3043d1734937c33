"""The weaker model of autoguidance (Karras et al. 2024), found among what a run already has.

v = v_weak + w (v_strong - v_weak), both for the same class label (or both unconditional): guiding with a worse
version of the model itself keeps most of guidance's gain in fidelity without the loss of variety that contrasting
with the null class costs. The weak model is one the run already kept:

- ``raw``: the live (non-EMA) weights of the saved step, which a run with ``--ema_decay`` keeps in its last
  checkpoint (``checkpoints/step_N/model.safetensors``) while the folder holds the EMA;
- an earlier checkpoint, ``RUN/checkpoints/step_N`` (its EMA weights where it kept them, else its live ones), or one
  of its ``.safetensors`` files;
- another pipeline folder (its ``unet``) or a UNet folder (``config.json``) of the same shape and class count.

``FlowMatchPipeline.set_guidance_model`` puts it in place; saving the pipeline then writes it as the ``guide_unet``
component, so the folder samples the same way wherever it loads.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..errors import CheckpointError, MissingPathError, SettingsError, UserError
from ..train.checkpoint import list_checkpoints, read_trainer_state
from ..verify import check_saved

GUIDE_SOURCES = ("raw, a checkpoint folder (RUN/checkpoints/step_N) or one of its .safetensors files, a pipeline "
                 "folder or a UNet folder")
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Suffixes of pickled weights: never loaded (unpickling a file can run any code it holds)."""


def safetensors_only(folder: Path, what: str) -> None:
    """One line when ``folder`` holds weights only as pickles (``.bin``...), which diffusers would fall back to."""
    folder = Path(folder)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED)
    if pickled:
        raise SettingsError(f"{what} holds its weights only as a pickle ({pickled[0]}), which hf_cgpu never loads "
                            "(unpickling can run code); save them as safetensors (save_pretrained(..., "
                            "safe_serialization=True)) or pass another folder")


def unreadable(what: str, err: BaseException) -> CheckpointError:
    """The one-line error of weights that do not load (a file cut off or damaged), naming the loader's first line."""
    first = " ".join((str(err).strip().splitlines() or [type(err).__name__])[0].split())[:240]
    return CheckpointError(f"{what}: its weights cannot be read ({first}); the files are damaged or cut off (a copy "
                           "or save interrupted): copy or save the folder again, or pass another one")


def unet_from_folder(klass, folder: Path, what: str, **kwargs):
    """``klass.from_pretrained(folder)`` from safetensors only, every failure to read the weights one line."""
    safetensors_only(folder, what)
    try:
        return klass.from_pretrained(folder, use_safetensors=True, **kwargs)
    except UserError:
        raise
    except (OSError, SafetensorError) as err:
        raise unreadable(what, err) from None


def weight_variants(run_dir: Path) -> tuple[dict[str, Path | None], list[str]]:
    """{name: raw-weights file to load into the saved UNet, or None for the saved weights}, plus notes.

    A loop run (all_results.json) with ema_decay > 0 saved its EMA weights; its last checkpoint's model.safetensors
    holds the live weights of the same step. Without all_results.json (another script) the weights are "saved".
    """
    results = Path(run_dir) / "all_results.json"
    if not results.is_file():
        return {"saved": None}, []
    info = json.loads(results.read_text())
    if not info.get("settings", {}).get("ema_decay", 0):
        return {"raw": None}, []
    variants: dict[str, Path | None] = {"ema": None}
    ckpts = list_checkpoints(run_dir)
    if not ckpts or not (ckpts[-1] / "model.safetensors").is_file():
        return variants, ["raw weights unavailable: no checkpoint with model.safetensors in the run folder"]
    step = read_trainer_state(ckpts[-1]).get("step")
    if step != info.get("steps"):
        return variants, [f"raw weights skipped: last checkpoint is step {step}, the saved model step "
                          f"{info.get('steps')}"]
    variants["raw"] = ckpts[-1] / "model.safetensors"
    return variants, []


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors state dict with the wrappers' prefixes (DDP's ``module.``, torch.compile's) taken off."""
    return {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in load_file(str(path)).items()}


def copy_with_weights(model: torch.nn.Module, source: str | Path, flag: str = "--guidance_model") -> torch.nn.Module:
    """A copy of ``model`` holding the weights of ``source``: a checkpoint folder (its ``ema.safetensors`` where it
    has one, else its ``model.safetensors``) or a .safetensors file. Any model works (the 2D toy's MLP too)."""
    source = Path(source)
    if not source.exists():
        raise MissingPathError(f"{flag} {source} does not exist; pass {GUIDE_SOURCES}")
    if source.is_dir():
        safetensors_only(source, f"{flag} {source}")
        found = [source / f for f in ("ema.safetensors", "model.safetensors") if (source / f).is_file()]
        if not found:
            raise MissingPathError(f"{flag} {source} holds neither ema.safetensors nor model.safetensors; pass "
                                   f"{GUIDE_SOURCES}")
        source = found[0]
    try:
        weights = load_weights_file(source)
    except SafetensorError:
        raise SettingsError(f"{flag} {source} is not a safetensors weights file (or one cut off); pass "
                            f"{GUIDE_SOURCES}") from None
    weak = copy.deepcopy(model)
    try:
        weak.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[1 if "\n" in str(err).strip() else 0].strip()
        raise SettingsError(f"{flag} {source} does not fit this model ({first}); use a checkpoint of the same run "
                            "(same shape and class count)") from None
    return weak.eval().requires_grad_(False)


def guidance_model(spec: str, run_dir: str | Path, unet, verify: str = "auto") -> tuple[torch.nn.Module, str]:
    """(the weak UNet, its name for ``config.guidance_model``) of ``spec`` (see the module docstring); ``run_dir`` is
    the pipeline folder ``raw`` refers to, ``unet`` the pipeline's own UNet (the weak one gets its architecture).
    The folder it is read from passes its manifest first (``verify.check_saved`` by ``verify``)."""
    if spec == "raw":
        variants, notes = weight_variants(Path(run_dir))
        if not variants.get("raw"):
            why = (notes[0] if notes else f"{run_dir} saved its live weights, not an EMA: raw is the model itself"
                   if "raw" in variants else f"{run_dir} is no run folder (no all_results.json)")
            raise SettingsError(f"--guidance_model raw: {why}; pass an earlier checkpoint (RUN/checkpoints/step_N)")
        check_saved(variants["raw"], verify, "--guidance_model raw")
        return copy_with_weights(unet, variants["raw"]), f"raw ({variants['raw'].parent.name})"
    path = Path(spec).expanduser()
    if not path.exists():
        raise MissingPathError(f"--guidance_model {spec} does not exist; pass {GUIDE_SOURCES}")
    check_saved(path, verify, "--guidance_model")
    folder = path / "unet" if (path / "model_index.json").is_file() else path
    if folder.is_dir() and (folder / "config.json").is_file():
        check_unet_config(folder / "config.json", type(unet).__name__, f"--guidance_model {spec}")
        # loaded in the UNet's dtype: a later .to(dtype) makes diffusers warn, above any one-line error
        weak = unet_from_folder(type(unet), folder, f"--guidance_model {spec}", dtype=unet.dtype)
        return weak.eval().requires_grad_(False).to(unet.device), str(spec)
    return copy_with_weights(unet, path), str(spec)


def check_unet_config(config: Path, class_name: str, what: str) -> None:
    """One line when ``config`` is not a ``class_name`` config (a language model's config.json, another UNet's)."""
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise SettingsError(f"{what}: {config} is not JSON; pass {GUIDE_SOURCES}") from None
    found = data.get("_class_name") if isinstance(data, dict) else None
    if found != class_name:
        kind = (f"a language model ({data['model_type']})" if isinstance(data, dict) and data.get("model_type")
                else f"a {found}" if found else "no diffusers model")
        raise SettingsError(f"{what} holds {kind}, not a {class_name}; pass {GUIDE_SOURCES} of a flow run")


def set_guidance_model(pipe, spec: str, run_dir: str | Path, verify: str = "auto") -> None:
    """Autoguidance for ``pipe`` with ``spec`` ('' leaves the pipeline as loaded, 'none' turns a saved guide off);
    a guide that does not match the UNet, or whose folder fails its manifest (``verify``), is a one-line error."""
    if not spec:
        return
    if spec == "none":
        pipe.set_guidance_model(None)
        return
    weak, name = guidance_model(spec, run_dir, pipe.unet, verify)
    try:
        pipe.set_guidance_model(weak, name)
    except ValueError as err:
        raise SettingsError(f"--guidance_model {spec}: {err}") from None


def check_guide_used(spec: str, scale: float) -> None:
    """A --guidance_model given for a call at guidance scale 1 (a distilled folder's saved scale: its guidance is
    baked in) would guide nothing at the cost of a second network call each step: one line naming the fix."""
    if spec not in ("", "none") and scale == 1.0:
        raise SettingsError(f"--guidance_model {spec} does nothing at guidance scale 1 (the folder's saved scale or "
                            "yours); pass --guidance_scale, e.g. 2, or drop --guidance_model")


__all__ = ["GUIDE_SOURCES", "PICKLED", "check_guide_used", "check_unet_config", "copy_with_weights", "guidance_model",
           "load_weights_file", "safetensors_only", "set_guidance_model", "unet_from_folder", "unreadable",
           "weight_variants"]
