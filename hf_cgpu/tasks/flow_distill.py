"""Few-step distillation of a trained flow pipeline: ``hf-cgpu train flow-distill --teacher DIR``.

The student is the teacher's UNet with ``step_size_embedding`` switched on (zero-initialised, so step 0 is the
teacher), trained with the shortcut objective of ``hf_cgpu.flow.shortcut`` against the teacher's classifier-free
guided velocity (its scale and interval), so the saved pipeline samples in 1 or 2 Euler steps with one network
evaluation each. The data, the sample grids, the held-out figures and the saved folder are the flow task's: the
result is an ordinary FlowMatchPipeline folder whose saved defaults are ``sample_steps`` Euler steps, no guidance.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..errors import SettingsError
from ..flow.matching import FlowMatcher
from ..flow.pipeline_flow_match import FlowMatchPipeline
from ..flow.sample import load_pipeline_folder, saved_sampling
from ..flow.samplers import format_interval
from ..flow.scheduling_flow_match import FlowMatchEulerScheduler
from ..flow.shortcut import ShortcutObjective, guided_teacher
from ..flow.unet import FlowUNet2DModel
from ..integrity import sha256_file
from ..settings import TrainSettings
from ..train import TaskPlan
from ..train.metrics import counted_training_flops
from .flow_images import FlowMatchingTask
from .settings import FlowDistillSettings


class FlowDistillTask(FlowMatchingTask):
    card = "flow-distill"
    ledger_task = "flow-distill"

    def __init__(self, cfg: FlowDistillSettings):
        self.cfg = cfg

    def setup(self, settings: TrainSettings, accelerator) -> TaskPlan:
        cfg = self.cfg
        if not cfg.teacher:
            raise SettingsError("pass --teacher DIR, the output_dir of a flow run (hf-cgpu train flow)")
        teacher = load_pipeline_folder(cfg.teacher, cfg.verify, "--teacher")
        unet = teacher.unet
        if getattr(unet.config, "step_size_embedding", False):
            raise SettingsError(f"{cfg.teacher} is already a distilled pipeline; pass the flow run it came from")
        conditional = unet.config.num_classes is not None
        if not conditional and teacher.guide_unet is None and cfg.guidance_scale not in (0.0, 1.0):
            raise SettingsError(f"--guidance_scale {cfg.guidance_scale:g}: {cfg.teacher} is unconditional and saved "
                                "no guidance model, so nothing guides it; drop --guidance_scale, or distill a folder "
                                "saved with one (hf-cgpu sample --guidance_model ... --save_pipeline DIR)")
        self.load_data(accelerator, labels=conditional)
        kw = saved_sampling(teacher, 1, cfg.guidance_scale, cfg.guidance_interval, fallback_scale=2.5)
        guide = teacher.guide_unet  # a teacher folder saved with autoguidance is distilled as it samples
        self.guidance = (kw["guidance_scale"] if conditional or guide is not None else 1.0, kw["guidance_interval"])
        # the guidance baked in, as resolved from the folder's saved defaults: these FIXED settings hold it, so the
        # resume fingerprint and all_results.json record it and a resume against a re-saved teacher is refused
        self.cfg = cfg = dataclasses.replace(cfg, guidance_scale=self.guidance[0],
                                             guidance_interval=format_interval(self.guidance[1]))
        self.teacher = unet.to(accelerator.device).eval().requires_grad_(False)
        guide_fn = None
        if guide is not None:
            self.guide = guide.to(accelerator.device)
            guide_fn = lambda x, t, y: self.guide(x, t, y).sample  # noqa: E731
            self.data_hashes["teacher_guide_weights"] = sha256_file(teacher_weights(cfg.teacher, "guide_unet"))
        self.teacher_fn = guided_teacher(lambda x, t, y: self.teacher(x, t, y).sample, unet.config.num_classes,
                                         *self.guidance, guide_fn=guide_fn)
        self.objective = ShortcutObjective(cfg.levels, cfg.consistency_fraction)
        self.matcher = FlowMatcher(time_sampling=cfg.time_sampling)
        self.data_hashes["teacher_weights"] = sha256_file(teacher_weights(cfg.teacher))  # a resume must see the same
        student = FlowUNet2DModel(**{**unet.config, "step_size_embedding": True})
        missing = student.load_state_dict(unet.state_dict(), strict=False).missing_keys
        assert all(k.startswith("step_mlp.") for k in missing), missing
        size = self.images.shape[-1]
        labels = torch.zeros(1, dtype=torch.long) if conditional else None
        flops = counted_training_flops(student, torch.zeros(1, 3, size, size), torch.zeros(1), labels)
        student = student.to(memory_format=torch.channels_last).train()
        scale, interval = self.guidance
        self.show_progress, self.last_grid = settings.progress and accelerator.is_local_main_process, None
        self.guide_name = teacher.config.get("guidance_model") if guide is not None else None
        by = f" by {self.guide_name}" if self.guide_name else ""
        accelerator.print(f"distilling {cfg.teacher} (guidance {scale:g}{by}, t in {format_interval(interval)}) into "
                          f"{cfg.sample_steps}-step Euler; {len(self.images):,} training images")
        # the teacher's guided forward (2 rows) on every row, the student's two half steps on a quarter: ~4x a step's
        # forward FLOPs on top of the student's own forward and backward
        return TaskPlan(student, eval_steps=self.eval_steps(settings, accelerator), flops_per_unit=flops)

    def loss(self, model, batch, generator) -> torch.Tensor:
        def student(x, t, d, labels):
            return model(x, t, labels, step_size=d).sample

        x1 = batch["x1"]
        t_flow = self.matcher.sample_time(self.objective.flow_rows(x1.shape[0]), x1.device, generator)
        return self.objective.loss(student, self.teacher_fn, x1, t_flow, generator, batch.get("labels"))

    @torch.no_grad()
    def evaluate(self, model, settings, device) -> dict[str, float]:
        """The objective on held-out images with fixed noise, times and step sizes (comparable across steps)."""
        gen = torch.Generator(device=device).manual_seed(1234)
        n, bs, total = len(self.val_images), settings.micro_batch_size, 0.0
        for start in range(0, n, bs):
            x1 = self.val_images[start : start + bs].float() / 127.5 - 1.0
            x1 = x1.contiguous(memory_format=torch.channels_last)
            labels = self.val_labels[start : start + bs] if self.val_labels is not None else None
            if len(x1) > 1:
                total += self.loss(model, {"x1": x1, "labels": labels}, gen).item() * len(x1)
        return {"val_loss": total / n}

    def pipeline(self, model):
        """Euler with the distilled step sizes, ``sample_steps`` steps by default, guidance baked in."""
        return FlowMatchPipeline(unet=model, scheduler=FlowMatchEulerScheduler(),
                                 num_inference_steps=self.cfg.sample_steps, guidance_scale=1.0)

    def on_saved(self, model, output_dir, log=print) -> dict:
        scale, interval = self.guidance
        return {**super().on_saved(model, output_dir, log), "teacher": self.cfg.teacher,
                "teacher_guidance_scale": scale, "teacher_guidance_interval": format_interval(interval),
                **({"teacher_guidance_model": self.guide_name} if self.guide_name else {})}


def teacher_weights(folder: str, component: str = "unet") -> Path:
    """The teacher UNet's (or its autoguidance model's) weights file (what the resume fingerprint hashes)."""
    found = sorted((Path(folder) / component).glob("diffusion_pytorch_model*.safetensors"))
    if not found:
        raise SettingsError(f"{folder}/{component} holds no diffusion_pytorch_model.safetensors; pass a saved flow "
                            "run")
    return found[0]


__all__ = ["FlowDistillTask"]
