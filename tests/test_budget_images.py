"""The image ledger (hf_cgpu/budget/images.py) against the real modules on the CPU: parameters, FLOPs, the tensors a
training forward saves, the live tensors of a no-grad call, the kernels, the network calls of the samplers and of the
distillation objective; and the figures of the shipped presets, pinned. Tiny shapes, a few seconds.

The CUDA-only tests (saved tensors under CUDA's autocast rules, the no-grad peak under autocast) are skipped on a CPU;
run this file on a GPU to check those rules too."""

from __future__ import annotations

import collections
import dataclasses
import json
import subprocess
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from hf_cgpu.budget import images as I
from hf_cgpu.budget.memory import BF16, FP32, FRAGMENTATION_FRACTION
from hf_cgpu.errors import MissingPathError, SettingsError
from hf_cgpu.evaluation.classifier import CifarResNet, ClassifierConfig, conv_bn
from hf_cgpu.flow.adversarial import (FeatureHeads, generator_loss, row_steps, sample_in_steps, unet_encoder_features,
                                      unet_feature_channels)
from hf_cgpu.flow.matching import FlowMatcher
from hf_cgpu.flow.samplers import SAMPLERS
from hf_cgpu.flow.samplers import evaluations_per_image as real_evaluations
from hf_cgpu.flow.shortcut import ShortcutObjective, guided_teacher
from hf_cgpu.flow.unet import FlowUNet2DModel, ResBlock
from hf_cgpu.settings import TrainSettings, parse_settings
from hf_cgpu.tasks.flow_distill import FlowDistillTask, _student
from hf_cgpu.tasks.settings import ClassifierSettings, FlowDistillSettings, FlowSettings

CUDA = torch.cuda.is_available()
UNETS = [  # (config, what it exercises)
    dict(base_channels=8, norm_num_groups=4, time_embed_dim=16, num_classes=None),
    dict(base_channels=8, norm_num_groups=4, time_embed_dim=16, num_classes=10),
    dict(base_channels=16, norm_num_groups=8, time_embed_dim=32, num_classes=10, step_size_embedding=True),
    dict(base_channels=8, norm_num_groups=4, time_embed_dim=16, num_classes=None, step_size_embedding=True,
         sample_size=16),
    dict(base_channels=8, norm_num_groups=4, time_embed_dim=16, num_classes=10, step_size_embedding=True,
         guidance_embedding=True),
]
WIDTHS = [[4, 8, 16, 32], [8, 8, 16, 16]]


def unet_module(cfg: dict) -> FlowUNet2DModel:
    torch.manual_seed(0)
    return FlowUNet2DModel(**cfg).to(memory_format=torch.channels_last)


def described(cfg: dict, device: str = "cuda") -> I.ImageNet:
    return I.flow_unet({**I.unet_config(), **cfg}, device)


def classifier_module(widths) -> CifarResNet:
    torch.manual_seed(0)
    return CifarResNet(ClassifierConfig(widths=list(widths))).to(memory_format=torch.channels_last)


