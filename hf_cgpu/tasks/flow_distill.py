"""Few-step distillation of a trained flow pipeline: ``hf-cgpu train flow-distill --teacher DIR``.

The student is the teacher's UNet with ``step_size_embedding`` switched on (zero-initialised, so step 0 is the
teacher), trained with the shortcut objective of ``hf_cgpu.flow.shortcut`` against the teacher's classifier-free
guided velocity (its scale and interval), so the saved pipeline samples in 1 or 2 Euler steps with one network
evaluation each. The data, the sample grids, the held-out figures and the saved folder are the flow task's: the
result is an ordinary FlowMatchPipeline folder whose saved defaults are ``sample_steps`` Euler steps, no guidance.

With ``--guidance_range LO:HI`` the guidance scale is the student's input instead of baked in: each row of a batch
draws its own w (from the run's generator, so a resume is exact), the teacher's target is guided at it and the student
(``guidance_embedding``, zero-initialised like the step size's) is told it; the saved folder's ``guidance_scale``
(default ``--sample_guidance``) feeds that input, one network evaluation a step at any w of the range it records.

The adversarial stage (``--adversarial_weight``, ``--init_student``: ``hf_cgpu.flow.adversarial``) adds a GAN term
on the student's 1- and 2-step samples against the real training images: the discriminator heads and their
optimizer are the run's second network (``TaskPlan.companions``), stepped inside ``loss`` before the student's
gradient is taken, so the loop stays the one loop and every checkpoint holds them. ``--judge`` adds the share of the
rarest class, as a classifier sees the samples, to every evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from ..errors import SettingsError
from ..evaluation.classifier import classify, load_classifier
from ..evaluation.images import class_statistics
from ..flow.adversarial import (FeatureHeads, discriminator_loss, generator_loss, row_steps, sample_in_steps,
                                unet_encoder_features, unet_feature_channels)
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
        if not conditional and teacher.guide_unet is None and cfg.guidance_range:
            raise SettingsError(f"--guidance_range {cfg.guidance_range}: {cfg.teacher} is unconditional and saved no "
                                "guidance model, so no w guides it; drop --guidance_range, or distill a folder saved "
                                "with one (hf-cgpu sample --guidance_model ... --save_pipeline DIR)")
        if not conditional and teacher.guide_unet is None and cfg.guidance_scale not in (0.0, 1.0):
            raise SettingsError(f"--guidance_scale {cfg.guidance_scale:g}: {cfg.teacher} is unconditional and saved "
                                "no guidance model, so nothing guides it; drop --guidance_scale, or distill a folder "
                                "saved with one (hf-cgpu sample --guidance_model ... --save_pipeline DIR)")
        self.load_data(accelerator, labels=conditional)
        self.check_data(unet.config)
        kw = saved_sampling(teacher, 1, cfg.guidance_scale, cfg.guidance_interval, fallback_scale=2.5)
        guide = teacher.guide_unet  # a teacher folder saved with autoguidance is distilled as it samples
        self.guidance = (kw["guidance_scale"] if conditional or guide is not None else 1.0, kw["guidance_interval"])
        # the guidance baked in, as resolved from the folder's saved defaults: these FIXED settings hold it, so the
        # resume fingerprint and all_results.json record it and a resume against a re-saved teacher is refused
        self.cfg = cfg = dataclasses.replace(cfg, guidance_scale=self.guidance[0],
                                             guidance_interval=format_interval(self.guidance[1]))
        self.scales = cfg.guidance_scales  # (LO, HI): each example's own w, the student's input; None: off
        if self.scales is not None and not cfg.sample_guidance:  # the teacher's scale, if the range holds it
            if not self.scales[0] <= self.guidance[0] <= self.scales[1]:
                raise SettingsError(f"the teacher's guidance scale {self.guidance[0]:g}, the saved folder's default, "
                                    f"lies outside --guidance_range {cfg.guidance_range}; pass --sample_guidance "
                                    "within it, e.g. the range's middle")
            self.cfg = cfg = dataclasses.replace(cfg, sample_guidance=self.guidance[0])
        self.teacher = unet.to(accelerator.device).eval().requires_grad_(False)
        guide_fn = None
        if guide is not None:
            self.guide = guide.to(accelerator.device)
            guide_fn = lambda x, t, y: self.guide(x, t, y).sample  # noqa: E731
            self.data_hashes["teacher_guide_weights"] = sha256_file(teacher_weights(cfg.teacher, "guide_unet"))
        self.teacher_fn = guided_teacher(lambda x, t, y: self.teacher(x, t, y).sample, unet.config.num_classes,
                                         *self.guidance, guide_fn=guide_fn)
        if self.scales is not None:  # the rows' conditioning is (labels, w): each row guided at its own w
            self.teacher_fn = functools.partial(_per_row_guidance, self.teacher_fn)
        self.objective = ShortcutObjective(cfg.levels, cfg.consistency_fraction)
        self.matcher = FlowMatcher(time_sampling=cfg.time_sampling)
        self.data_hashes["teacher_weights"] = sha256_file(teacher_weights(cfg.teacher))  # a resume must see the same
        extra = {"guidance_embedding": True} if self.scales is not None else {}
        student = FlowUNet2DModel(**{**unet.config, "step_size_embedding": True, **extra})
        if cfg.init_student:
            student.load_state_dict(self.init_student(unet.config).state_dict())
        else:
            missing = student.load_state_dict(unet.state_dict(), strict=False).missing_keys
            assert all(k.startswith(("step_mlp.", "guidance_mlp.")) for k in missing), missing
        self.judge = self.load_judge(unet.config, accelerator.device)
        self.autocast = accelerator.autocast
        companions = self.discriminator(unet.config, accelerator) if cfg.adversarial_weight > 0 else ()
        size = self.images.shape[-1]
        labels = torch.zeros(1, dtype=torch.long) if conditional else None
        flops = counted_training_flops(student, torch.zeros(1, 3, size, size), torch.zeros(1), labels)
        student = student.to(memory_format=torch.channels_last).train()
        scale, interval = self.guidance
        self.show_progress, self.last_grid = settings.progress and accelerator.is_local_main_process, None
        self.guide_name = teacher.config.get("guidance_model") if guide is not None else None
        by = f" by {self.guide_name}" if self.guide_name else ""
        told = (f"guidance w in {cfg.guidance_range} as the student's input (saved default {cfg.sample_guidance:g})"
                if self.scales is not None else f"guidance {scale:g}")
        accelerator.print(f"distilling {cfg.teacher} ({told}{by}, t in {format_interval(interval)}) into "
                          f"{cfg.sample_steps}-step Euler; {len(self.images):,} training images")
        if companions:
            accelerator.print(f"adversarial stage: weight {cfg.adversarial_weight:g} on {cfg.adversarial_steps}-step "
                              f"samples against real images, discriminator heads of "
                              f"{sum(p.numel() for p in companions[0].parameters()):,} parameters on the teacher's "
                              f"encoder at t = {cfg.disc_time:g}; shortcut term weight {cfg.distill_weight:g}")
        # the teacher's guided forward (2 rows) on every row, the student's two half steps on a quarter: ~4x a step's
        # forward FLOPs on top of the student's own forward and backward (the adversarial term's calls not counted)
        return TaskPlan(student, eval_steps=self.eval_steps(settings, accelerator), flops_per_unit=flops,
                        companions=companions)

    def check_data(self, config) -> None:
        """The real images must be the teacher's: its resolution, and its classes where it is class-conditional."""
        size, classes = self.images.shape[-1], config.num_classes
        if size != config.sample_size or self.images.shape[1] != config.in_channels:
            want = f"{config.in_channels}x{config.sample_size}x{config.sample_size}"
            raise SettingsError(f"--dataset {self.cfg.dataset} holds {self.images.shape[1]}x{size}x{size} images, the "
                                f"teacher was trained on {want}: pass the teacher's training set")
        if classes is not None:
            found = len(self.class_names) if self.class_names else int(self.labels.max()) + 1
            if found != classes:
                raise SettingsError(f"--dataset {self.cfg.dataset} has {found} classes, the teacher {classes}: pass "
                                    "the teacher's training set (or its --label_column)")

    def init_student(self, config) -> FlowUNet2DModel:
        """The finished student of ``--init_student``: a distilled folder of this teacher's shape."""
        cfg = self.cfg
        unet = load_pipeline_folder(cfg.init_student, cfg.verify, "--init_student").unet
        if not getattr(unet.config, "step_size_embedding", False):
            raise SettingsError(f"--init_student {cfg.init_student} is not a distilled pipeline (no step-size "
                                "embedding): pass a flow-distill output_dir, or leave --init_student out")
        theirs = {k: v for k, v in unet.config.items() if not k.startswith("_") and k != "step_size_embedding"}
        ours = {k: v for k, v in config.items() if not k.startswith("_") and k != "step_size_embedding"}
        if theirs != ours:
            odd = sorted(k for k in ours if theirs.get(k) != ours[k])
            raise SettingsError(f"--init_student {cfg.init_student} is a UNet of another shape than the teacher's "
                                f"({', '.join(f'{k} {theirs.get(k)} vs {ours[k]}' for k in odd)}): pass a student "
                                "distilled from this --teacher")
        self.data_hashes["init_student_weights"] = sha256_file(teacher_weights(cfg.init_student))
        return unet

    def load_judge(self, config, device):
        """The ``--judge`` classifier, checked against the teacher's classes (None without --judge)."""
        if not self.cfg.judge:
            return None
        if config.num_classes is None:
            raise SettingsError("--judge counts the classes of class-conditional samples; this teacher is "
                                "unconditional: leave --judge out")
        judge = load_classifier(self.cfg.judge, device)
        if judge.config.num_classes != config.num_classes:
            raise SettingsError(f"--judge {self.cfg.judge} tells {judge.config.num_classes} classes apart, the teacher "
                                f"has {config.num_classes}: pass a classifier trained on the teacher's data")
        return judge

    def discriminator(self, config, accelerator) -> tuple:
        """Trainable heads on the frozen teacher encoder's features, and their optimizer."""
        cfg, device = self.cfg, accelerator.device
        with torch.random.fork_rng(devices=[]):  # the heads' initial weights, the same in every run
            torch.manual_seed(0)
            self.disc = FeatureHeads(unet_feature_channels(config), cfg.disc_width).to(device)
        self.disc_optimizer = torch.optim.Adam(self.disc.parameters(), lr=cfg.disc_lr, betas=(0.0, 0.99),
                                               fused=device.type == "cuda")
        return self.disc, self.disc_optimizer

    def critic(self, generator):
        """D(x, labels): the heads on the teacher encoder's features of x at ``disc_time`` (noise from
        ``generator``)."""
        def judge(x, labels):
            with self.autocast():
                feats = unet_encoder_features(self.teacher, x, self.cfg.disc_time, labels, generator)
                return self.disc(feats)
        return judge

    def loss(self, model, batch, generator) -> torch.Tensor:
        """The shortcut term, plus the adversarial one: the discriminator is stepped first on this batch's real
        images and the student's samples (detached), then the student's GAN loss goes through the frozen critic."""
        cfg, x1, labels = self.cfg, batch["x1"], batch.get("labels")
        total = torch.zeros((), device=x1.device)
        if cfg.distill_weight > 0:
            total = total + cfg.distill_weight * self.shortcut_loss(model, batch, generator)
        if cfg.adversarial_weight > 0:
            student = _student(model)
            x0 = torch.empty_like(x1).normal_(generator=generator)
            fake = sample_in_steps(student, x0, row_steps(len(x0), cfg.adversarial_step_counts, x0.device), labels)
            critic = self.critic(generator)
            d_loss = discriminator_loss(critic, x1, fake, labels)
            self.disc_optimizer.zero_grad(set_to_none=True)
            d_loss.backward()  # the heads' gradient only: the fakes are detached, the teacher is frozen
            self.disc_optimizer.step()
            self.disc_optimizer.zero_grad(set_to_none=True)
            self.disc.requires_grad_(False)  # the student's term sees the heads as constants
            try:
                total = total + cfg.adversarial_weight * generator_loss(critic, fake, labels)
            finally:
                self.disc.requires_grad_(True)
        return total

    def shortcut_loss(self, model, batch, generator) -> torch.Tensor:
        """The shortcut objective of ``batch`` against the guided teacher; with ``guidance_range`` every row draws
        its own guidance scale, which the teacher is guided at and the student is told."""
        x1, cond = batch["x1"], batch.get("labels")
        t_flow = self.matcher.sample_time(self.objective.flow_rows(x1.shape[0]), x1.device, generator)
        if self.scales is not None:
            lo, hi = self.scales
            cond = (cond, lo + (hi - lo) * torch.rand(x1.shape[0], device=x1.device, generator=generator))
        return self.objective.loss(_student(model, self.scales is not None), self.teacher_fn, x1, t_flow, generator,
                                   cond)

    @torch.no_grad()
    def evaluate(self, model, settings, device) -> dict[str, float]:
        """The shortcut objective on held-out images with fixed noise, times and step sizes (comparable across steps;
        the adversarial term, a game against a moving critic, is left out), and the judge's figures."""
        gen = torch.Generator(device=device).manual_seed(1234)
        n, bs, total = len(self.val_images), settings.micro_batch_size, 0.0
        for start in range(0, n, bs):
            x1 = self.val_images[start : start + bs].float() / 127.5 - 1.0
            x1 = x1.contiguous(memory_format=torch.channels_last)
            labels = self.val_labels[start : start + bs] if self.val_labels is not None else None
            if len(x1) > 1:
                total += self.shortcut_loss(model, {"x1": x1, "labels": labels}, gen).item() * len(x1)
        figures = {"val_loss": total / n}
        if self.cfg.adversarial_weight > 0:
            figures["critic_gap"] = self.critic_gap(model, settings.micro_batch_size, device)
        if self.judge is not None:
            figures.update(self.judged(model, settings.micro_batch_size, device))
        return figures

    @torch.no_grad()
    def critic_gap(self, model, batch_size: int, device) -> float:
        """Mean critic score of held-out real images minus that of the student's samples of them (fixed noise, the
        adversarial step counts): near 0 the critic no longer tells them apart, large it wins."""
        gen = torch.Generator(device=device).manual_seed(1234)
        x1 = (self.val_images[:batch_size].float() / 127.5 - 1.0).contiguous(memory_format=torch.channels_last)
        labels = self.val_labels[:batch_size] if self.val_labels is not None else None
        x0 = torch.empty_like(x1).normal_(generator=gen)
        fake = sample_in_steps(_student(model), x0, row_steps(len(x0), self.cfg.adversarial_step_counts, device),
                               labels)
        critic = self.critic(gen)
        return (critic(x1, labels).float().mean() - critic(fake, labels).float().mean()).item()

    @torch.no_grad()
    def judged(self, model, batch_size: int, device) -> dict[str, float]:
        """The judge's view of ``judge_images`` samples (classes in turn, fixed noise, the saved default steps): the
        rarest predicted class's share and how often the predicted class is the one asked for."""
        pipe = self.pipeline(model)
        pipe.set_progress_bar_config(disable=True)
        k = model.config.num_classes
        labels = torch.arange(self.cfg.judge_images) % k
        gen = torch.Generator(device=device).manual_seed(4321)
        images = []
        for start in range(0, len(labels), batch_size):
            out = pipe(class_labels=labels[start : start + batch_size].tolist(), generator=gen, output_type="pt")
            images.append(out.images.float() * 2 - 1)
        _, logits = classify(self.judge, torch.cat(images), batch_size=batch_size)
        stats = class_statistics(logits.argmax(1), k, labels)
        return {"rarest_class_share": stats["class_share_min"], "judged_label_accuracy": stats["label_accuracy"]}

    def pipeline(self, model):
        """Euler with the distilled step sizes, ``sample_steps`` steps by default, guidance baked in (1 saved), or
        with ``guidance_range`` the student's guidance input: ``sample_guidance`` saved, the range recorded."""
        told = {"guidance_scale": self.cfg.sample_guidance, "guidance_range": list(self.scales)} if self.scales else {}
        return FlowMatchPipeline(unet=model, scheduler=FlowMatchEulerScheduler(),
                                 num_inference_steps=self.cfg.sample_steps, **{"guidance_scale": 1.0, **told})

    def on_saved(self, model, output_dir, log=print) -> dict:
        scale, interval = self.guidance
        return {**super().on_saved(model, output_dir, log), "teacher": self.cfg.teacher,
                "teacher_guidance_scale": scale, "teacher_guidance_interval": format_interval(interval),
                **({"teacher_guidance_model": self.guide_name} if self.guide_name else {})}


def _student(model, guided: bool = False):
    """student(x, t, d, labels): the model's average velocity over the step d it is told; ``guided``:
    student(x, t, d, (labels, w)), at the guidance scale w it is told too."""
    if guided:
        return lambda x, t, d, cond: model(x, t, cond[0], step_size=d, guidance=cond[1]).sample
    return lambda x, t, d, labels: model(x, t, labels, step_size=d).sample


def _per_row_guidance(teacher, x, t, cond):
    """``guided_teacher``'s teacher for rows conditioned on (labels, w): each row guided at its own w."""
    labels, scales = cond
    return teacher(x, t, labels, scales)


def teacher_weights(folder: str, component: str = "unet") -> Path:
    """The teacher UNet's (or its autoguidance model's) weights file (what the resume fingerprint hashes)."""
    found = sorted((Path(folder) / component).glob("diffusion_pytorch_model*.safetensors"))
    if not found:
        raise SettingsError(f"{folder}/{component} holds no diffusion_pytorch_model.safetensors; pass a saved flow "
                            "run")
    return found[0]


__all__ = ["FlowDistillTask"]
