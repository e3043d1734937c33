"""Inference pipeline for our flow-matching UNet: noise at t = 0, integrate the predicted velocity to t = 1.

Imports only the standard library, torch, diffusers (and, for Hub ids, huggingface_hub, which diffusers depends on)
and ``carry``, which ``save_for_remote_code`` carries into the copy of this file it writes as ``pipeline.py`` in the
saved folder (with each component's code, carried the same way), so without hf_cgpu installed it loads with

    DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder, trust_remote_code=True)

and, with hf_cgpu installed, ``FlowMatchPipeline.from_pretrained(folder)`` loads the same folder with hf_cgpu's own
classes and no remote code. The UNet and scheduler are typed as their diffusers base classes so the classes
loaded from the copied files (another module than hf_cgpu's) pass diffusers' type check.
"""

from __future__ import annotations

import importlib
import json
import os

import torch
from diffusers.models.modeling_utils import ModelMixin
from diffusers.pipelines.pipeline_utils import DiffusionPipeline, ImagePipelineOutput
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils.torch_utils import randn_tensor

from .carry import carried_source


# from_pretrained arguments that locate a Hub repo's files, and those a ModelMixin component's own loader takes.
_HUB_ARGS = ("revision", "cache_dir", "local_files_only", "token", "force_download", "proxies")
_MODEL_ARGS = ("use_safetensors", "low_cpu_mem_usage", "device_map", "max_memory", "offload_folder",
               "offload_state_dict", "disable_mmap")


def _is_flow_scheduler(scheduler: SchedulerMixin) -> bool:
    """diffusers' flow-match schedulers (sigma = 1 noise, velocity noise - data), or a solver run with flow sigmas."""
    config = scheduler.config
    if config.get("use_flow_sigmas", False):
        return config.get("prediction_type") == "flow_prediction"
    return type(scheduler).__name__.startswith("FlowMatch") and hasattr(scheduler, "sigmas")


def _checked_interval(interval) -> list[float] | None:
    """A guidance interval as [lo, hi] with 0 <= lo < hi <= 1 (None: every call); anything else is refused, since
    lo >= hi would silently guide no call at all."""
    if interval is None:
        return None
    try:
        lo, hi = (float(v) for v in interval) if not isinstance(interval, str) else (None, None)
    except (TypeError, ValueError):
        lo = hi = None
    if lo is None or not 0 <= lo < hi <= 1:
        raise ValueError(f"guidance_interval={interval!r}; pass (lo, hi) in t with 0 <= lo < hi <= 1 (0 = noise, "
                         "1 = data), e.g. (0.25, 0.8), or None to guide every step")
    return [lo, hi]


