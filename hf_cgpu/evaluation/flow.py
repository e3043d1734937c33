"""``hf-cgpu eval RUN_DIR --classifier DIR``: score a saved FlowMatchPipeline in a CIFAR classifier's features.

    hf-cgpu eval runs/flow --classifier runs/classifier --dataset ../shared/data/cifar10 --num_images 10000 \
        --scheduler heun --num_inference_steps 10 --guidance_scale 1.5 --output_json runs/flow/eval.json
    hf-cgpu eval runs/flow --classifier runs/classifier --dataset ../shared/data/cifar10 --sweep

Reports the Fréchet distance (FD) and improved precision/recall (k-NN, Kynkäänniemi et al.) against the real images
of ``--split`` (default test: images neither the classifier nor the generator trained on), the class histogram of
the generated images, how often the classifier sees the requested class, the network evaluations per image
(Euler N steps = N, Heun = 2N - 1, doubled under guidance, counted by a hook on the UNet) and images/s.
Class labels are balanced (image i asks for class i mod K); image i's noise comes from its own generator seeded by
(seed, i), so results do not depend on the batch size and every sampler setting of a sweep starts from the same
noise. Real features are cached (classifier hash + data fingerprint), so a sweep computes them once.

``--sweep`` evaluates schedulers x steps x guidance scales, for the EMA and the raw weights when the run folder holds
both (a loop run with --ema_decay saves EMA weights and keeps the raw ones in its last checkpoint), and writes
sweep.json, sweep.md and sweep.png (FD against evaluations per image, a line per weights/sampler/guidance).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..data.images import cache_file, load_image_dataset
from ..errors import about, run_main
from ..flow.guide import check_guide_used, load_weights_file, set_guidance_model, weight_variants
from ..flow.pipeline_flow_match import FlowMatchPipeline
from ..integrity import atomic_output, atomic_write_text
from ..flow.sample import check_guidance_interval, image_grid, load_pipeline_folder, saved_sampling
from ..flow.samplers import (SAMPLERS, check_sampler, format_interval, parse_interval, sampler_class, sampler_names,
                             steps_within)
from ..options import VERIFY_MODES, check_choice
from ..paths import feature_cache, image_cache
from ..settings import SettingsError, build_parser
from ..verify import check_saved
from .classifier import file_hash, load_classifier
from .images import (class_statistics, feature_statistics, frechet_distance, image_features, inception_fid,
                     kth_neighbour_radii, precision_recall)


@dataclass
class ImageEvalSettings:
    """What to generate, what to compare it with, and where to write the results."""

    classifier: str = ""
    """Folder with classifier.safetensors + classifier_config.json (recipes/train_classifier.py --preset cifar10)."""
    dataset: str = "uoft-cs/cifar10"
    """Real images: a folder with {split}.parquet (e.g. ../shared/data/cifar10), any folder datasets reads, a Hub id."""
    split: str = "test"
    """Split of the real images (test: seen by neither the classifier nor the generator in training)."""
    image_column: str = "img"
    """Column holding the real images."""
    label_column: str = "label"
    """Column holding the real labels (for the classifier's own accuracy on them)."""
    real_limit: int = 0
    """Use only the first this many real images (0 = the whole split)."""
    num_images: int = 10000
    """Images to generate per setting."""
    scheduler: str = field(default="", metadata={"choices": sampler_names})
    """Sampler (hf_cgpu.flow.samplers): euler (N network calls for N steps), heun (2N - 1), or another registered
    one; empty = the one the pipeline was saved with."""
    num_inference_steps: int = 0
    """Solver steps N; 0 = the pipeline's saved default (1 or 2 for a distilled pipeline)."""
    guidance_scale: float = 0.0
    """Guidance scale (1 = none, one network call per evaluation): classifier-free, or autoguidance with a
    --guidance_model (unconditional models need one, or 1); a run distilled with --guidance_range is told it (one
    call, within its range); 0 = the pipeline's saved default (1.5 for a folder that saved none)."""
    guidance_interval: str = ""
    """Guidance only where t (0 = noise, 1 = data) lies in LO:HI, e.g. 0.15:0.8 (one network call instead of two
    elsewhere); full = every step; empty = the pipeline's saved interval."""
    guidance_model: str = ""
    """Autoguidance: guide with this weaker model, for the same class, instead of the null class: raw (the run's
    live weights against its EMA), a checkpoint folder (RUN/checkpoints/step_N) or one of its .safetensors files,
    a pipeline or UNet folder; none = off; empty = what the folder saved (off unless it saved one). A sweep with raw
    scores the EMA weights only; one evaluation needs a guidance scale other than 1."""
    weights: str = ""
    """Which weights: empty = what the folder's pipeline holds (EMA when the run kept one), ema, or raw (the last
    checkpoint's live weights)."""
    batch_size: int = 500
    """Images per sampling batch."""
    seed: int = 0
    """Seed of the noise (image i uses its own generator seeded from seed and i)."""
    nearest_k: int = 3
    """k of the k-nearest-neighbour balls of precision and recall."""
    mixed_precision: str = "auto"
    """UNet arithmetic: auto (bf16 autocast on a GPU that has it, else fp32), bf16 or no; the ODE state stays fp32."""
    output_dir: str = ""
    """Where grids, cached-feature pointers and sweep files go (default RUN_DIR/eval)."""
    output_json: str = ""
    """The JSON of a single evaluation (default OUTPUT_DIR/eval.json)."""
    grid_images: int = 100
    """Generated images in each sample grid PNG (one column per class for a class-conditional model)."""
    sweep: bool = False
    """Evaluate every combination of sweep_schedulers x sweep_steps x sweep_guidance (x EMA/raw weights)."""
    sweep_schedulers: str = "euler,heun"
    """Comma-separated schedulers of the sweep."""
    sweep_steps: str = "4,8,16"
    """Comma-separated solver steps of the sweep."""
    sweep_evaluations: str = ""
    """Comma-separated network evaluations per image (e.g. 5,10,20,50) instead of --sweep_steps: each sampler and
    guidance scale gets the most steps whose evaluations fit (counted from the sampler; a guided call twice)."""
    sweep_guidance: str = "1,1.5,2,3"
    """Comma-separated guidance scales of the sweep (only 1 for an unconditional model)."""
    sweep_guidance_intervals: str = "full"
    """Comma-separated guidance intervals of the sweep, each full or LO:HI (e.g. full,0.15:0.8); a scale of 1
    is run once, whatever the interval."""
    inception_weights: str = ""
    """Inception-v3 weights file (torch-fidelity's .pth) for the standard FID, computed only with torchmetrics and
    torch-fidelity installed; empty = skip with a note."""
    cache_dir: str = ""
    """Cache of real-image features (default $HF_CGPU_CACHE/features, else ~/.cache/hf_cgpu/features)."""
    progress: bool = True
    """Show a progress bar."""
    verify: str = field(default="auto", metadata={"choices": lambda: VERIFY_MODES})
    """What of RUN_DIR's (the classifier's, a guidance model's) manifest.json is checked before it is read: auto (the
    sizes; the SHA-256 too up to 512 MiB), sizes, full, or off (a folder edited by hand); see docs/outputs.md."""

    def __post_init__(self) -> None:
        check_choice("verify", self.verify, VERIFY_MODES)
        if self.scheduler:
            check_sampler(self.scheduler)
        if self.guidance_interval:
            parse_interval(self.guidance_interval)
        if self.weights not in ("", "ema", "raw"):
            raise SettingsError(f"weights={self.weights!r}; use ema, raw or leave it empty")
        if self.mixed_precision not in ("auto", "bf16", "no"):
            raise SettingsError(f"mixed_precision={self.mixed_precision!r}; use auto, bf16 or no")
        for name in ("num_images", "batch_size", "nearest_k"):
            if getattr(self, name) < 1:
                raise SettingsError(f"--{name} must be >= 1 (got {getattr(self, name)})")
        if self.num_images <= self.nearest_k:
            raise SettingsError(f"--num_images {self.num_images} must exceed --nearest_k {self.nearest_k}")
        if self.num_inference_steps < 0 or self.guidance_scale < 0:
            raise SettingsError("--num_inference_steps and --guidance_scale take a value >= 1, or 0: the saved default")
        self.grid = _sweep_grid(self)


Setting = tuple[str, int, float, "tuple[float, float] | None"]
"""One sampler setting of a sweep: (scheduler, steps, guidance scale, guidance interval or None = every step)."""


def _sweep_grid(s: ImageEvalSettings) -> list[Setting]:
    intervals = [parse_interval(x.strip(), "--sweep_guidance_intervals")
                 for x in (s.sweep_guidance_intervals or "full").split(",")]
    try:
        schedulers = [x.strip() for x in s.sweep_schedulers.split(",") if x.strip()]
        steps = [int(x) for x in s.sweep_steps.split(",") if x.strip()]
        budgets = [int(x) for x in s.sweep_evaluations.split(",") if x.strip()]
        scales = [float(x) for x in s.sweep_guidance.split(",") if x.strip()]
    except ValueError:
        raise SettingsError("sweep lists are comma-separated, e.g. --sweep_steps 4,8,16 --sweep_guidance 1,1.5,2")
    if not schedulers or not steps or not scales or set(schedulers) - set(SAMPLERS) or min(steps) < 1:
        raise SettingsError(f"--sweep_schedulers takes {'/'.join(SAMPLERS)}, --sweep_steps positive integers, none "
                            "empty")
    if budgets and min(budgets) < 1:
        raise SettingsError("--sweep_evaluations takes positive integers, e.g. 5,10,20,50")
    settings = [(c, i if c != 1 else None) for c in scales for i in intervals]  # unguided: one row, not one per interval
    if not budgets:
        grid = [(a, b, c, i) for a in schedulers for b in steps for c, i in settings]
    else:
        grid = [(a, steps_within(e, a, c, i), c, i) for a in schedulers for e in budgets for c, i in settings]
    return list(dict.fromkeys(grid))  # a small budget can give two scales' rows the same steps: each once


# ----------------------------------------------------------------------------- generation
@contextmanager
def _unet_hooks(unet, counter: list[int], fp32_output: bool):
    """Count the rows every UNet call sees (a guided call has 2B rows) and, under autocast, return fp32 velocities
    so the scheduler's ODE state is not rounded to bf16 each step."""

    def count(module, args, kwargs):
        sample = args[0] if args else kwargs["sample"]
        counter[0] += sample.shape[0]

    def upcast(module, args, output):
        return type(output)(sample=output.sample.float())

    handles = [unet.register_forward_pre_hook(count, with_kwargs=True)]
    if fp32_output:
        handles.append(unet.register_forward_hook(upcast))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _use_bf16(mixed_precision: str, device: torch.device) -> bool:
    if mixed_precision == "no" or device.type != "cuda":
        return False
    return mixed_precision == "bf16" or torch.cuda.is_bf16_supported()


def sampler_pipeline(pipe, scheduler: str):
    """A pipeline of ``pipe``'s UNet and guide with the sampler ``scheduler`` (empty, or the saved one's name
    (``saved_sampler_name``): the saved sampler); ``pipe`` itself is not changed."""
    own = type(pipe.scheduler)
    klass = own if scheduler in ("", own.__name__) else sampler_class(scheduler)
    sampler = FlowMatchPipeline(unet=pipe.unet, scheduler=klass.from_config(pipe.scheduler.config),
                                guide_unet=pipe.guide_unet, guidance_model=pipe.config.get("guidance_model"),
                                guidance_range=pipe.config.get("guidance_range"))
    sampler.set_progress_bar_config(disable=True)
    return sampler


def check_guidance_reaches(pipe, scheduler: str, steps: int, scale: float, interval, sweep: bool = False) -> None:
    """One line when ``interval`` holds none of the model calls of ``steps`` steps of ``scheduler`` at guidance
    ``scale`` (guidance would change nothing), before any image is drawn."""
    flags = ("--sweep_guidance_intervals", "--sweep_steps") if sweep else ("--guidance_interval",
                                                                           "--num_inference_steps")
    check_guidance_interval(sampler_pipeline(pipe, scheduler), {"num_inference_steps": steps, "guidance_scale": scale,
                                                                "guidance_interval": interval}, flags)


@torch.no_grad()
def generate_images(pipe, num_images: int, scheduler: str = "heun", num_inference_steps: int = 10,
                    guidance_scale: float = 1.0, batch_size: int = 500, seed: int = 0, mixed_precision: str = "no",
                    progress: bool = True, desc: str = "",
                    guidance_interval: tuple[float, float] | None = None) -> dict:
    """Sample ``num_images`` (balanced class labels when the UNet is class-conditional) as (N, 3, H, W) uint8.

    Returns images, labels (None for an unconditional UNet), nfe_per_image (UNet rows per image, measured),
    seconds and images_per_s. ``pipe`` is not changed: the scheduler is swapped in a copy. Guidance applies to the
    calls whose t lies in ``guidance_interval`` (None: every call).
    """
    from tqdm.auto import tqdm

    sampler = sampler_pipeline(pipe, scheduler)
    guide = pipe.guide_unet
    guided = guide is not None or pipe.takes_guidance  # a UNet told the guidance scale needs no labels for it
    device = pipe.unet.device
    num_classes = pipe.unet.config.num_classes
    if not num_classes and not guided and guidance_scale != 1.0:
        raise SettingsError("this pipeline is unconditional; pass --guidance_scale 1 (or --sweep_guidance 1), or "
                            "--guidance_model for autoguidance")
    labels = torch.arange(num_images) % num_classes if num_classes else None
    bf16 = _use_bf16(mixed_precision, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext()
    rows, chunks = [0], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    bar = tqdm(total=num_images, desc=desc or f"{scheduler} {num_inference_steps} w={guidance_scale:g}",
               unit="img", disable=not progress, dynamic_ncols=True)
    sync()
    t0 = time.perf_counter()
    guide_hooks = _unet_hooks(guide, rows, fp32_output=bf16) if guide is not None else nullcontext()
    with _unet_hooks(pipe.unet, rows, fp32_output=bf16), guide_hooks, autocast:
        for start in range(0, num_images, batch_size):
            n = min(batch_size, num_images - start)
            gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(start, start + n)]
            out = sampler(batch_size=n, num_inference_steps=num_inference_steps, generator=gens,
                          class_labels=labels[start : start + n] if labels is not None else None,
                          guidance_scale=guidance_scale if labels is not None or guided else 1.0,
                          output_type="pt",
                          guidance_interval=guidance_interval).images
            chunks.append((out.float() * 255).round().to(torch.uint8).cpu())  # quantised like a saved PNG
            bar.update(n)
    sync()
    seconds = time.perf_counter() - t0
    bar.close()
    return {"images": torch.cat(chunks), "labels": labels, "nfe_per_image": rows[0] / num_images,
            "seconds": seconds, "images_per_s": num_images / seconds}


def evaluate_pipeline(pipe, classifier, real: dict, num_images: int = 10000, scheduler: str = "heun",
                      num_inference_steps: int = 10, guidance_scale: float = 1.5, batch_size: int = 500,
                      seed: int = 0, nearest_k: int = 3, mixed_precision: str = "no", progress: bool = True,
                      grid_path: str | Path | None = None, grid_images: int = 100, return_images: bool = False,
                      guidance_interval: tuple[float, float] | None = None) -> dict:
    """Generate with one sampler setting and score it against ``real`` (``real_reference``'s dict).

    Returns fd, precision, recall, class_histogram, class_share_max/min/uniform, label_accuracy (None when
    unconditional), nfe_per_image, images_per_s, seconds, grid (the PNG path) and the settings used.
    """
    gen = generate_images(pipe, num_images, scheduler, num_inference_steps, guidance_scale, batch_size, seed,
                          mixed_precision, progress, guidance_interval=guidance_interval)
    feats, logits = image_features(classifier, gen["images"], batch_size=batch_size)
    device = next(classifier.parameters()).device
    key = f"radii_{nearest_k}"
    if key not in real:  # the real k-NN balls, once per process (a sweep reuses them)
        real[key] = kth_neighbour_radii(real["features"].to(device, torch.float32), nearest_k)
    precision, recall = precision_recall(real["features"], feats, k=nearest_k, device=device, real_radii=real[key])
    out = {
        "scheduler": scheduler, "num_inference_steps": num_inference_steps, "guidance_scale": guidance_scale,
        "guidance_interval": format_interval(guidance_interval),
        "guidance_model": pipe.config.get("guidance_model") if pipe.guide_unet is not None and guidance_scale != 1
        else None,
        "num_images": num_images, "seed": seed,
        "fd": frechet_distance(real["mu"], real["sigma"], *feature_statistics(feats)),
        "precision": precision, "recall": recall, "nearest_k": nearest_k,
        **class_statistics(logits.argmax(1), logits.shape[1], gen["labels"]),
        "nfe_per_image": gen["nfe_per_image"], "images_per_s": gen["images_per_s"], "seconds": gen["seconds"],
    }
    if grid_path is not None:
        out["grid"] = str(save_grid(gen["images"][:grid_images], grid_path, pipe.unet.config.num_classes))
    if return_images:
        out["images"] = gen["images"]
    return out


def save_grid(images_uint8: torch.Tensor, path: str | Path, num_classes: int | None) -> Path:
    """(N, 3, H, W) uint8 -> PNG; with balanced labels and K columns each column is one class."""
    n = len(images_uint8)
    cols = num_classes or max(1, int(math.sqrt(n)))
    path = Path(path)
    with atomic_output(path) as tmp:  # replaces what is there (a link too) whole, never writes through it
        image_grid(images_uint8.permute(0, 2, 3, 1).float().numpy() / 255.0, max(1, math.ceil(n / cols))).save(
            tmp, format="PNG")
    return path


# ----------------------------------------------------------------------------- real reference
def _looks_local(source: str) -> bool:
    return source.startswith((".", "/", "~")) or source.count("/") != 1


def load_real_images(s: ImageEvalSettings):
    """The real split as an ImageDataset (uint8), with one-line errors for a wrong path, split or column."""
    if _looks_local(s.dataset) and not Path(s.dataset).expanduser().exists():
        raise SettingsError(f"dataset {s.dataset} not found; pass --dataset a folder holding {s.split}.parquet "
                            "(e.g. ../shared/data/cifar10) or a Hub id such as uoft-cs/cifar10")
    try:
        return load_image_dataset(str(Path(s.dataset).expanduser()) if _looks_local(s.dataset) else s.dataset,
                                  split=s.split, image_column=s.image_column, label_column=s.label_column,
                                  limit=s.real_limit or None)
    except (SettingsError, FileNotFoundError):
        raise
    except Exception as err:  # datasets' errors are long and varied; the user needs the first line and the fix
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise SettingsError(f"cannot read split {s.split!r} of {s.dataset} ({first}); check --dataset and --split")


def real_reference(classifier, classifier_dir: str | Path, s: ImageEvalSettings, log=print) -> dict:
    """Features, mean and covariance of the real split in the classifier's space, cached on disk.

    The cache key is the classifier's file hash plus the decoded-image cache key of the split (source files'
    sizes and mtimes, split, columns, limit), so new weights or edited data recompute it.
    """
    from safetensors.torch import load_file, save_file

    source = str(Path(s.dataset).expanduser()) if _looks_local(s.dataset) else s.dataset
    data_key = cache_file(source, s.split, s.image_column, s.label_column, 32, s.real_limit or None,
                          image_cache()).name
    clf_hash = file_hash(classifier_dir)
    digest = hashlib.sha256(f"{clf_hash}|{data_key}".encode()).hexdigest()[:16]
    path = Path(s.cache_dir or feature_cache()) / f"{s.split}-{clf_hash}-{digest}.safetensors"
    if path.is_file():
        t = load_file(str(path))
        meta = json.loads(path.with_suffix(".json").read_text())
        log(f"real features: {path} (cached)")
        return {**t, **meta, "cache": str(path), "cached": True}
    data = load_real_images(s)
    feats, logits = image_features(classifier, data.images, batch_size=s.batch_size)
    mu, sigma = feature_statistics(feats)
    accuracy = float((logits.argmax(1) == data.labels).double().mean()) if data.labels is not None else None
    meta = {"num_real": len(feats), "classifier_accuracy": accuracy, "classifier_hash": clf_hash,
            "data_key": data_key, "split": s.split}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.safetensors")
    save_file({"features": feats.contiguous(), "mu": mu, "sigma": sigma}, str(tmp))
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    tmp.replace(path)
    log(f"real features: {len(feats)} images of {s.split}, classifier accuracy {accuracy}; cached in {path}")
    return {"features": feats, "mu": mu, "sigma": sigma, **meta, "cache": str(path), "cached": False}


# ----------------------------------------------------------------------------- weights in a run folder
WEAK_JUDGE = 0.8
"""Held-out accuracy below which the classifier's features are too poor a judge to trust an FD from them."""


def weak_judge_warning(classifier_dir: str | Path, measured: float | None) -> str | None:
    """One line when the classifier is a weak judge: its held-out accuracy (its run's ``all_results.json``, else
    the one measured on the real split here) is below ``WEAK_JUDGE``; None otherwise."""
    results = Path(classifier_dir) / "all_results.json"
    recorded = json.loads(results.read_text()).get("accuracy") if results.is_file() else None
    accuracy, where = (recorded, str(results)) if recorded is not None else (measured, "on the real images here")
    if accuracy is None or accuracy >= WEAK_JUDGE:
        return None
    return (f"warning: the classifier is {accuracy:.0%} accurate on held-out images ({where}), a weak judge: its FD "
            f"and label accuracy say little; train a better one with hf-cgpu train classifier --preset cifar10 "
            f"--dataset DATA --output_dir DIR on a GPU and pass --classifier DIR")


def load_pipeline(run_dir: Path, raw_weights: Path | None, device: torch.device, guidance_model: str = "",
                  verify: str = "auto"):
    """The folder's pipeline on ``device``, with ``raw_weights`` in its UNet when given and the autoguidance model
    ``guidance_model`` (``hf_cgpu.flow.guide``; '' = as saved, none = off), whose folder passes its manifest
    (``verify``)."""
    pipe = load_pipeline_folder(str(run_dir), verify)
    set_guidance_model(pipe, guidance_model, run_dir, verify)  # before the raw weights: the guide copies the saved UNet
    if raw_weights is not None:
        pipe.unet.load_state_dict(load_weights_file(raw_weights), strict=True)
    pipe.to(device)
    for unet in (pipe.unet, pipe.guide_unet):
        if unet is not None and device.type == "cuda":
            unet.to(memory_format=torch.channels_last)
    pipe.unet.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ----------------------------------------------------------------------------- sweep outputs
def write_sweep(rows: list[dict], out_dir: Path, plot: bool = True) -> list[Path]:
    """sweep.json, sweep.md (a table) and, with matplotlib installed, sweep.png (``plot_sweep``)."""
    keys = ["weights", "scheduler", "num_inference_steps", "guidance_scale", "guidance_interval", "guidance_model",
            "nfe_per_image", "fd", "precision",
            "recall", "label_accuracy", "class_share_min", "class_share_max", "class_histogram", "images_per_s"]
    atomic_write_text(out_dir / "sweep.json", json.dumps(rows, indent=1))

    def cell(v):
        if isinstance(v, list):  # the class histogram: counts per class, in class order
            return "/".join(map(str, v))
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    atomic_write_text(out_dir / "sweep.md", "\n".join(lines) + "\n")
    written = [out_dir / "sweep.json", out_dir / "sweep.md"]
    if plot and plot_sweep(out_dir / "sweep.json") is not None:
        written.append(out_dir / "sweep.png")
    return written


def plot_sweep(sweep_json: str | Path) -> Path | None:
    """sweep.png beside ``sweep_json``: FD against network evaluations per image, a line per weights/sampler/guidance
    (raw weights dashed). None when matplotlib is missing (plot later: ``plot_sweep("DIR/sweep.json")``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sweep_json = Path(sweep_json)
    rows = json.loads(sweep_json.read_text())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines_of: dict[tuple, list[dict]] = {}
    for r in rows:
        lines_of.setdefault((r["weights"], r["scheduler"], r["guidance_scale"], r.get("guidance_interval", "full")),
                            []).append(r)
    for (weights, sched, scale, interval), pts in sorted(lines_of.items()):
        pts = sorted(pts, key=lambda r: r["nfe_per_image"])
        ax.plot([p["nfe_per_image"] for p in pts], [p["fd"] for p in pts], marker="o",
                linestyle="-" if weights != "raw" else "--",
                label=f"{weights} {sched} w={scale:g}" + (f" t in {interval}" if interval != "full" else ""))
    ax.set_xscale("log")
    ax.set_xlabel("network evaluations per image")
    ax.set_ylabel("Fréchet distance (classifier features)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = sweep_json.with_name("sweep.png")
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- command line
def saved_sampler_name(pipe) -> str:
    """The registered name of the pipeline's scheduler class (its class name where none is registered under it)."""
    return next((n for n in SAMPLERS if sampler_class(n) is type(pipe.scheduler)), type(pipe.scheduler).__name__)


def grid_name(weights: str, sched: str, steps: int, scale: float, interval) -> str:
    suffix = "" if interval is None else f"_t{interval[0]:g}-{interval[1]:g}"
    return f"grid_{weights}_{sched}{steps}_w{scale:g}{suffix}.png"


IMAGE_MODE = ("Score a saved FlowMatchPipeline (a flow run's output_dir) in a CIFAR classifier's features: Fréchet "
              "distance, precision/recall, class histogram and label accuracy, or a sweep of samplers and steps.")


def parser():
    """The image mode's flags (``hf-cgpu eval RUN_DIR --classifier DIR``)."""
    p = build_parser((ImageEvalSettings,), prog="hf-cgpu eval", description=about(
        IMAGE_MODE, "hf-cgpu eval runs/flow --classifier runs/classifier --dataset ../shared/data/cifar10",
        "hf-cgpu eval runs/flow --classifier runs/classifier --dataset ../shared/data/cifar10 --sweep",
        more=__doc__.split("\n\n", 2)[2]))
    p.usage = "%(prog)s RUN_DIR --classifier DIR [--SETTING VALUE ...]"
    p.add_argument("run_dir", help="folder of a saved FlowMatchPipeline (model_index.json)")
    return p


def parse(argv: list[str]) -> tuple[Path, ImageEvalSettings]:
    ns = vars(parser().parse_args(argv))
    run_dir = Path(ns.pop("run_dir"))
    return run_dir, ImageEvalSettings(**{k: v for k, v in ns.items() if v is not None})


def report_line(row: dict) -> str:
    """One evaluation as a line: the sampler, its guidance and guide, FD, precision, recall, label accuracy, the class
    histogram of the generated images and the network evaluations each image took."""
    acc = "-" if row["label_accuracy"] is None else f"{row['label_accuracy']:.3f}"
    guide = f" guided by {row['guidance_model']}" if row["guidance_model"] else ""
    return (f"{row['weights']} {row['scheduler']} {row['num_inference_steps']} steps w={row['guidance_scale']:g} t in "
            f"{row['guidance_interval']}{guide}: FD {row['fd']:.3f} precision {row['precision']:.3f} recall "
            f"{row['recall']:.3f} label accuracy {acc} classes {'/'.join(map(str, row['class_histogram']))} "
            f"({row['nfe_per_image']:g} evaluations/image, {row['images_per_s']:.0f} img/s)")


def weights_to_score(run_dir: Path, s: ImageEvalSettings) -> tuple[dict[str, Path | None], list[str]]:
    """The weight variants to evaluate ({name: raw-weights file or None}) and notes: the one --weights names, else
    every variant for a sweep and the first for one evaluation; never the raw weights guided by themselves (with
    --guidance_model raw the guide and the model would be one network: no guidance at twice the cost)."""
    variants, notes = weight_variants(run_dir)
    if s.weights and s.weights not in variants:
        raise SettingsError(f"--weights {s.weights}: this folder has {', '.join(variants)}; drop --weights or pick one")
    if s.guidance_model == "raw" and s.weights == "raw":
        raise SettingsError("--weights raw with --guidance_model raw guides the raw weights by themselves; use "
                            "--weights ema, or an earlier checkpoint (RUN/checkpoints/step_N) as the guide")
    if s.weights:
        return {s.weights: variants[s.weights]}, notes
    if s.guidance_model == "raw" and variants.get("raw") is not None:  # None: no EMA, the guide is refused later
        del variants["raw"]
        notes.append("raw weights not scored: they are the guide (--guidance_model raw)")
    if not s.sweep:
        first = next(iter(variants))
        variants = {first: variants[first]}
    return variants, notes


def sampler_settings(pipe, s: ImageEvalSettings) -> list[Setting]:
    """The sampler settings to evaluate: the one of the flags (0 and empty resolved from the folder's saved
    defaults), or the sweep's grid (unguided only for an unconditional model without a guide); each refused in one
    line where its guidance would change nothing."""
    if not s.sweep:
        kw = saved_sampling(pipe, s.num_inference_steps, s.guidance_scale, s.guidance_interval, fallback_scale=1.5)
        check_guide_used(s.guidance_model, kw["guidance_scale"])
        grid = [(s.scheduler or saved_sampler_name(pipe), kw["num_inference_steps"], kw["guidance_scale"],
                 kw["guidance_interval"])]
    elif bool(pipe.unet.config.num_classes) or pipe.guide_unet is not None or pipe.takes_guidance:  # no class needed
        grid = s.grid
    else:
        grid = list(dict.fromkeys((a, b, 1.0, None) for a, b, _, _ in s.grid))
    for sched, steps, scale, interval in grid:
        check_guidance_reaches(pipe, sched, steps, scale, interval, sweep=s.sweep)
    return grid


def _main(argv: list[str] | None) -> int:
    run_dir, s = parse(list(argv or []))
    check_saved(run_dir, s.verify)
    if not (run_dir / "model_index.json").is_file():
        raise SettingsError(f"{run_dir} holds no model_index.json; pass the output_dir of recipes/train_flow.py")
    if not s.classifier:
        raise SettingsError("pass --classifier DIR (train one: python recipes/train_classifier.py --preset cifar10)")
    if s.inception_weights and not Path(s.inception_weights).is_file():
        raise SettingsError(f"--inception_weights {s.inception_weights} does not exist; give the .pth file or drop it")
    if _looks_local(s.dataset) and not Path(s.dataset).expanduser().exists():
        load_real_images(s)  # raises the one-line error before anything slow runs
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_saved(s.classifier, s.verify, "--classifier")
    classifier = load_classifier(s.classifier, device)
    variants, notes = weights_to_score(run_dir, s)
    for raw in filter(None, variants.values()):  # the raw weights: the last checkpoint's
        check_saved(raw, s.verify, "the raw weights")
    first = next(iter(variants))
    pipe = load_pipeline(run_dir, variants[first], device, s.guidance_model, s.verify)
    grid = sampler_settings(pipe, s)  # checked before the real features are computed
    out_dir = Path(s.output_dir or run_dir / "eval")
    out_dir.mkdir(parents=True, exist_ok=True)
    real = real_reference(classifier, s.classifier, s)
    if warning := weak_judge_warning(s.classifier, real["classifier_accuracy"]):
        print(warning)
    common = {"run_dir": str(run_dir), "classifier": s.classifier, "classifier_hash": real["classifier_hash"],
              "split": s.split, "num_real": real["num_real"], "real_classifier_accuracy": real["classifier_accuracy"],
              "real_features_cache": real["cache"]}

    if not s.sweep:
        (sched, steps, scale, interval), = grid
        row = evaluate_pipeline(pipe, classifier, real, s.num_images, sched, steps, scale, s.batch_size, s.seed,
                                s.nearest_k, s.mixed_precision, s.progress,
                                out_dir / grid_name(first, sched, steps, scale, interval), s.grid_images,
                                return_images=bool(s.inception_weights), guidance_interval=interval)
        images = row.pop("images", None)
        fid, note = (inception_fid(load_real_images(s).images, images, s.inception_weights)
                     if images is not None else inception_fid(None, None, ""))
        result = {**common, "weights": first, **row, "inception_fid": fid, "notes": notes + [note]}
        path = Path(s.output_json or out_dir / "eval.json")
        atomic_write_text(path, json.dumps(result, indent=1))
        print(f"{report_line(result)} -> {path}")
        return 0

    conditional = bool(pipe.unet.config.num_classes) or pipe.guide_unet is not None or pipe.takes_guidance
    rows = []
    for name, raw in variants.items():
        if name != first:
            pipe = load_pipeline(run_dir, raw, device, s.guidance_model, s.verify)
        for sched, steps, scale, interval in grid:
            row = evaluate_pipeline(pipe, classifier, real, s.num_images, sched, steps, scale, s.batch_size, s.seed,
                                    s.nearest_k, s.mixed_precision, s.progress,
                                    out_dir / grid_name(name, sched, steps, scale, interval), s.grid_images,
                                    guidance_interval=interval)
            rows.append({**common, "weights": name, **row})
            write_sweep(rows, out_dir, plot=False)  # a run cut short still leaves every finished row
            print(report_line(rows[-1]))
    if not conditional and any(scale != 1.0 for _, _, scale, _ in s.grid):
        notes.append("unconditional model without --guidance_model: guidance scales other than 1 left out")
    written = write_sweep(rows, out_dir)
    atomic_write_text(out_dir / "sweep_notes.json", json.dumps({"notes": notes, "settings": asdict(s)}, indent=1,
                                                               default=str))
    print(f"sweep of {len(rows)} settings: {', '.join(str(p) for p in written)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hf-cgpu eval`` for pipeline folders; bad input ends in one line and exit code 2."""
    return run_main(_main, argv)
