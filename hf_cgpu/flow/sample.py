"""``hf-cgpu sample DIR``: images from a saved FlowMatchPipeline, as a grid PNG and one PNG per image."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from diffusers.utils import logging as diffusers_logging
from PIL import Image
from safetensors import SafetensorError

from ..errors import MissingPathError, SettingsError, UserError, about, require_model
from ..hub.checks import check_hub_model
from ..integrity import atomic_dir, atomic_output
from ..settings import build_parser
from ..train.artifacts import STAGING, install_model
from ..verify import check_saved
from .guide import check_guide_used, safetensors_only, set_guidance_model, unreadable
from .pipeline_flow_match import FlowMatchPipeline, save_for_remote_code
from .sample_settings import SampleSettings, resolve_sampling
from .samplers import sampler_class


def image_grid(images: np.ndarray, rows: int) -> Image.Image:
    """(N, H, W, C) floats in [0, 1] -> one PIL image with ``rows`` rows and a 2-pixel white gutter."""
    n, h, w, c = images.shape
    cols = math.ceil(n / rows)
    grid = np.ones((rows * (h + 2) + 2, cols * (w + 2) + 2, c), dtype=np.float32)
    for i, img in enumerate(images):
        r, col = divmod(i, cols)
        grid[2 + r * (h + 2) : 2 + r * (h + 2) + h, 2 + col * (w + 2) : 2 + col * (w + 2) + w] = img
    return Image.fromarray((grid * 255).round().astype(np.uint8))


def parse_labels(text: str, class_names: list[str], num_classes: int | None) -> list[int] | None:
    """'3,5' or 'cat,dog' -> indices; empty -> None (unconditional / null class)."""
    if not text:
        return None
    if not num_classes:
        raise SettingsError("this pipeline is unconditional; drop --class_labels")
    out = []
    for item in text.split(","):
        item = item.strip()
        if item.isdigit() and int(item) < num_classes:
            out.append(int(item))
        elif item in class_names:
            out.append(class_names.index(item))
        else:
            raise SettingsError(f"unknown class {item!r}; use 0..{num_classes - 1} or one of {class_names}")
    return out


def saved_sampling(pipe, steps: int, scale: float, interval: str, fallback_scale: float) -> dict:
    """Steps, guidance scale and interval for ``pipe``'s call: 0 / empty take the folder's saved value
    (``fallback_scale`` where a folder recorded no scale)."""
    return resolve_sampling(pipe.config, bool(pipe.unet.config.num_classes),
                            pipe.guide_unet is not None or pipe.takes_guidance, steps, scale, interval, fallback_scale)


def check_guidance_interval(pipe, sampling: dict, flags: tuple[str, str] = ("--guidance_interval",
                                                                           "--num_inference_steps")) -> None:
    """One line when ``sampling``'s guidance interval (``saved_sampling``'s dict) holds none of the model calls of its
    steps with ``pipe``'s scheduler at a guidance scale other than 1: the guidance would change nothing."""
    try:
        pipe.check_guidance_interval(**sampling, flags=flags)
    except ValueError as err:
        raise SettingsError(str(err)) from None


def check_pipeline_folder(model_dir: str, verify: str = "auto", what: str = "") -> None:
    """A saved FlowMatchPipeline folder that passes its manifest (``verify.check_saved``), or a one-line error
    naming what it is instead."""
    require_model(model_dir, "pipeline folder")
    check_saved(model_dir, verify, what)
    d = Path(model_dir)
    if not d.is_dir():
        check_hub_model(model_dir, "pipeline", filename="model_index.json")
        return
    if (d / "model_index.json").is_file():
        return
    if (d / "config.json").is_file() or (d / "adapter_config.json").is_file():
        raise SettingsError(f"{model_dir} holds a language model, not a FlowMatchPipeline (no model_index.json); "
                            f"use `hf-cgpu generate {model_dir} PROMPT`")
    raise MissingPathError(f"{model_dir} holds no model_index.json; pass the output_dir of a flow run "
                           "(hf-cgpu train flow)")