class FlowMatchPipeline(DiffusionPipeline):
    """Sample images from a velocity UNet (t = 0 noise -> t = 1 data) with a flow-matching scheduler.

    Args:
        unet: called as ``unet(x, t, class_labels).sample`` with t in [0, 1] of shape (B,); a class-conditional
            UNet has ``config.num_classes`` and uses that index as the null class.
        scheduler: ours (FlowMatchEulerScheduler, FlowMatchHeunScheduler: ``timesteps`` are our t values) or one of
            diffusers' flow-matching schedulers: FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler, or a
            multistep solver built with ``use_flow_sigmas=True, prediction_type="flow_prediction"``
            (DPMSolverMultistepScheduler, UniPCMultistepScheduler, DEISMultistepScheduler, ...). Those walk sigma = 1
            (noise) to 0: the UNet gets t = 1 - sigma and the scheduler gets the velocity in their sign, -(x1 - x0).
        num_inference_steps, guidance_scale, guidance_interval: how the folder samples when a call leaves them out,
            saved in model_index.json (see ``__call__``); guidance_scale None = 1 (a folder that recorded none).
        guide_unet: optional weaker version of ``unet`` (an earlier checkpoint, the raw weights against the EMA):
            autoguidance (Karras et al. 2024) then takes its velocity, with the same class label or none, in place of
            the null class's: v_weak + w (v - v_weak). Saved as a component like ``unet``, so the folder samples the
            same way wherever it loads; ``guidance_model`` names where it came from (``set_guidance_model``).

    A UNet whose config has ``step_size_embedding`` (a few-step model distilled by ``hf-cgpu train flow-distill``) is
    also told the length of the step each call takes (``step_size``); guidance is then usually baked into it. One with
    ``guidance_embedding`` (distilled over a range of guidance) is told the guidance scale instead: one call a step at
    any w in ``guidance_range`` (the range it was trained over, saved in model_index.json; a w outside is refused).
    """

    model_cpu_offload_seq = "unet->guide_unet"
    _optional_components = ["guide_unet"]

    def __init__(self, unet: ModelMixin, scheduler: SchedulerMixin, num_inference_steps: int = 8,
                 guidance_scale: float | None = None, guidance_interval: list[float] | None = None,
                 guide_unet: ModelMixin | None = None, guidance_model: str | None = None,
                 guidance_range: list[float] | None = None) -> None:
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler, guide_unet=None)
        interval = _checked_interval(guidance_interval)
        self.register_to_config(num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                                guidance_interval=interval, guidance_model=None)
        if guidance_range is not None:  # only where given: other folders' model_index.json stay as they were
            self.register_to_config(guidance_range=[float(v) for v in guidance_range])
        if guide_unet is not None:
            self.set_guidance_model(guide_unet, guidance_model)

    # UNet config entries a guide must share with the UNet: the same images in and out, the same class count.
    # A step-size conditioned (distilled) UNet predicts a step's average velocity, the others the instantaneous one.
    _GUIDE_MATCHES = ("sample_size", "in_channels", "out_channels", "num_classes", "step_size_embedding")

    def set_guidance_model(self, guide_unet: ModelMixin | None, name: str | None = None) -> None:
        """Autoguidance with ``guide_unet`` (None: off), recorded as ``name`` in ``config.guidance_model``. A guide
        of other image shape, class count or kind (distilled or not) is refused: its velocity would not be
        comparable."""
        if guide_unet is not None and self.takes_guidance:
            raise ValueError("this UNet takes the guidance scale as its input (one call a step): it needs no guidance "
                             "model; pass guidance_scale alone")
        if guide_unet is not None:
            def entry(model, key):  # a UNet class without step_size_embedding is not step-size conditioned
                value = model.config.get(key)
                return bool(value) if key == "step_size_embedding" else value

            differ = [k for k in self._GUIDE_MATCHES if entry(guide_unet, k) != entry(self.unet, k)]
            if differ:
                theirs = ", ".join(f"{k} {entry(guide_unet, k)} vs {entry(self.unet, k)}" for k in differ)
                raise ValueError(f"the guidance model does not match the UNet ({theirs}); use an earlier checkpoint "
                                 "or the raw weights of the same run")
            guide_unet = guide_unet.eval().requires_grad_(False)
        self.register_modules(guide_unet=guide_unet)
        self.register_to_config(guidance_model=(name or "given") if guide_unet is not None else None)

    @property
    def takes_guidance(self) -> bool:
        """Whether the UNet is told the guidance scale (``guidance_embedding``) instead of being guided by a second
        velocity."""
        return bool(getattr(self.unet.config, "guidance_embedding", False))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs):
        """diffusers' loader, but components recorded under this class's own package are loaded from it.

        A ``save_for_remote_code`` folder also holds the component code (unet/hf_cgpu.flow.unet.py), and diffusers
        runs such a file whenever it exists, so it would demand ``trust_remote_code=True`` even with hf_cgpu
        installed. Loading those components from the installed package and passing them in avoids running the
        folder's code. Only modules of this class's top-level package are imported, never other names from the file.

        Every standard argument is honoured as diffusers does: a Hub repo id is resolved to its snapshot with
        ``revision``, ``cache_dir``, ``local_files_only``, ``token``, ``force_download``, ``proxies``; our models get
        ``dtype`` (one dtype, or a dict of component name -> dtype with an optional "default"), ``variant`` (where
        their folder has such files), ``use_safetensors``, ``low_cpu_mem_usage``, ``device_map`` and the offload
        arguments; everything else goes to ``DiffusionPipeline.from_pretrained``.
        """
        folder = os.fspath(pretrained_model_name_or_path)
        package = cls.__module__.split(".")[0]
        if package == "diffusers_modules":  # loaded as remote code: diffusers runs the folder's component files
            return super().from_pretrained(folder, **kwargs)
        if not os.path.isdir(folder):
            from huggingface_hub import snapshot_download

            folder = snapshot_download(folder, **{k: kwargs[k] for k in _HUB_ARGS if k in kwargs})
        index_path = os.path.join(folder, "model_index.json")
        if not os.path.isfile(index_path):
            raise ValueError(f"{folder} has no model_index.json; pass a folder written by save_pretrained")
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        modules = cls._get_signature_keys(cls)[0]  # unet, scheduler: not the saved sampling defaults
        components = [k for k, v in index.items() if k in modules and isinstance(v, list)]
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(dtype, dict) and set(dtype) - {*components, "default"}:
            raise ValueError(f"dtype names {sorted(set(dtype) - set(components))}, which are not components of this "
                             f"pipeline; use {components} or 'default'")
        variant = kwargs.get("variant")
        for name in components:
            library, class_name = index[name]
            if name in kwargs or library is None or library.split(".")[0] != package:
                continue
            module = importlib.import_module(library)
            klass = getattr(module, class_name)
            for base in (ModelMixin, SchedulerMixin):
                # diffusers checks a passed component against the base class it finds by name in the component's
                # module; a module that subclasses one of ours (imported from another file) names none
                if issubclass(klass, base) and not hasattr(module, base.__name__):
                    setattr(module, base.__name__, base)
            extra = {}
            if issubclass(klass, ModelMixin):
                extra = {k: kwargs[k] for k in _MODEL_ARGS if k in kwargs}
                component_dtype = dtype.get(name, dtype.get("default")) if isinstance(dtype, dict) else dtype
                if component_dtype is not None:
                    extra["dtype"] = component_dtype
                if variant is not None and any(f".{variant}." in f for f in os.listdir(os.path.join(folder, name))):
                    extra["variant"] = variant
            kwargs[name] = klass.from_pretrained(folder, subfolder=name, **extra)
        return super().from_pretrained(folder, **kwargs)

    def _labels(self, class_labels, batch_size: int | None, device: torch.device) -> torch.Tensor | None:
        """int / list / tensor -> (B,) int64 on device; None stays None (unconditional). B follows the labels unless
        batch_size is given, where one label is repeated batch_size times."""
        if class_labels is None:
            return None
        if getattr(self.unet.config, "num_classes", None) is None:
            raise ValueError("class_labels given but the unet is unconditional; train it with num_classes set")
        labels = torch.as_tensor(class_labels, dtype=torch.long, device=device).reshape(-1)
        classes = self.unet.config.num_classes
        outside = (labels < 0) | (labels >= classes)  # index K is the null class: not a label to ask for
        if outside.any():
            raise ValueError(f"class_labels holds {labels[outside].unique().tolist()[:5]}; pass class_labels in "
                             f"0..{classes - 1}, or None for the null class")
        if batch_size is None:
            return labels
        if labels.numel() == 1:
            labels = labels.expand(batch_size)
        if labels.numel() != batch_size:
            raise ValueError(f"{labels.numel()} class_labels for batch_size={batch_size}; pass one label, one per "
                             "image, or leave batch_size out")
        return labels

    @staticmethod
    def _forward(model: ModelMixin, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None,
                 step_size: float, scale: float = 1.0) -> torch.Tensor:
        """One model call; a model with ``step_size_embedding`` is also told the step size, one with
        ``guidance_embedding`` the guidance scale."""
        extra = {}
        for key, flag, value in (("step_size", "step_size_embedding", step_size),
                                 ("guidance", "guidance_embedding", scale)):
            if getattr(model.config, flag, False):
                extra[key] = torch.full((x.shape[0],), value, device=x.device, dtype=torch.float32)
        return model(x, t.expand(x.shape[0]), labels, **extra).sample

    def _velocity(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None, scale: float,
                  step_size: float = 0.0) -> torch.Tensor:
        """Model velocity at (x, t). Guided (scale != 1): v_guide + w (v - v_guide), the guide being the weaker model
        with the same labels when there is one (two calls), else the null class (one batch of conditional and
        null-class halves); a UNet that takes the guidance scale is told it (one call)."""
        guide = self.guide_unet
        if self.takes_guidance:
            return self._forward(self.unet, x, t, labels, step_size, scale)
        if scale == 1.0 or (guide is None and labels is None):
            return self._forward(self.unet, x, t, labels, step_size)
        if guide is not None:
            v_guide = self._forward(guide, x, t, labels, step_size)
            return v_guide + scale * (self._forward(self.unet, x, t, labels, step_size) - v_guide)
        null = torch.full_like(labels, self.unet.config.num_classes)
        v = self._forward(self.unet, torch.cat([x, x]), t, torch.cat([labels, null]), step_size)  # (2B, C, H, W)
        v_cond, v_uncond = v.chunk(2)
        return v_uncond + scale * (v_cond - v_uncond)

    def _call_plan(self, interval) -> list[tuple[float, float, bool]]:
        """(t, step size, guided) per model call: our schedulers' own ``call_plan``; diffusers' get t = 1 - sigma and
        step size 0 (the instantaneous velocity)."""
        if getattr(self.scheduler, "timesteps_are_t", False):
            return self.scheduler.call_plan(tuple(interval) if interval is not None else None)
        lo, hi = interval if interval is not None else (0.0, 1.0)
        ts = (1.0 - self.scheduler.sigmas[: len(self.scheduler.timesteps)]).tolist()
        return [(t, 0.0, lo - 1e-6 <= t <= hi + 1e-6) for t in ts]

    def check_guidance_interval(self, num_inference_steps: int, guidance_scale: float, guidance_interval,
                                flags: tuple[str, str] = ("guidance_interval", "num_inference_steps")) -> None:
        """Refuse (ValueError) a guidance interval that holds none of the model calls of ``num_inference_steps``
        steps of this scheduler while ``guidance_scale`` != 1: guidance would then change nothing, silently. ``flags``
        name the interval and the steps in the message (a command's own flags). A UNet that takes the guidance scale
        is told it at every call (its interval was the teacher's): a scale outside the range it was trained over is
        refused instead."""
        interval = _checked_interval(guidance_interval)
        trained = self.config.get("guidance_range")
        if self.takes_guidance and trained and not trained[0] <= guidance_scale <= trained[1]:
            raise ValueError(f"guidance scale {guidance_scale:g} lies outside {trained[0]:g}:{trained[1]:g}, the range "
                             "this distilled UNet was trained over (its guidance input); pass a scale within it")
        if self.takes_guidance or guidance_scale == 1.0 or interval is None:
            return
        self.scheduler.set_timesteps(num_inference_steps)
        plan = self._call_plan(interval)
        if not any(guided for _, _, guided in plan):
            times = ", ".join(f"{t:.3g}" for t in dict.fromkeys(round(t, 6) for t, _, _ in plan))
            raise ValueError(f"{flags[0]} {interval[0]:g}:{interval[1]:g} holds none of the model calls of "
                             f"{num_inference_steps} {type(self.scheduler).__name__} steps (t = {times}), so guidance "
                             f"scale {guidance_scale:g} would change nothing; widen {flags[0]} or raise {flags[1]}")

    @torch.no_grad()
    def __call__(
        self,
        batch_size: int | None = None,
        num_inference_steps: int | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        class_labels: int | list[int] | torch.Tensor | None = None,
        guidance_scale: float | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        guidance_interval: tuple[float, float] | None | str = "saved",
    ) -> ImagePipelineOutput | tuple:
        """Generate images.

        Args:
            batch_size: number of images; default: one per class label (as DiTPipeline), or 1 without labels.
            num_inference_steps: scheduler steps N (Euler: N model calls; Heun: 2N - 1, doubled again with guidance);
                None = the saved ``config.num_inference_steps``.
            class_labels: one label for all images, one per image, or None (null class / unconditional model).
            guidance_scale: guidance w in v_u + w (v_c - v_u); 1.0 is the plain conditional model and costs a
                single forward per step. v_u is the null class's velocity (classifier-free guidance), or with a
                ``guide_unet`` the weaker model's for the same labels (autoguidance, also without labels); a UNet with
                ``guidance_embedding`` is told w instead (one forward per step). None = the saved
                ``config.guidance_scale`` with class labels, a guide or such a UNet (1 where none is saved), 1
                otherwise.
            output_type: "pil" (list of PIL images), "np" (B, H, W, C) float in [0, 1], "pt" (B, C, H, W) in [0, 1].
            guidance_interval: (lo, hi): guidance only at calls whose t (0 = noise, 1 = data) lies in [lo, hi], the
                plain conditional model (one forward) elsewhere (Kynkaanniemi et al. 2024: guidance near the noise
                end costs variety); None = every call; "saved" = ``config.guidance_interval``. An interval that
                holds no call while guidance_scale != 1 is refused (``check_guidance_interval``).
        """
        if output_type not in ("pil", "np", "pt"):
            raise ValueError(f"output_type={output_type!r}; use 'pil', 'np' or 'pt'")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size={batch_size}; use 1 or more, or leave it out to follow class_labels")
        ours = getattr(self.scheduler, "timesteps_are_t", False)
        if not ours and not _is_flow_scheduler(self.scheduler):
            raise ValueError(f"{type(self.scheduler).__name__} is not a flow-matching scheduler; use ours, diffusers' "
                             "FlowMatch*, or a solver with use_flow_sigmas=True, prediction_type='flow_prediction'")
        device = self._execution_device
        steps = num_inference_steps if num_inference_steps is not None else self.config.num_inference_steps
        if isinstance(guidance_interval, str) and guidance_interval == "saved":
            guidance_interval = self.config.get("guidance_interval")
        guidance_interval = _checked_interval(guidance_interval)
        labels = self._labels(class_labels, batch_size, device)
        can_guide = labels is not None or self.guide_unet is not None or self.takes_guidance
        if guidance_scale is None:
            guidance_scale = (self.config.get("guidance_scale") or 1.0) if can_guide else 1.0
        if batch_size is None:
            batch_size = 1 if labels is None else labels.numel()
        if not can_guide and guidance_scale != 1.0:
            raise ValueError("guidance_scale != 1 needs class_labels (guidance contrasts a class with the null class) "
                             "or a guide_unet (autoguidance)")
        self.check_guidance_interval(steps, guidance_scale, guidance_interval)
        cfg = self.unet.config
        shape = (batch_size, cfg.in_channels, cfg.sample_size, cfg.sample_size)
        x = randn_tensor(shape, generator=generator, device=device, dtype=self.unet.dtype)  # x0 at t = 0

        self.scheduler.set_timesteps(steps, device=device)
        plan = self._call_plan(guidance_interval)
        for i, timestep in enumerate(self.progress_bar(self.scheduler.timesteps)):
            _, step_size, guided = plan[i]
            scale = guidance_scale if guided or self.takes_guidance else 1.0
            if ours:
                v = self._velocity(x, timestep, labels, scale, step_size)
            else:  # diffusers' convention: sigma = 1 - t, model output noise - data = -(x1 - x0)
                t = (1.0 - self.scheduler.sigmas[i]).to(device=device, dtype=torch.float32)
                v = -self._velocity(x, t, labels, scale, step_size)
            x = self.scheduler.step(v, timestep, x).prev_sample

        image = (x.float() / 2 + 0.5).clamp(0, 1)  # [-1, 1] -> [0, 1], (B, C, H, W)
        if output_type == "pt":
            images = image
        else:
            images = image.cpu().permute(0, 2, 3, 1).numpy()  # (B, H, W, C)
            if output_type == "pil":
                images = self.numpy_to_pil(images)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)