def images(b: int, size: int = 32, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(b)
    return torch.randn(b, 3, size, size, generator=gen).to(device).contiguous(memory_format=torch.channels_last)


def flow_inputs(model, b: int, device: str = "cpu") -> tuple:
    """(x1, labels, step sizes) of a micro-batch for ``model``."""
    cfg = model.config
    labels = torch.arange(b, device=device) % cfg.num_classes if cfg.num_classes else None
    d = torch.rand(b, generator=torch.Generator().manual_seed(1)).to(device) if cfg.step_size_embedding else None
    return images(b, cfg.sample_size, device), labels, d


def flow_loss(model, x1, labels=None, d=None) -> torch.Tensor:
    """The flow task's loss (a distilled student also gets step sizes), its draws seeded."""
    gen = torch.Generator(device=x1.device).manual_seed(0)
    extra = {} if d is None else {"step_size": d}
    return FlowMatcher().loss(lambda xt, t, y=None: model(xt, t, y, **extra).sample, x1, labels,
                              null_class=model.config.num_classes, generator=gen)


def classifier_inputs(model, b: int, device: str = "cpu") -> tuple:
    return images(b, device=device), torch.arange(b, device=device) % model.config.num_classes


def classifier_loss(model, x, labels) -> torch.Tensor:
    return F.cross_entropy(model(x).float(), labels, label_smoothing=0.2)


# ---- parameters and FLOPs (structural: exact) -----------------------------------------------------------------------


@pytest.mark.parametrize("cfg", UNETS)
def test_unet_parameters_are_the_modules(cfg):
    model, net = unet_module(cfg), described(cfg)
    assert {n: k for n, k, _ in net.param_tensors()} == {n: p.numel() for n, p in model.named_parameters()}
    assert net.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("widths", WIDTHS)
def test_classifier_parameters_are_the_modules(widths):
    model, net = classifier_module(widths), I.cifar_resnet(widths)
    assert {n: k for n, k, _ in net.param_tensors()} == {n: p.numel() for n, p in model.named_parameters()}


def test_preset_widths_give_the_documented_sizes():
    # FlowSettings.base_channels: 128 -> 6.1M, 160 -> 9.3M, 192 -> 13.3M; ClassifierSettings.widths: 6.57M
    assert [round(I.flow_unet(I.unet_config(c, False)).params / 1e6, 1) for c in (128, 160, 192)] == [6.1, 9.3, 13.3]
    assert round(I.cifar_resnet([64, 128, 256, 512]).params / 1e6, 2) == 6.57


def _flops(fn) -> float:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("cfg", UNETS)
def test_unet_flops_match_flop_counter(cfg):
    model, net = unet_module(cfg), described(cfg)
    b = 3
    x, t = images(b, cfg.get("sample_size", 32)), torch.rand(b)
    y = torch.arange(b) % cfg["num_classes"] if cfg["num_classes"] else None
    d = torch.rand(b) if cfg.get("step_size_embedding") else None
    with torch.no_grad():
        forward = _flops(lambda: model(x, t, y, step_size=d))
    assert net.forward_flops(b) == forward
    assert sum(g.flops for g in net.gemms(b, backward=False)) == forward
    # forward + backward: every product (input and weight gradients) as the counter sees them
    inputs = flow_inputs(model, b)
    assert sum(g.flops for g in net.gemms(b)) == _flops(lambda: flow_loss(model, *inputs).backward())


@pytest.mark.parametrize("widths", WIDTHS)
def test_classifier_flops_match_flop_counter(widths):
    model, net = classifier_module(widths), I.cifar_resnet(widths)
    with torch.no_grad():
        assert net.forward_flops(2) == _flops(lambda: model(images(2)))
    inputs = classifier_inputs(model, 2)
    assert sum(g.flops for g in net.gemms(2)) == _flops(lambda: classifier_loss(model, *inputs).backward())


# ---- saved tensors: a trace of what autograd keeps, per image --------------------------------------------------------


def saved_per_image(model, inputs_fn, loss_fn, device: str) -> dict[int, int]:
    """Elements per image of the unique storages autograd saves, by bytes per element, under bf16 autocast on
    ``device``: the difference between 3 and 2 images (the weights' casts and per-batch statistics cancel)."""

    def trace(b: int) -> dict[int, int]:
        storages: dict[int, tuple[int, int]] = {}
        inputs = inputs_fn(model, b, device)

        def pack(t):
            s = t.untyped_storage()
            storages[s.data_ptr()] = (s.nbytes(), t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = loss_fn(model, *inputs)
        out: dict[int, int] = collections.Counter()
        for nbytes, size in storages.values():
            out[size] += nbytes // size
        del loss
        return out

    two, three = trace(2), trace(3)
    return {size: three[size] - two.get(size, 0) for size in three if three[size] != two.get(size, 0)}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="CUDA autocast rules need a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", UNETS[:3])
def test_unet_saved_tensors_match_a_trace(cfg, device):
    model = unet_module(cfg).to(device)
    traced = saved_per_image(model, flow_inputs, flow_loss, device)
    assert traced == described(cfg, device).saved_elements_by_dtype()


@pytest.mark.parametrize("device", DEVICES)
def test_classifier_saved_tensors_match_a_trace(device):
    model = classifier_module(WIDTHS[0]).to(device).train()
    traced = saved_per_image(model, classifier_inputs, classifier_loss, device)
    assert traced == I.cifar_resnet(WIDTHS[0]).saved_elements_by_dtype()


def test_cuda_rules_save_fp32_norm_inputs_where_the_cpu_saves_bf16():
    cfg = UNETS[1]
    cuda, cpu = described(cfg, "cuda"), described(cfg, "cpu")
    # GroupNorm's input and output: fp32 under CUDA autocast, bf16 on the CPU, the same elements otherwise
    assert cuda.saved_elements_by_dtype()[4] > cpu.saved_elements_by_dtype()[4]
    assert cuda.saved_bytes > 1.5 * cpu.saved_bytes


# ---- the live tensors of a no-grad call --------------------------------------------------------------------------


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops create and that are still referenced (a CPU stand-in for
    max_memory_allocated): each new output storage counts until its tensor is collected."""

    def __init__(self, base: int = 0):
        super().__init__()
        self.live: dict[int, int] = {}
        self.base = base
        self.peak = base

    def _drop(self, ptr: int) -> None:
        self.live.pop(ptr, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not func.is_view:
                ptr = t.untyped_storage().data_ptr()
                if ptr and ptr not in self.live:
                    self.live[ptr] = t.untyped_storage().nbytes()
                    weakref.finalize(t, self._drop, ptr)
        self.peak = max(self.peak, self.base + sum(self.live.values()))
        return out


@pytest.mark.parametrize("cfg", UNETS)
def test_unet_nograd_peak_matches_live_tensors_fp32(cfg):
    model = unet_module(cfg).to(memory_format=torch.contiguous_format)  # as hf-cgpu sample loads it: fp32, NCHW
    b, s = 3, cfg.get("sample_size", 32)
    x = torch.randn(b, 3, s, s)
    y = torch.arange(b) % cfg["num_classes"] if cfg["num_classes"] else None
    d = torch.rand(b) if cfg.get("step_size_embedding") else None
    live = LiveBytes(base=x.nbytes)
    with torch.no_grad(), live:
        model(x, torch.rand(b), y, step_size=d)
    predicted = I.unet_inference(cfg, bf16=False).peak * b
    assert abs(live.peak - predicted) / predicted < 0.01


@pytest.mark.parametrize("cfg", UNETS[:2])
def test_the_critics_encoder_call_peak_matches_live_tensors_fp32(cfg):
    model = unet_module(cfg).to(memory_format=torch.contiguous_format)
    b = 3
    x = torch.randn(b, 3, 32, 32)
    y = torch.arange(b) % cfg["num_classes"] if cfg["num_classes"] else None
    live = LiveBytes(base=x.nbytes)
    with torch.no_grad(), live:
        unet_encoder_features(model, x, 1.0, y)
    predicted = I.unet_inference(cfg, bf16=False, encoder=True).peak * b
    assert abs(live.peak - predicted) / predicted < 0.01


@pytest.mark.skipif(not CUDA, reason="max_memory_allocated needs a GPU")
@pytest.mark.parametrize("channels_last", [False, True])
def test_unet_nograd_peak_under_cuda_autocast(channels_last):
    cfg = dict(base_channels=64, norm_num_groups=8, time_embed_dim=64, num_classes=10)
    model = FlowUNet2DModel(**cfg).cuda()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    b = 64
    x = torch.randn(b, 3, 32, 32, device="cuda").contiguous(memory_format=fmt)
    t, y = torch.rand(b, device="cuda"), torch.arange(b, device="cuda") % 10
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(x, t, y)  # warm-up: cuDNN's plans and workspaces
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() - x.nbytes
        model(x, t, y)
    measured = torch.cuda.max_memory_allocated() - before
    predicted = I.unet_inference(cfg, bf16=True, channels_last=channels_last).peak * b
    assert abs(measured - predicted) / predicted < 0.1, (measured, predicted)


# ---- kernels ------------------------------------------------------------------------------------------------------


class Kernels(TorchDispatchMode):
    """Ops that launch a kernel (views and detach launch none)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func is not torch.ops.aten.detach.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def kernels_of(step) -> int:
    counter = Kernels()
    with counter:
        step()
    return counter.n


def forward_backward(module, *inputs) -> int:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grad = torch.ones_like(module(*inputs))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(*inputs)
        out.backward(grad)

    return kernels_of(step)


@pytest.mark.parametrize("skip", [False, True])
def test_resblock_kernels(skip):
    block = ResBlock(8, 16 if skip else 8, 16, 4).to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 8, 8, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    assert forward_backward(block, x.requires_grad_(), torch.randn(2, 16, requires_grad=True)) \
        == I.KERNELS_PER_RESBLOCK[skip]


def test_conv_bn_kernels():
    x = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    assert forward_backward(conv_bn(4, 8).to(memory_format=torch.channels_last), x.requires_grad_()) \
        == I.KERNELS_CONV_BN


@pytest.mark.parametrize("cfg", UNETS)
def test_unet_step_and_call_kernels(cfg):
    model, net = unet_module(cfg), described(cfg, "cpu")
    x, y, d = flow_inputs(model, 2)
    t = torch.rand(2)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = flow_loss(model, x, y, d)
        loss.backward()

    def call():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(x, t, y, step_size=d)

    assert (kernels_of(step), kernels_of(call)) == (net.kernels, net.call_kernels)


def test_classifier_step_kernels():
    model = classifier_module(WIDTHS[0]).train()
    inputs = classifier_inputs(model, 2)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = classifier_loss(model, *inputs)
        loss.backward()

    assert kernels_of(step) == I.cifar_resnet(WIDTHS[0]).kernels


# ---- network calls: samplers and the distillation objective ------------------------------------------------------


def test_every_registered_sampler_is_counted():
    for name in SAMPLERS:
        assert I.sampler_calls(name, 3)
    with pytest.raises(SettingsError, match="euler and heun"):
        I.sampler_calls("dpm", 3)


@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("interval", [None, (0.25, 0.8), (0.15, 0.8), (0.0, 0.5), (0.5, 1.0)])
def test_evaluations_match_the_schedulers(sampler, interval):
    for steps in range(1, 13):
        for scale in (1.0, 2.5):
            assert I.evaluations_per_image(sampler, steps, scale, interval) == \
                real_evaluations(sampler, steps, scale, interval), (steps, scale)


@pytest.mark.parametrize("mode", ["cfg", "guide", "none"])
@pytest.mark.parametrize("levels, fraction", [(7, 0.25), (3, 0.5), (1, 0.9)])
def test_distill_calls_match_the_objective(mode, levels, fraction):
    for batch in (2, 3, 8, 17, 64, 256):
        calls: list[tuple[str, int]] = []

        def net(who):
            def fn(x, t, *rest):
                if not torch.is_grad_enabled():
                    calls.append((who, x.shape[0]))
                return torch.zeros_like(x) + t.reshape(-1, 1, 1, 1)

            return fn

        labels = torch.arange(batch) % 10 if mode != "none" else None
        teacher = guided_teacher(net("teacher"), 10, 1.0 if mode == "none" else 2.0, (0.25, 0.8),
                                 guide_fn=net("guide") if mode == "guide" else None)
        obj = ShortcutObjective(levels, fraction)
        x1 = torch.randn(batch, 3, 2, 2)
        obj.loss(net("student"), teacher, x1, torch.rand(obj.flow_rows(batch)), None, labels)
        rows = I.distill_rows(batch, levels, fraction, mode)
        assert list(rows.calls) == calls, batch
        assert rows.flow == obj.flow_rows(batch)


# ---- the adversarial stage: the critic and the student's calls, against FlowDistillTask.loss -----------------------

TEACHER = dict(base_channels=8, norm_num_groups=4, time_embed_dim=16, num_classes=10)


@pytest.mark.parametrize("cfg", [TEACHER, {**TEACHER, "num_classes": None, "sample_size": 16}])
def test_critic_parameters_are_the_modules(cfg):
    teacher = unet_module(cfg)
    critic = I.critic_nets(cfg, 16)
    heads = FeatureHeads(unet_feature_channels(teacher.config), 16)
    assert {n: k for n, k, _ in critic.heads.param_tensors()} == {n: p.numel() for n, p in heads.named_parameters()}
    encoder = ("in_conv.", "time_mlp.", "class_embedding.", "d1.", "down1.", "d2.", "down2.", "mid.")
    assert {n: k for n, k, _ in critic.encoder.param_tensors()} == \
        {n: p.numel() for n, p in teacher.named_parameters() if n.startswith(encoder)}


class Autocast(torch.nn.Module):
    """A model whose every call runs under its own bf16 autocast, as Accelerate's ``prepare`` wraps the student."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(*args, **kwargs)


def adversarial_task(tcfg: dict, steps: str = "1,2", distill_weight: float = 0.0):
    """(FlowDistillTask with its teacher, critic and shortcut objective as ``setup`` builds them, the student as the
    loop prepares it): the real ``loss`` on tiny modules, the heads' Adam fused as on CUDA."""
    teacher = unet_module(tcfg).eval().requires_grad_(False)
    student = Autocast(unet_module({**tcfg, "step_size_embedding": True}).train())
    cfg = FlowDistillSettings(adversarial_weight=0.1, distill_weight=distill_weight, disc_width=8,
                              adversarial_steps=steps)
    task = FlowDistillTask(cfg)
    task.teacher, task.scales = teacher, None
    task.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    task.discriminator(teacher.config, SimpleNamespace(device=torch.device("cpu")))
    task.disc_optimizer = torch.optim.Adam(task.disc.parameters(), lr=cfg.disc_lr, betas=(0.0, 0.99), fused=True)
    task.teacher_fn = guided_teacher(lambda x, t, y: teacher(x, t, y).sample, tcfg["num_classes"], 2.0, (0.25, 0.8))
    task.objective, task.matcher = ShortcutObjective(cfg.levels, cfg.consistency_fraction), FlowMatcher()
    return task, student


def adversarial_step(task, student, b: int):
    """One micro-batch of ``task.loss`` and its backward, the student's gradients cleared first as the loop does."""
    x1 = images(b)
    labels = torch.arange(b) % 10 if task.teacher.config.num_classes else None
    gen = torch.Generator().manual_seed(0)

    def step():
        student.zero_grad(set_to_none=True)
        task.loss(student, {"x1": x1, "labels": labels}, gen).backward()

    step()  # the heads' Adam creates its moments on the first step
    return step


@pytest.mark.parametrize("device", DEVICES)
def test_critic_and_fake_calls_save_what_the_ledger_counts(device):
    """Per image: the critic's pass over the fakes saves the frozen encoder's and the heads' tensors (the student's
    gradient goes through them); each student call of the fake sampling saves a training call's tensors but the
    loss's (its labels and row masks, a few bytes a row, aside)."""
    teacher = unet_module(TEACHER).to(device).eval().requires_grad_(False)
    heads = FeatureHeads(unet_feature_channels(teacher.config), 8).to(device).requires_grad_(False)
    critic = I.critic_nets(TEACHER, 8, device)

    def fakes(model, b, dev):
        return images(b, device=dev).requires_grad_(), torch.arange(b, device=dev) % 10

    traced = saved_per_image(teacher, fakes, lambda m, x, y: generator_loss(
        lambda z, c: heads(unet_encoder_features(m, z, 0.8, c)), x, y), device)
    assert traced == dict(collections.Counter(critic.encoder.saved_elements_by_dtype())
                          + collections.Counter(critic.heads.saved_elements_by_dtype()))
    student = unet_module({**TEACHER, "step_size_embedding": True}).to(device)
    net = described({**TEACHER, "step_size_embedding": True}, device)
    call = net.saved_elements_by_dtype()
    call[FP32] -= net.saved_by_kind()[I.FLOW_LOSS_SAVED] // FP32
    for counts in ((1,), (2,), (3,)):  # the third image adds one row of counts[0] calls
        def sampled(m, x0, y):
            return sample_in_steps(_student(m), x0, row_steps(len(x0), counts, x0.device), y).sum()

        traced = saved_per_image(student, lambda m, b, dev: (images(b, device=dev), torch.arange(b, device=dev) % 10),
                                 sampled, device)
        assert (traced[BF16], traced[FP32]) == (counts[0] * call[BF16], counts[0] * call[FP32])
        assert sum(n * size for size, n in traced.items() if size in (I.INT64, I.BOOL)) <= 16


@pytest.mark.parametrize("tcfg", [TEACHER, {**TEACHER, "num_classes": None}])
@pytest.mark.parametrize("steps", ["1", "2", "1,2", "3"])
def test_adversarial_term_products_and_kernels_match_the_loss(tcfg, steps):
    """The products and kernels of FlowDistillTask's adversarial term on a micro-batch, as FlopCounterMode and a
    dispatch trace count them: the student's calls with a backward, the critic's no-grad encoder call and the heads'
    training on real and fake rows, the heads' Adam, the encoder's and heads' backward to the fakes only; and with
    the shortcut term beside it, the kernels it adds to that term's."""
    b = 4
    cfg = FlowDistillSettings(adversarial_weight=0.1, distill_weight=0.0, disc_width=8, adversarial_steps=steps)
    work = I.image_step_work("flow-distill", cfg, TrainSettings(micro_batch_size=b, gradient_accumulation_steps=1,
                                                                compile=False), teacher_config=tcfg)
    task, student = adversarial_task(tcfg, steps)
    assert work.gemm_flops == _flops(adversarial_step(task, student, b))
    net = described({**tcfg, "step_size_embedding": True}, "cpu")
    critic, calls = I.critic_nets(tcfg, 8, "cpu"), I.adversarial_calls(b, cfg.adversarial_step_counts)
    assert kernels_of(adversarial_step(task, student, b)) == critic.kernels(net, calls, False, "cpu")
    with_shortcut = kernels_of(adversarial_step(*adversarial_task(tcfg, steps, distill_weight=1.0), b))
    task, student = adversarial_task(tcfg, steps, distill_weight=1.0)
    task.cfg = dataclasses.replace(task.cfg, adversarial_weight=0.0)
    assert with_shortcut - kernels_of(adversarial_step(task, student, b)) == critic.kernels(net, calls, True, "cpu")


ADVERSARIAL_ROWS = ("discriminator", "fake_activations", "critic_activations")


def test_the_adversarial_stage_is_priced_in_closed_forms():
    """The gan preset's rows: the heads' fp32 weights and Adam moments, the student's calls' tensors (the training
    call's without its loss, on every row of every call), the critic's tensors per fake, all linear in the batch;
    weight 0 leaves every other row and the step's other work as they were."""
    cfg, train = preset("flow-distill", "cifar10-gan")
    led, work = I.image_ledger("flow-distill", cfg, train), I.image_step_work("flow-distill", cfg, train)
    net, s, b = led.net, led.net.image_size, train.micro_batch_size
    heads = sum(p.numel() for p in FeatureHeads(unet_feature_channels(I.unet_config()), cfg.disc_width).parameters())
    assert led.row("discriminator") == 3 * FP32 * heads  # weights, m, v
    calls = I.adversarial_calls(b, cfg.adversarial_step_counts)
    assert (calls.calls, calls.call_rows) == (3, 3 * b // 2)  # 1,2: half the rows in one call, half in two
    call = net.saved_bytes - FP32 * 2 * 3 * s * s
    assert led.row("fake_activations") == call * calls.call_rows + 2 * FP32 * 3 * s * s * b
    critic = I.critic_nets(I.unet_config(), cfg.disc_width)
    assert led.row("critic_activations") == (critic.encoder.saved_bytes + critic.heads.saved_bytes) * b
    twice = I.image_ledger("flow-distill", cfg, dataclasses.replace(train, micro_batch_size=2 * b))
    for key in ADVERSARIAL_ROWS[1:]:
        assert twice.row(key) == 2 * led.row(key)
    assert twice.row("discriminator") == led.row("discriminator")
    assert led.peak_phase == "discriminator step" and led.allocated > I.image_ledger(
        "flow-distill", cfg, train).row("activations") + led.row("fake_activations")
    off = dataclasses.replace(cfg, adversarial_weight=0.0)
    led0, work0 = I.image_ledger("flow-distill", off, train), I.image_step_work("flow-distill", off, train)
    assert led0.rows == tuple(r for r in led.rows if r.key not in ADVERSARIAL_ROWS)
    assert (round(led0.allocated / GiB, 3), work0.kernels + work0.optimizer_kernels) == (2.070, 1047)
    ours = ("fake sample call", "critic", "discriminator heads")
    assert work0.gemms == tuple(g for g in work.gemms if not g.label.startswith(ours))
    assert work.kernels - work0.kernels == critic.kernels(net, calls, True)
    assert work.model_flops == work0.model_flops  # what the trainer's MFU counts: the student's training call
    alone = I.image_step_work("flow-distill", dataclasses.replace(cfg, distill_weight=0.0), train)
    assert not any(g.label.startswith(("teacher", "student")) for g in alone.gemms)
    assert I.image_ledger("flow-distill", dataclasses.replace(cfg, distill_weight=0.0), train).row("activations") == 0


# ---- the ledger: bad input, speed, the shipped presets ------------------------------------------------------------


def preset(task: str, name: str = "cifar10", *argv: str):
    cls = {"flow": FlowSettings, "flow-distill": FlowDistillSettings, "classifier": ClassifierSettings}[task]
    return parse_settings((cls, TrainSettings), ["--preset", name, *argv], family=task,
                          fixed={"train_mode": cls.train_mode})


def test_refuses_what_the_run_refuses():
    cfg, train = preset("flow", "cifar10", "--recompute", "true")
    with pytest.raises(SettingsError, match="--recompute"):
        I.image_ledger("flow", cfg, train)
    with pytest.raises(SettingsError, match="flow, flow-distill, classifier"):
        I.image_step_work("toy", cfg, train)
    with pytest.raises(SettingsError, match="micro_batch_size >= 2"):
        I.image_ledger("flow-distill", *preset("flow-distill", "cifar10", "--micro_batch_size", "1"))
    with pytest.raises(MissingPathError, match="model_index.json"):
        I.read_pipeline("/nonexistent")


def test_no_torch_and_quick():
    code = ("import sys, time; from hf_cgpu.budget import images as I; "
            "from hf_cgpu.settings import TrainSettings; from hf_cgpu.tasks.settings import FlowDistillSettings; "
            "t = time.perf_counter(); "
            "cfg, s = FlowDistillSettings(), TrainSettings(micro_batch_size=256, ema_decay=0.999); "
            "I.image_ledger('flow-distill', cfg, s); I.image_step_work('flow-distill', cfg, s); "
            "I.sample_work(I.unet_config(), 10000, 6, 'heun', 2.5, (0.25, 0.8), 500); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) < 0.1  # the arithmetic; importing the ledger is the command's own cost


def test_read_pipeline(tmp_path):
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps(I.unet_config(160)))
    (tmp_path / "model_index.json").write_text(json.dumps({
        "scheduler": ["hf_cgpu.flow.scheduling_flow_match", "FlowMatchHeunScheduler"], "num_inference_steps": 6,
        "guidance_scale": 2.5, "guidance_interval": [0.25, 0.8], "guide_unet": [None, None]}))
    info = I.read_pipeline(tmp_path)
    assert (info.sampler, info.steps, info.guidance_interval, info.guide) == ("heun", 6, (0.25, 0.8), False)
    assert I.flow_unet(info.unet).params == I.flow_unet(I.unet_config(160)).params


def test_distill_teacher_runs_in_fp32_and_shapes_the_student():
    cfg, train = preset("flow-distill")
    big = I.unet_config(160)
    led = I.image_ledger("flow-distill", cfg, train, teacher_config=big)
    teacher = I.flow_unet(big)
    assert led.row("teacher") == 4 * teacher.params
    assert led.net.params == teacher.params + 2 * (256 * 256 + 256)  # the step-size MLP
    guided = I.image_ledger("flow-distill", cfg, train, teacher_config=big, guide=True)
    assert guided.row("teacher") == 8 * teacher.params  # the autoguidance guide is a second fp32 UNet


def test_sampling_scales_with_the_calls():
    unet = I.unet_config()
    one = I.sample_work(unet, 64, 6, "heun")
    guided = I.sample_work(unet, 64, 6, "heun", 2.5)
    assert one.model_flops == 11 * 64 * I.flow_unet(unet).forward_flops()  # heun 6 steps: 11 calls
    assert guided.model_flops == 2 * one.model_flops
    assert I.sample_work(unet, 64, 6, "heun", 2.5, (0.25, 0.8)).model_flops == 17 / 11 * one.model_flops
    mem = I.sample_memory(unet, 64, 6, "heun", 2.5)
    assert mem.row("activations") == 2 * I.sample_memory(unet, 64, 6, "heun").row("activations")
    outside = I.sample_memory(unet, 64, 2, "euler", 2.5, (0.6, 1.0))  # Euler at t = 0 and 0.5: none guided
    assert outside.row("activations") == I.sample_memory(unet, 64, 2, "euler").row("activations")
    assert I.sample_memory(unet, 64, 6, "heun", 2.5, batch_size=16).allocated < mem.allocated
    told = I.unet_config(step_size_embedding=True) | {"guidance_embedding": True}  # told w: one call at any w
    assert I.sample_work(told, 64, 2, "euler", 2.5).model_flops == 2 * 64 * I.flow_unet(told).forward_flops()
    assert I.sample_memory(told, 64, 2, "euler", 2.5).row("activations") == I.sample_memory(
        told, 64, 2, "euler").row("activations")


def test_a_guidance_range_prices_its_student_and_a_teacher_guided_at_every_scale():
    """With --guidance_range the student carries the guidance MLP and the teacher runs guided (two rows) on every
    row, even where the teacher folder's scale is 1."""
    train = TrainSettings(micro_batch_size=8, gradient_accumulation_steps=1, compile=False)
    plain = FlowDistillSettings(guidance_scale=1.0)
    ranged = FlowDistillSettings(guidance_scale=1.0, guidance_range="1:3")
    tdim = I.UNET_TIME_EMBED_DIM
    assert I.task_net("flow-distill", ranged).params == I.task_net("flow-distill", plain).params + 2 * (tdim + 1) * tdim

    def teacher_flops(cfg):
        gemms = I.image_step_work("flow-distill", cfg, train).gemms
        return sum(g.flops for g in gemms if g.label.startswith("teacher"))

    assert teacher_flops(ranged) == 2 * teacher_flops(plain)


GiB = 2**30
PINNED = {  # the shipped presets as the ledger prices them: a change to the arithmetic shows here
    "flow": dict(params=6_081_667, saved=13_995_720, allocated=2.278, total=5.774, phase="backward start",
                 gemm_tflop=2.8185, model_tflop=2.8204, kernels=284.86),
    "flow-distill": dict(params=6_213_251, saved=13_997_256, allocated=2.858, total=5.392,
                         phase="teacher call (384 rows)", gemm_tflop=6.2855, model_tflop=2.8206, kernels=931.26),
    "classifier": dict(params=6_573_120, saved=2_841_649, allocated=1.744, total=2.507, phase="backward start",
                       gemm_tflop=1.1633, model_tflop=1.1651, kernels=124.14),
}


@pytest.mark.parametrize("task", list(PINNED))
def test_preset_figures_are_pinned(task):
    cfg, train = preset(task)
    led = I.image_ledger(task, cfg, train, 16 * GiB)
    work = I.image_step_work(task, cfg, train)
    got = dict(params=led.net.params, saved=led.net.saved_bytes, allocated=round(led.allocated / GiB, 3),
               total=round(led.total / GiB, 3),
               phase=led.peak_phase, gemm_tflop=round(work.gemm_flops / 1e12, 4),
               model_tflop=round(work.model_flops / 1e12, 4),
               kernels=round(work.kernels + work.optimizer_kernels, 2))
    assert got == PINNED[task]
    assert led.fits and work.samples == train.micro_batch_size


def test_compile_and_cuda_graphs():
    """A compiled UNet step keeps a share of the eager tensors; CUDA graphs and the eager moments' blocks add to
    reserved, not to allocated."""
    eager, default, graphs = (I.image_ledger("flow", *preset("flow", "cifar10", *argv)) for argv in
                              (["--compile", "false"], ["--compile_mode", "default"], []))
    assert default.row("activations") == I.COMPILED_ACTIVATION_SHARE["unet"] * eager.row("activations")
    assert eager.reserved - eager.allocated == pytest.approx(FRAGMENTATION_FRACTION * eager.allocated)
    assert graphs.allocated == default.allocated
    assert graphs.reserved - default.reserved == pytest.approx(I.CUDA_GRAPH_POOL_SHARE * default.row("activations"))
    # the eager evaluation's blocks (a micro-batch of 256 no-grad rows) are kept beside the compiled step's
    assert default.row("eager_blocks") == dict(default.phases)["evaluation"] - default.row("weights") - \
        default.row("optimizer") - default.row("ema") - default.row("dataset") - default.row("workspace")


@pytest.mark.parametrize("argv", [[], ["--class_labels", "1"], ["--class_labels", "1", "--guidance_scale", "3",
                                                                 "--guidance_interval", "full"],
                                  ["--class_labels", "0", "--scheduler", "euler", "--num_inference_steps", "2"]])
def test_budget_sample_prices_what_sample_draws(tmp_path, argv):
    """``hf-cgpu budget --task sample DIR FLAGS`` resolves the steps, sampler, guidance and interval as ``hf-cgpu
    sample DIR FLAGS`` does for the saved pipeline, and prices that many network evaluations per image."""
    from hf_cgpu.commands import budget as B
    from hf_cgpu.flow.pipeline_flow_match import FlowMatchPipeline
    from hf_cgpu.flow.sample_settings import SampleSettings
    from hf_cgpu.flow.samplers import sampler_class
    from sampler_checks import tiny_pipeline

    pipe = tiny_pipeline("heun")
    pipe.register_to_config(num_inference_steps=5, guidance_scale=2.0, guidance_interval=[0.2, 0.9])
    pipe.save_pretrained(tmp_path)
    job, _ = B.sample_job([str(tmp_path), "--num_images", "4", *argv])
    loaded = FlowMatchPipeline.from_pretrained(tmp_path)
    flags = dict(zip(argv[::2], argv[1::2]))
    s = SampleSettings(num_images=4, **{k[2:]: int(v) if k == "--num_inference_steps" else
                                        float(v) if k == "--guidance_scale" else v for k, v in flags.items()})
    kw = s.sampling(loaded)
    assert (job["steps"], job["guidance_scale"], job["guidance_interval"]) == (
        kw["num_inference_steps"], kw["guidance_scale"], kw["guidance_interval"])
    assert job["sampler"] == flags.get("--scheduler", "heun")
    rows = []
    loaded.unet.register_forward_pre_hook(lambda m, args: rows.append(len(args[0])))
    if "--scheduler" in flags:
        loaded.scheduler = sampler_class(flags["--scheduler"])()
    labels = [int(flags["--class_labels"])] * 4 if "--class_labels" in flags else None
    loaded(4, generator=torch.Generator().manual_seed(0), class_labels=labels, output_type="np", **kw)
    work = I.sample_work(**job)
    assert work.model_flops == sum(rows) * I.flow_unet(job["unet"]).forward_flops()
    report = B.run(["--task", "sample", str(tmp_path), "--num_images", "4", *argv])
    assert f"{sum(rows) / 4:g} network evaluations per image" in report and "images/s" in report


def test_budget_sample_refuses_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hf_cgpu.cli", "budget", "--task", "sample", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "model_index.json" in out.stderr