def check_pipeline_files(folder: Path, what: str) -> None:
    """A pipeline folder that loads as it is: a FlowMatchPipeline whose components are hf_cgpu's or diffusers' own
    classes (a folder's code is never run) with safetensors weights (a pickle is never loaded); else one line."""
    try:
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        index = None
    if not isinstance(index, dict):
        raise SettingsError(f"{what}: model_index.json is not a JSON object; save the pipeline again")
    name = index.get("_class_name")
    if name != FlowMatchPipeline.__name__:
        shown = ".".join(map(str, name)) if isinstance(name, list) else name or "none"
        raise SettingsError(f"{what}: its model_index.json names the pipeline class {shown}, not FlowMatchPipeline, "
                            "and hf_cgpu never runs a folder's own code; pass the output_dir of a flow run (hf-cgpu "
                            "train flow)")
    ours = FlowMatchPipeline.__module__.split(".")[0]
    for component, entry in index.items():
        if component.startswith("_") or not (isinstance(entry, list) and len(entry) == 2
                                             and all(isinstance(x, str) for x in entry)):
            continue  # a saved setting (guidance_interval is two numbers) or an empty component
        if str(entry[0]).split(".")[0] not in (ours, "diffusers"):
            raise SettingsError(f"{what}: its {component} is {entry[0]}.{entry[1]}, code of the folder's own, which "
                                f"hf_cgpu never runs; pass a folder saved by hf_cgpu (hf-cgpu train flow, hf-cgpu "
                                "sample --save_pipeline)")
        safetensors_only(folder / component, f"{what}/{component}")