def save_for_remote_code(pipeline: DiffusionPipeline, save_directory: str | os.PathLike) -> None:
    """``save_pretrained`` plus the code, so the folder loads where hf_cgpu is not installed.

    Writes pipeline.py (the pipeline class's module) at the top and each non-diffusers component's module into its
    folder under the module's import name (unet/hf_cgpu.flow.unet.py, scheduler/hf_cgpu.flow.scheduling_flow_match.py),
    which is the name model_index.json records: diffusers loads a component from ``<folder>/<library>.py`` when that
    file exists and trust_remote_code=True. Each file is written with the modules of its own package and of this
    one's that it imports carried inside (``carry.carried_source``), so a sampler in its own file that subclasses one
    of ours saves a folder that loads as well. Load with
    ``DiffusionPipeline.from_pretrained(d, custom_pipeline=d, trust_remote_code=True)``, or with hf_cgpu installed
    ``FlowMatchPipeline.from_pretrained(d)``.
    """
    save_directory = os.fspath(save_directory)
    pipeline.save_pretrained(save_directory)
    index_path = os.path.join(save_directory, "model_index.json")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    ours = __name__.split(".")[0]  # hf_cgpu, or diffusers_modules for a pipeline loaded as remote code

    def write_code(cls: type, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(carried_source(cls, {ours, cls.__module__.split(".")[0]}))

    for name in pipeline.components:
        component = getattr(pipeline, name)
        component = getattr(component, "_orig_mod", component)  # torch.compile wrapper -> the model
        module = type(component).__module__
        if component is None or module.split(".")[0] in ("diffusers", "transformers"):
            continue  # a stock class loads from its library
        library = module.removeprefix("diffusers_modules.local.")  # re-saving a pipeline loaded as remote code
        write_code(type(component), os.path.join(save_directory, name, f"{library}.py"))
        index[name] = [library, type(component).__name__]
    write_code(type(pipeline), os.path.join(save_directory, "pipeline.py"))
    with open(index_path, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
