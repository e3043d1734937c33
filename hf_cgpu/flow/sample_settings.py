"""What ``hf-cgpu sample`` draws and how, torch-free (``hf-cgpu budget --task sample`` prices the same flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SettingsError
from ..options import VERIFY_MODES
from .samplers import check_sampler, parse_interval, sampler_names


@dataclass(frozen=True)
class SampleSettings:
    """What ``hf-cgpu sample`` draws and how."""

    num_images: int = 64
    """Images to draw; the grid is about square."""
    scheduler: str = field(default="", metadata={"choices": sampler_names})
    """Sampler (hf_cgpu.flow.samplers): heun (2 network calls per step but the last, better at few steps), euler
    (1 call per step), or another registered one; empty = the one the pipeline was saved with."""
    num_inference_steps: int = 0
    """Solver steps from noise (t = 0) to data (t = 1); 0 = the pipeline's saved default (a flow run: its
    --sample_steps; a distilled run: 1 or 2)."""
    class_labels: str = ""
    """Comma-separated class indices or names (see class_names.txt), cycled over the images; empty = unconditional
    (the null class)."""
    guidance_scale: float = 0.0
    """Guidance w (1 = the plain model, one call per step): classifier-free with --class_labels, or autoguidance with
    a --guidance_model (saved or given); a run distilled with --guidance_range is told w instead (one call per step,
    w within its range); 0 = the pipeline's saved default with --class_labels or a guidance model (a flow run: its
    --guidance_scale; a distilled run: 1, its guidance is baked in, or its --sample_guidance; 2.5 for a folder that
    saved none), 1 without."""
    guidance_interval: str = ""
    """Guidance only where t (0 = noise, 1 = data) lies in LO:HI, e.g. 0.15:0.8, the conditional model elsewhere
    (one call instead of two); full = every step; empty = the pipeline's saved interval."""
    guidance_model: str = ""
    """Autoguidance: guide with this weaker model, for the same class (or unconditionally), instead of the null
    class: raw (the run's live weights against its EMA), a checkpoint folder (RUN/checkpoints/step_N) or one of its
    .safetensors files, a pipeline or UNet folder; none = off; empty = what the folder saved (off unless it saved
    one). Needs a guidance scale other than 1 (a distilled folder saves 1: pass --guidance_scale)."""
    save_pipeline: str = ""
    """Also save the pipeline, with these sampler, steps, guidance scale, interval and model as its defaults, to this
    folder (it then samples that way wherever it loads, diffusers without hf_cgpu included; never a training run's
    folder); empty = do not."""
    seed: int = 0
    """Seed of the starting noise."""
    output_dir: str = ""
    """Where the PNGs go; empty = MODEL_DIR/samples_cli."""
    verify: str = field(default="auto", metadata={"choices": lambda: VERIFY_MODES})
    """What of MODEL_DIR's (and a guidance model folder's) manifest.json is checked before it is read: auto (the
    sizes; the SHA-256 too up to 512 MiB), sizes, full, or off (a folder edited by hand); see docs/outputs.md."""

    def __post_init__(self) -> None:
        if self.scheduler:
            check_sampler(self.scheduler)
        if self.num_images < 1 or self.num_inference_steps < 0:
            raise SettingsError("--num_images must be >= 1 and --num_inference_steps >= 1 (or 0: the saved default)")
        if self.guidance_interval:
            parse_interval(self.guidance_interval)
        if self.guidance_scale < 0:
            raise SettingsError(f"--guidance_scale {self.guidance_scale}; use a value >= 1 (or 0: the default)")

    def check_guided(self, takes_guidance: bool) -> None:
        """A guidance scale needs something to guide by: class labels, a guidance model, or a UNet told the scale
        (``takes_guidance``: a student distilled with --guidance_range)."""
        if (self.guidance_scale not in (0.0, 1.0) and not self.class_labels and self.guidance_model in ("", "none")
                and not takes_guidance):
            raise SettingsError("--guidance_scale needs --class_labels (guidance contrasts a class with the null "
                                "class) or --guidance_model (autoguidance)")

    def sampling(self, pipe) -> dict:
        """The pipeline call's steps, guidance scale and interval: these settings, 0 and empty resolved from the
        pipeline's saved config."""
        return self.sampling_of(pipe.config, bool(pipe.unet.config.num_classes),
                                pipe.guide_unet is not None or pipe.takes_guidance)

    def sampling_of(self, config, conditional: bool, guide: bool) -> dict:
        """``sampling`` for a pipeline saved with ``config`` (model_index.json's values) whose UNet is
        ``conditional`` and which samples with a ``guide`` (autoguidance, or a UNet told the guidance scale): the
        guidance scale counts only with class labels or a guide."""
        guided = self.class_labels or guide
        return resolve_sampling(config, conditional, guide, self.num_inference_steps,
                                self.guidance_scale if guided else 1.0, self.guidance_interval, fallback_scale=2.5)


def resolve_sampling(config, conditional: bool, guide: bool, steps: int, scale: float, interval: str,
                     fallback_scale: float) -> dict:
    """Steps, guidance scale and interval of a call to a pipeline saved with ``config`` (model_index.json's
    values) whose UNet is ``conditional`` and which has a ``guide`` (autoguidance): 0 / empty take the saved value
    (``fallback_scale`` where a folder recorded no scale)."""
    if not conditional and not guide:
        scale = scale or 1.0  # an unconditional model is guided only by a weaker model (autoguidance)
    saved_interval = config.get("guidance_interval")
    return {"num_inference_steps": steps or config.get("num_inference_steps", 8),
            "guidance_scale": scale or config.get("guidance_scale") or fallback_scale,
            "guidance_interval": parse_interval(interval) if interval else
            (tuple(saved_interval) if saved_interval else None)}