def load_pipeline_folder(model_dir: str, verify: str = "auto", what: str = "", checked: bool = False
                         ) -> FlowMatchPipeline:
    """The FlowMatchPipeline saved in ``model_dir`` (a folder or a Hub id), its manifest checked (``verify``, unless
    ``checked`` already), loaded quietly, without running any of the folder's code or unpickling any file; what does
    not load is one line naming the fix (``what`` names the folder there)."""
    if not checked:
        check_pipeline_folder(model_dir, verify, what)
    diffusers_logging.disable_progress_bar()  # "Loading pipeline components" would sit above a one-line error
    if Path(model_dir).is_dir():
        folder = Path(model_dir)
    else:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model_dir))
    check_pipeline_files(folder, model_dir)
    try:
        return FlowMatchPipeline.from_pretrained(folder, use_safetensors=True)
    except UserError:
        raise
    except (ImportError, AttributeError) as err:  # a component class hf_cgpu does not have
        raise SettingsError(f"{model_dir}: model_index.json names a class hf_cgpu does not have ({err}); save the "
                            "pipeline again with this hf_cgpu") from None
    except (OSError, SafetensorError) as err:
        raise unreadable(model_dir, err) from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser((SampleSettings,), prog="hf-cgpu sample", description=about(
        "Sample images from a saved FlowMatchPipeline: a grid PNG and one PNG per image.",
        "hf-cgpu sample runs/flow --class_labels cat,dog --num_images 16"))
    parser.add_argument("model_dir", help="output_dir of a flow run (a saved FlowMatchPipeline) or a Hub id")
    parser.usage = "%(prog)s MODEL_DIR [--SETTING VALUE ...]"
    ns = vars(parser.parse_args(argv))
    model_dir = ns.pop("model_dir")
    a = SampleSettings(**{k: v for k, v in ns.items() if v is not None})
    sampler = sampler_class(a.scheduler) if a.scheduler else None
    check_pipeline_folder(model_dir, a.verify)  # before the --save_pipeline checks, which name MODEL_DIR
    if a.save_pipeline and Path(a.save_pipeline).resolve() == Path(model_dir).resolve():
        raise SettingsError(f"--save_pipeline {a.save_pipeline} is MODEL_DIR itself; name a new folder (the run's "
                            "own stays as it was saved and sealed)")
    if a.save_pipeline and any((Path(a.save_pipeline) / f).exists() for f in ("all_results.json", "checkpoints")):
        raise SettingsError(f"--save_pipeline {a.save_pipeline} holds a training run, whose weights it would "
                            "replace; name a new folder")
    saved = Path(a.save_pipeline)
    if a.save_pipeline and saved.exists() and not (saved / "model_index.json").is_file() and (
            not saved.is_dir() or any(saved.iterdir())):
        raise SettingsError(f"--save_pipeline {a.save_pipeline} holds other files, which the saved pipeline would "
                            "replace; name a new or empty folder (an earlier saved pipeline is replaced whole)")
    pipe = load_pipeline_folder(model_dir, checked=True)
    a.check_guided(pipe.takes_guidance)
    set_guidance_model(pipe, a.guidance_model, model_dir, a.verify)
    if sampler is not None:
        pipe.scheduler = sampler.from_config(pipe.scheduler.config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe.to(device)
    sampling = a.sampling(pipe)
    check_guide_used(a.guidance_model, sampling["guidance_scale"])
    check_guidance_interval(pipe, sampling)
    defaults = saved_sampling(pipe, a.num_inference_steps, a.guidance_scale, a.guidance_interval, 2.5)
    if a.save_pipeline:  # the defaults as given, whether or not these images had labels
        check_guidance_interval(pipe, defaults)
    names_file = Path(model_dir) / "class_names.txt"
    names = names_file.read_text().split() if names_file.is_file() else []
    labels = parse_labels(a.class_labels, names, pipe.unet.config.num_classes)
    if labels is not None:
        labels = torch.tensor([labels[i % len(labels)] for i in range(a.num_images)])
    gen = torch.Generator(device=device).manual_seed(a.seed)
    out = pipe(batch_size=a.num_images, generator=gen, class_labels=labels, output_type="np", **sampling).images
    dest = Path(a.output_dir or Path(model_dir) / "samples_cli")
    dest.mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(out):  # each PNG replaces what is there (a link too) whole, never writes through it
        with atomic_output(dest / f"{i:04d}.png") as tmp:
            Image.fromarray((img * 255).round().astype(np.uint8)).save(tmp, format="PNG")
    rows = max(1, int(math.sqrt(a.num_images)))
    with atomic_output(dest / "grid.png") as tmp:
        image_grid(out, rows).save(tmp, format="PNG")
    print(f"wrote {len(out)} images and grid.png to {dest}")
    if a.save_pipeline:
        save_with_defaults(pipe, defaults, model_dir, a.save_pipeline)
        print(f"saved the pipeline with these sampling defaults to {a.save_pipeline}")
    return 0


def save_with_defaults(pipe, sampling: dict, model_dir: str, dest: str) -> None:
    """``pipe`` (its sampler and guide as set) saved to ``dest`` with ``sampling`` as its defaults, like a run's
    folder: loadable where hf_cgpu is not installed, with the run's class names, staged and sealed by its manifest
    as a run's final save is (``artifacts.install_model``: ordinary file modes, ``verify`` and ``push`` check it).
    Written into a new folder that then replaces ``dest`` whole, so no file of the save goes through a link left in
    ``dest``."""
    interval = sampling["guidance_interval"]
    pipe.register_to_config(num_inference_steps=sampling["num_inference_steps"],
                            guidance_scale=sampling["guidance_scale"],
                            guidance_interval=list(interval) if interval is not None else None)
    with atomic_dir(dest) as tmp:
        staging = tmp / STAGING
        save_for_remote_code(pipe, staging)
        names = Path(model_dir) / "class_names.txt"
        if names.is_file():
            shutil.copyfile(names, staging / "class_names.txt")
        install_model(staging, tmp)
