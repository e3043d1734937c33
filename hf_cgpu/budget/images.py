"""The ledger of the image tasks: the flow UNet (``train flow``), its few-step distillation (``train flow-distill``),
the CIFAR classifier (``train classifier``) and sampling (``hf-cgpu sample`` / ``eval``), in memory and in time.

Torch-free like the rest of the ledger: each network is described by its layers (``ImageNet``), built from the
task's settings or a saved ``config.json`` exactly as the task builds the module, and everything is counted from
that description.

Structural (exact, checked against the real modules on the CPU by tests/test_budget_images.py):
    parameters; the products of one image (a convolution is the implicit product of its unfolded input,
    ``Gemm(m = B H_out W_out, n = C_out, k = C_in kh kw)``: forward, input gradient, weight gradient) and the
    forward FLOPs torch's ``FlopCounterMode`` counts (what the trainer's MFU uses); the tensors a training forward
    saves for its backward under bf16 autocast, per tensor and dtype (``AUTOCAST``: CUDA runs GroupNorm in fp32,
    the CPU in bf16); the live tensors of a no-grad forward (``unet_inference``); the network calls of the
    distillation objective, of its adversarial stage (``adversarial_calls``, the critic: ``critic_nets``) and of a
    sampler (``sampler_calls``); the data each task keeps on the device.
Fitted or assumed (named constants below, to be calibrated against GPU measurements): what a compiled step keeps
of the eager tensors (``torch.compile``'s partitioner recomputes elementwise work in the backward), the CUDA-graph
pool and the eager moments' blocks beside a compiled step (reserved, not allocated), the CUDA rules' extra kernels,
the bytes the memory-bound kernels move per saved byte (``work.ELEMENTWISE_PASSES``), the cost of an fp32 (TF32)
product, the batch-preparation traffic, and the data set's size where the command line does not say it (CIFAR-10's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import MissingPathError, SettingsError
from ..optim import optimizer_spec
from ..options import CUDA_GRAPH_MODES
from .memory import (
    BF16,
    CUDA_CONTEXT_BYTES,
    FP32,
    FRAGMENTATION_FRACTION,
    WORKSPACE_BYTES,
    Row,
    Totals,
    fmt_gib,
)
from .shape import fmt_count
from .work import (
    COMPILED_KERNEL_SHARE,
    ELEMENTWISE_PASSES,
    OPTIMIZER_BYTES_PER_PARAM,
    OPTIMIZER_KERNELS,
    Gemm,
    StepWork,
)

INT64 = 8
UINT8 = BOOL = 1

# ---- data (structural: what the tasks load; the sizes are CIFAR-10's where the command line does not say) --------
CIFAR10_TRAIN_IMAGES = 50_000
"""Images of CIFAR-10's train split: the data set the presets train on (``--limit`` takes fewer)."""
CIFAR10_TEST_IMAGES = 10_000
"""Images of CIFAR-10's test split: the classifier keeps all of them (``--test_limit`` takes fewer)."""
FLOW_VALIDATION_IMAGES = 1024
"""The flow tasks keep the first 1024 test images for the validation loss (``FlowMatchingTask.load_data``)."""
DEFAULT_IMAGE_SIZE = 32
"""Image side of the data set (CIFAR-10); the UNet's ``sample_size`` and the classifier's ``image_size`` follow it."""
DEFAULT_NUM_CLASSES = 10
"""Classes of the data set (CIFAR-10): a class-conditional UNet has one more embedding row (the null class)."""
UNET_TIME_EMBED_DIM = 256
"""``FlowUNet2DModel``'s default ``time_embed_dim``; the flow task does not change it."""
UNET_GROUPS = 8
"""``FlowUNet2DModel``'s default ``norm_num_groups``; the flow task does not change it."""
HEAD_GROUPS = 8
"""``FeatureHeads``' GroupNorm groups (``GroupNorm(8, width)``)."""
FLOW_LOSS_SAVED = "loss (fp32 prediction and target)"
"""What a flow training call saves for its loss: a call of the adversarial stage's sampling has no loss of its own."""
GRID_IMAGES_PER_CLASS = 8
"""A flow run's sample grid: 8 images per class (``FlowMatchingTask.on_evaluate``), 64 without classes."""

# ---- fitted or assumed (to calibrate) ----------------------------------------------------------------------------
COMPILED_ACTIVATION_SHARE = {"unet": 0.57, "classifier": 1.0}
"""What a compiled training step saves, as a share of the eager step's tensors (inductor's partitioner recomputes
GroupNorm's and SiLU's elementwise work in the backward instead of keeping their fp32 tensors). The UNet's is fitted
to the flow preset's measured peak allocated (benchmarks/RESULTS.md, the flow throughput entries); the classifier's
is not measured: 1.0, the eager count, the safe side."""
CUDA_GRAPH_POOL_SHARE = 0.7
"""Under CUDA graphs (``--compile_mode reduce-overhead``) the graphs' private pool keeps its segments reserved, so the
rest of the run (the optimizer step's and the evaluation's tensors) cannot reuse them: reserved grows by this share of
the step's (compiled) activations; peak allocated does not. Fitted to the flow preset's reserved with and without
CUDA graphs (benchmarks/RESULTS.md)."""
FP32_PRODUCT_COST = 2.0
"""A product run in fp32 (a frozen teacher or ``hf-cgpu sample`` outside autocast: cuDNN's convolutions then use
TF32 tensor cores, whose dense rate is half the bf16 one on Ampere, Ada, Blackwell and Hopper datasheets) costs this
many bf16 products of its shape; listed so in ``StepWork.gemms`` (labels say "fp32")."""
INFERENCE_PASSES = 2.0
"""Bytes a no-grad forward's memory-bound kernels move, as a multiple of the bytes a training forward would save:
each elementwise tensor is written once and read once (no backward)."""
BATCH_BYTES_PER_VALUE = 40.0
"""Bytes the batch preparation moves per image value (3 x H x W): the uint8 gather, the flip and scale to fp32, the
channels_last copy, the noise, the interpolation and the target (the flow tasks); about as much for the
classifier's crop."""

# ---- kernels (counted on the CPU with a dispatch trace under bf16 autocast: tests/test_budget_images.py) -----------
KERNELS_PER_RESBLOCK = {False: 34, True: 40}
"""Kernels one ``ResBlock`` launches in an eager forward and backward under autocast, without / with a 1x1 skip
convolution (the weight casts, the gradient casts back to fp32 and the bias sums included)."""
KERNELS_UNET_OUTSIDE_BLOCKS = {(False, False): 73, (False, True): 101, (True, False): 91, (True, True): 119}
"""The rest of a flow training micro-batch, by (class-conditional, step-size embedding): the time (and step-size)
MLP, the class embedding, the input, down and output convolutions, upsampling and concatenation, the noise and time
draws and the loss, forward and backward."""
KERNELS_UNET_CALL = {(False, False): 121, (False, True): 139, (True, False): 128, (True, True): 146}
"""Kernels of one no-grad UNet call under autocast, by (class-conditional, step-size embedding)."""
KERNELS_CONV_BN = 10
"""Kernels of one ``conv_bn`` (convolution, BatchNorm, GELU) of the classifier, forward and backward, autocast."""
KERNELS_CLASSIFIER_OUTSIDE = 47
"""The rest of a classifier training micro-batch: max pools, residual adds, the global max, the head, the loss."""
CUDA_KERNELS_PER_GROUPNORM = 4
"""What CUDA adds per GroupNorm to the CPU count: autocast's fp32 cast of its input and the contiguous copy of a
channels_last input (``group_norm`` runs on NCHW on CUDA), and their gradients' copies in the backward. An
assumption until counted on a GPU (``benchmarks/ledger/image_check.py`` prints the profiled kernels per step)."""
KERNELS_ADVERSARIAL = {False: {"call": 283, "count": 5, "rest": 348, "shortcut": -2},
                       True: {"call": 297, "count": 6, "rest": 360, "shortcut": -2}}
"""Kernels of the adversarial term of one micro-batch, by class-conditional teacher: each student call of the fake
sampling, forward and backward under its own autocast (its weight casts, as the loop's prepared model runs), with its
Euler update ("call"); the row selection of each further step count ("count"); the rest ("rest"): the noise, the
critic's no-grad encoder call on the real and fake rows, the heads' forward and backward and their fused Adam step,
the encoder's and heads' forward and backward to the fakes, the hinge losses; and beside a shortcut term, the
difference in the losses' sum ("shortcut"). Autograd also sums the gradients of each student weight tensor once per
further use (``Critic.kernels``). Counted at ``disc_time`` < 1 (at 1 the critic draws no noise: a few fewer)."""
SAMPLER_KERNELS_PER_CALL = 6
"""Kernels of the sampler's own step per network call (the scheduler's update, guidance's combination, the time
expansion). An assumption."""


# ===================================================================================================================
# Layers
# ===================================================================================================================


@dataclass(frozen=True)
class Conv:
    """A 2-D convolution with 'same' padding (``kernel // 2``), square images."""

    name: str
    c_in: int
    c_out: int
    kernel: int
    size: int
    """Input side H = W."""
    stride: int = 1
    bias: bool = True
    input_grad: bool = True
    """False for a layer reading the image itself: its backward computes no input gradient."""

    @property
    def out_size(self) -> int:
        pad = self.kernel // 2
        return (self.size + 2 * pad - self.kernel) // self.stride + 1

    @property
    def weight_params(self) -> int:
        return self.c_out * self.c_in * self.kernel**2

    @property
    def params(self) -> int:
        return self.weight_params + (self.c_out if self.bias else 0)

    def flops(self, images: float = 1.0) -> float:
        """Forward FLOPs as ``FlopCounterMode`` counts them: 2 m n k (the bias add is not counted)."""
        return 2.0 * images * self.out_size**2 * self.c_out * self.c_in * self.kernel**2


@dataclass(frozen=True)
class Dense:
    """A linear layer applied to one row per image (the embedding MLPs, the block embeddings, the head)."""

    name: str
    d_in: int
    d_out: int
    bias: bool = True
    kind: str = "linear"
    """``optimizer_spec(...).state_bytes`` kind: linear (a hidden matrix) or head."""
    input_grad: bool = True
    """False for a layer reading a constant (the sinusoidal embedding): no input gradient."""

    @property
    def params(self) -> int:
        return self.d_in * self.d_out + (self.d_out if self.bias else 0)

    def flops(self, images: float = 1.0) -> float:
        return 2.0 * images * self.d_in * self.d_out


@dataclass(frozen=True)
class Saved:
    """A tensor a training forward keeps for the backward: ``elements`` per image of ``bytes`` each."""

    what: str
    elements: int
    bytes: int

    @property
    def total(self) -> int:
        return self.elements * self.bytes


@dataclass(frozen=True)
class Autocast:
    """Dtypes of a training forward under bf16 autocast on one device type (its op lists differ)."""

    device: str
    norm_bytes: int
    """GroupNorm's computation: CUDA autocast lists ``group_norm`` as fp32 (an fp32 cast of a bf16 input is saved,
    the output is fp32); the CPU runs it in bf16 on the bf16 input itself."""


AUTOCAST = {"cuda": Autocast("cuda", FP32), "cpu": Autocast("cpu", BF16)}


@dataclass(frozen=True)
class ImageNet:
    """One image network as the ledger sees it (build it with ``flow_unet`` or ``cifar_resnet``)."""

    name: str
    kind: str
    """unet, classifier (``COMPILED_ACTIVATION_SHARE``) or heads (the adversarial stage's discriminator, eager)."""
    image_size: int
    convs: tuple[Conv, ...]
    linears: tuple[Dense, ...]
    others: tuple[tuple[str, int, str], ...]
    """(name, numel, kind) of the parameters outside convolutions and linears (norm affines, embedding tables)."""
    saved: tuple[Saved, ...]
    """Per image, a training forward under bf16 autocast (CUDA rules unless built for the CPU)."""
    kernels: float
    """Kernels one eager training micro-batch launches (forward and backward, the loss and the batch's draws)."""
    call_kernels: float = 0.0
    """Kernels one eager no-grad call launches (the UNet; 0 for the classifier)."""
    config: dict[str, Any] = field(default_factory=dict, compare=False)
    """What the network was built from (the UNet's config.json entries, the classifier's widths)."""

    # ---- parameters --------------------------------------------------------------------------------------------
    def param_tensors(self) -> list[tuple[str, int, str]]:
        """(name, numel, kind) of every parameter tensor, kinds as the optimizers' ``state_bytes`` read them."""
        out = []
        for c in self.convs:
            out.append((f"{c.name}.weight", c.weight_params, "conv"))
            if c.bias:
                out.append((f"{c.name}.bias", c.c_out, "bias"))
        for lin in self.linears:
            out.append((f"{lin.name}.weight", lin.d_in * lin.d_out, lin.kind))
            if lin.bias:
                out.append((f"{lin.name}.bias", lin.d_out, "bias"))
        return out + list(self.others)

    @property
    def params(self) -> int:
        return sum(n for _, n, _ in self.param_tensors())

    @property
    def norms(self) -> int:
        """Normalisation layers (one "norm" weight each)."""
        return sum(1 for _, _, kind in self.others if kind == "norm")

    @property
    def product_params(self) -> int:
        """Weights and biases of the convolutions and linears: what autocast casts to bf16 (2 B each)."""
        return sum(c.params for c in self.convs) + sum(lin.params for lin in self.linears)

    # ---- work of one image ---------------------------------------------------------------------------------------
    def forward_flops(self, images: float = 1.0) -> float:
        """Forward FLOPs (convolutions and linears, as ``FlopCounterMode`` counts them)."""
        return sum(c.flops(images) for c in self.convs) + sum(lin.flops(images) for lin in self.linears)

    def gemms(self, images: float, count: float = 1.0, backward: bool = True, tag: str = "",
              cost: float = 1.0, frozen: bool = False) -> list[Gemm]:
        """The products of ``count`` passes over ``images`` images: each convolution's forward (m = images x H_out x
        W_out rows of C_in kh kw), and with ``backward`` its input gradient (the transposed product: k = C_out kh kw
        over the input's pixels, where the input needs one) and weight gradient; the linears likewise over one row
        per image. ``cost`` multiplies the count (``FP32_PRODUCT_COST``). ``frozen``: the weights take no gradient
        and the backward only carries the image's (the critic on the student's samples): every convolution's input
        gradient, no weight gradients, none for the linears (they read the embeddings, not the image)."""
        out: list[Gemm] = []
        n = count * cost
        for c in self.convs:
            rows = images * c.out_size**2
            out.append(Gemm(rows, c.c_out, c.c_in * c.kernel**2, n, f"{tag}{c.name} forward"))
            if backward:
                if c.input_grad or frozen:
                    out.append(Gemm(images * c.size**2, c.c_in, c.c_out * c.kernel**2 / c.stride**2, n,
                                    f"{tag}{c.name} input gradient"))
                if not frozen:
                    out.append(Gemm(c.c_in * c.kernel**2, c.c_out, rows, n, f"{tag}{c.name} weight gradient"))
        for lin in self.linears:
            out.append(Gemm(images, lin.d_out, lin.d_in, n, f"{tag}{lin.name} forward"))
            if backward and not frozen:
                if lin.input_grad:
                    out.append(Gemm(images, lin.d_in, lin.d_out, n, f"{tag}{lin.name} input gradient"))
                out.append(Gemm(lin.d_in, lin.d_out, images, n, f"{tag}{lin.name} weight gradient"))
        return out

    @property
    def saved_bytes(self) -> int:
        """Bytes one image's training forward saves for the backward."""
        return sum(s.total for s in self.saved)

    def saved_by_kind(self) -> dict[str, int]:
        """Bytes per image by what saved them (the ledger's note, the tests' comparison)."""
        out: dict[str, int] = {}
        for s in self.saved:
            out[s.what] = out.get(s.what, 0) + s.total
        return out

    def saved_elements_by_dtype(self) -> dict[int, int]:
        """Elements per image by bytes per element."""
        out: dict[int, int] = {}
        for s in self.saved:
            out[s.bytes] = out.get(s.bytes, 0) + s.elements
        return out

    def describe(self) -> str:
        return f"{self.name}: {fmt_count(self.params)} parameters, {self.forward_flops() / 1e9:.2f} GFLOP per image"


# ===================================================================================================================
# The flow UNet (hf_cgpu/flow/unet.py)
# ===================================================================================================================


def unet_config(base_channels: int = 128, class_conditional: bool = True, step_size_embedding: bool = False,
                sample_size: int = DEFAULT_IMAGE_SIZE, num_classes: int = DEFAULT_NUM_CLASSES) -> dict[str, Any]:
    """The ``FlowUNet2DModel`` config the flow task builds (its ``config.json``): the given width and conditioning,
    the model's defaults for the rest."""
    return {"sample_size": sample_size, "in_channels": 3, "out_channels": 3, "base_channels": base_channels,
            "time_embed_dim": UNET_TIME_EMBED_DIM, "norm_num_groups": UNET_GROUPS,
            "num_classes": num_classes if class_conditional else None, "step_size_embedding": step_size_embedding}


def flow_unet(config: dict[str, Any], device: str = "cuda", encoder: bool = False) -> ImageNet:
    """The UNet of ``config`` (a ``FlowUNet2DModel`` config.json, or ``unet_config``), its training forward's saved
    tensors under ``AUTOCAST[device]``. ``encoder``: only its frozen encoder as the adversarial stage's critic runs it
    (``unet_encoder_features``: the input convolution, the down blocks and the middle block), the gradient going to
    the image alone: the embeddings save nothing, the input convolution takes an input gradient, and its kernels are
    the critic's (``KERNELS_ADVERSARIAL``)."""
    cfg = {**unet_config(), **{k: v for k, v in config.items() if not k.startswith("_")}}
    s, c1, tdim, g = int(cfg["sample_size"]), int(cfg["base_channels"]), int(cfg["time_embed_dim"]), \
        int(cfg["norm_num_groups"])
    cin, cout = int(cfg["in_channels"]), int(cfg["out_channels"])
    classes, step = cfg.get("num_classes"), bool(cfg.get("step_size_embedding"))
    told = bool(cfg.get("guidance_embedding"))
    if c1 < 1 or c1 % g or s % 4 or s < 4:
        raise SettingsError(f"UNet base_channels {c1} must be a positive multiple of norm_num_groups {g} and "
                            f"sample_size {s} a multiple of 4")
    rules = AUTOCAST[device]
    c2 = c3 = 2 * c1
    convs: list[Conv] = [Conv("in_conv", cin, c1, 3, s, input_grad=encoder)]
    linears = [Dense("time_mlp.0", tdim, tdim, input_grad=False), Dense("time_mlp.2", tdim, tdim)]
    if step:
        linears += [Dense("step_mlp.0", tdim, tdim, input_grad=False), Dense("step_mlp.2", tdim, tdim)]
    if told:
        linears += [Dense("guidance_mlp.0", tdim, tdim, input_grad=False), Dense("guidance_mlp.2", tdim, tdim)]
    others: list[tuple[str, int, str]] = []
    if classes is not None:
        others.append(("class_embedding.weight", (int(classes) + 1) * tdim, "embedding"))
    saved: list[Saved] = []

    def add(what: str, elements: int, nbytes: int) -> None:
        if not (encoder and what.startswith(("embedding", "class labels"))):  # a frozen embedding of constants
            saved.append(Saved(what, elements, nbytes))

    # the embedding: sinusoid (fp32) -> Linear (its bf16 cast) -> SiLU (bf16 in) -> Linear; the step size and the
    # guidance scale alike; + the class row (fp32 table: the sum turns fp32) -> SiLU, whose output each block's
    # emb_proj casts to bf16
    for _ in range(1 + step + told):
        add("embedding MLPs", 3 * tdim, BF16)
    emb_fp32 = classes is not None
    if emb_fp32:
        add("class labels", 1, INT64)
    add("embedding SiLU input", tdim, FP32 if emb_fp32 else BF16)
    if not emb_fp32:  # a bf16 embedding: every block's emb_proj saves the same tensor
        add("embedding (the blocks' emb_proj input)", tdim, BF16)
    blocks = (("d1", c1, c1, s), ("d2", c1, c2, s // 2), ("mid", c2, c3, s // 4), ("u2", c3 + c2, c2, s // 2),
              ("u1", c2 + c1, c1, s))[:3 if encoder else 5]
    add("input convolution's bf16 cast", cin * s * s, BF16)
    for name, a, b, size in blocks:
        n_in, n_out = a * size * size, b * size * size
        convs.append(Conv(f"{name}.conv1", a, b, 3, size))
        convs.append(Conv(f"{name}.conv2", b, b, 3, size))
        if a != b:
            convs.append(Conv(f"{name}.skip", a, b, 1, size))
        linears.append(Dense(f"{name}.emb_proj", tdim, b))
        others += [(f"{name}.norm1.weight", a, "norm"), (f"{name}.norm1.bias", a, "bias"),
                   (f"{name}.norm2.weight", b, "norm"), (f"{name}.norm2.bias", b, "bias")]
        _norm_silu_conv(add, rules, n_in, g, block_input_saved=a != b)
        if emb_fp32:
            add("embedding casts (per block)", tdim, BF16)
        _norm_silu_conv(add, rules, n_out, g, block_input_saved=False)
        if name == "d1":
            convs.append(Conv("down1", c1, c1, 3, s, stride=2))
            add("down-sampling convolution inputs", c1 * s * s, BF16)
        elif name == "d2":
            convs.append(Conv("down2", c2, c2, 3, s // 2, stride=2))
            add("down-sampling convolution inputs", c2 * (s // 2) ** 2, BF16)
    if encoder:
        return ImageNet(f"FlowUNet2DModel base {c1} encoder", "unet", s, tuple(convs), tuple(linears), tuple(others),
                        tuple(saved), 0.0, 0.0, cfg)
    convs.append(Conv("out.2", c1, cout, 3, s))
    others += [("out.0.weight", c1, "norm"), ("out.0.bias", c1, "bias")]
    _norm_silu_conv(add, rules, c1 * s * s, g, block_input_saved=False)
    add(FLOW_LOSS_SAVED, 2 * cout * s * s, FP32)
    # convolutions first (their order is the forward's), then the rest in module order for param_tensors
    order = ["in_conv", "d1.", "down1", "d2.", "down2", "mid.", "u2.", "u1.", "out."]
    convs.sort(key=lambda c: next(i for i, p in enumerate(order) if c.name.startswith(p)))
    n_skip = sum(1 for _, a, b, _ in blocks if a != b)
    scalars, conditional = step + told, classes is not None

    def with_scalars(table: dict[tuple[bool, bool], int]) -> int:
        """``table``'s kernels with ``scalars`` scalar embeddings: the guidance one launches what the step-size one
        does, each adding the same kernels."""
        plain = table[(conditional, False)]
        return plain + scalars * (table[(conditional, True)] - plain)

    kernels = (KERNELS_PER_RESBLOCK[True] * n_skip + KERNELS_PER_RESBLOCK[False] * (len(blocks) - n_skip)
               + with_scalars(KERNELS_UNET_OUTSIDE_BLOCKS))
    if device == "cuda":
        kernels += CUDA_KERNELS_PER_GROUPNORM * (2 * len(blocks) + 1)
    call = with_scalars(KERNELS_UNET_CALL)
    added = " and ".join(n for n, on in (("step-size", step), ("guidance", told)) if on)
    name = f"FlowUNet2DModel base {c1}" + (f" ({added} embedding{'s' if step and told else ''})" if added else "")
    return ImageNet(name, "unet", s, tuple(convs), tuple(linears), tuple(others), tuple(saved), float(kernels),
                    float(call), cfg)


def _norm_silu_conv(add, rules: Autocast, n: int, groups: int, block_input_saved: bool) -> None:
    """What GroupNorm -> SiLU -> conv3x3 saves on a bf16 input of ``n`` elements per image: the norm's input (an
    fp32 cast on CUDA, the bf16 tensor itself on the CPU) and its mean and rstd, SiLU's input (the norm's output) and
    the convolution's input (a fresh bf16 cast of SiLU's fp32 output on CUDA, SiLU's bf16 output on the CPU); and,
    when a 1x1 skip convolution reads the block input, that bf16 input (on the CPU the norm's saved input already)."""
    if rules.norm_bytes != BF16:
        add("GroupNorm inputs (fp32 casts)", n, rules.norm_bytes)
        if block_input_saved:
            add("skip convolution inputs (block input)", n, BF16)
    else:
        add("GroupNorm inputs", n, BF16)
    add("GroupNorm mean and rstd", 2 * groups, FP32)
    add("SiLU inputs (GroupNorm outputs)", n, rules.norm_bytes)
    add("convolution inputs (bf16)", n, BF16)


@dataclass(frozen=True)
class Inference:
    """One no-grad forward: the peak of its live tensors and the bytes it writes (per row: multiply by the rows)."""

    peak: float
    written: float


def unet_inference(config: dict[str, Any], bf16: bool = True, channels_last: bool = False,
                   encoder: bool = False) -> Inference:
    """The tensors of one no-grad UNet call on one row (the input included), followed through
    ``FlowUNet2DModel.forward`` and ``ResBlock.forward``: every local of ``forward`` (h0, h1, h2, m, up2, h, up1)
    lives until it returns, a block keeps its input for the skip, and each op's inputs and outputs coexist.
    ``bf16``: under autocast (GroupNorm in fp32, each convolution's input cast to bf16); else fp32 throughout.
    ``channels_last``: the model and input are channels_last (the training model), so CUDA's GroupNorm first copies
    its input to NCHW. ``encoder``: the critic's call (``unet_encoder_features``), which ends with the middle block
    and returns its three maps."""
    cfg = {**unet_config(), **config}
    s, c1, cin = int(cfg["sample_size"]), int(cfg["base_channels"]), int(cfg["in_channels"])
    c2 = c3 = 2 * c1
    act = BF16 if bf16 else FP32
    live = _Live()
    live.new("sample", FP32 * cin * s * s)
    live.new("emb", FP32 * int(cfg["time_embed_dim"]))
    if bf16:
        live.new("sample cast", BF16 * cin * s * s)
    live.new("h0", act * c1 * s * s)
    live.free("sample cast")

    def block(name: str, x: str, a: int, b: int, size: int) -> None:
        n_in, n_out = a * size * size, b * size * size
        _norm_silu(live, x, n_in, act, channels_last)
        live.new("h", act * n_out)
        live.free("silu", "silu cast")
        live.new("h + emb", act * n_out)
        live.free("h")
        _norm_silu(live, "h + emb", n_out, act, channels_last)
        live.new("conv2 out", act * n_out)
        live.free("silu", "silu cast", "h + emb")
        if a != b:
            live.new("skip", act * n_out)
        live.new(name, act * n_out)
        live.free("conv2 out", "skip")

    block("h1", "h0", c1, c1, s)
    live.new("down1", act * c1 * (s // 2) ** 2)
    block("h2", "down1", c1, c2, s // 2)
    live.free("down1")
    live.new("down2", act * c2 * (s // 4) ** 2)
    block("m", "down2", c2, c3, s // 4)
    live.free("down2")
    if encoder:
        return Inference(live.peak, live.written)
    live.new("up", act * c3 * (s // 2) ** 2)
    live.new("up2", act * (c3 + c2) * (s // 2) ** 2)
    live.free("up")
    block("hu2", "up2", c3 + c2, c2, s // 2)
    live.new("up", act * c2 * s * s)
    live.new("up1", act * (c2 + c1) * s * s)
    live.free("up")
    block("hu1", "up1", c2 + c1, c1, s)
    _norm_silu(live, "hu1", c1 * s * s, act, channels_last)
    live.new("out", act * int(cfg["out_channels"]) * s * s)
    return Inference(live.peak, live.written)


def _norm_silu(live: _Live, x: str, n: int, act: int, channels_last: bool) -> None:
    """GroupNorm (fp32: a cast of a bf16 input, and on CUDA an NCHW copy of a channels_last one) then SiLU, and the
    convolution's bf16 cast of SiLU's fp32 output under autocast; leaves "silu" (and "silu cast") alive."""
    if act != FP32:
        live.new("norm cast", FP32 * n)
    if channels_last:
        live.new("norm copy", FP32 * n)
    live.new("norm", FP32 * n)
    live.free("norm cast", "norm copy")
    live.new("silu", FP32 * n)
    live.free("norm")
    if act != FP32:
        live.new("silu cast", act * n)


class _Live:
    """Bytes of named live tensors, their peak, and every byte written."""

    def __init__(self) -> None:
        self.live: dict[str, float] = {}
        self.peak = 0.0
        self.written = 0.0

    def new(self, name: str, nbytes: float) -> None:
        self.live[name] = nbytes
        self.written += nbytes
        self.peak = max(self.peak, sum(self.live.values()))

    def free(self, *names: str) -> None:
        for n in names:
            self.live.pop(n, None)


# ===================================================================================================================
# The CIFAR classifier (hf_cgpu/evaluation/classifier.py)
# ===================================================================================================================


def cifar_resnet(widths: list[int] | tuple[int, ...], num_classes: int = DEFAULT_NUM_CLASSES,
                 image_size: int = DEFAULT_IMAGE_SIZE) -> ImageNet:
    """``CifarResNet`` of ``widths`` (c0..c3); its training forward's saved tensors (BatchNorm, GELU and max pooling
    run in the input's dtype under autocast on both device types, so one description serves both)."""
    if len(widths) != 4 or min(widths) < 1 or image_size % 8:
        raise SettingsError(f"classifier widths {list(widths)} and image size {image_size}: give four positive "
                            "widths and a side divisible by 8")
    c0, c1, c2, c3 = (int(w) for w in widths)
    s = image_size
    convs: list[Conv] = []
    others: list[tuple[str, int, str]] = []
    saved: list[Saved] = []

    def add(what: str, elements: int, nbytes: int) -> None:
        saved.append(Saved(what, elements, nbytes))

    def conv_bn(name: str, a: int, b: int, size: int) -> None:
        # the convolution's input is its producer's output (counted there); BatchNorm saves its input, GELU its own
        convs.append(Conv(f"{name}.0", a, b, 3, size, bias=False, input_grad=name != "prep"))
        others.extend([(f"{name}.1.weight", b, "norm"), (f"{name}.1.bias", b, "bias")])
        add("BatchNorm inputs", b * size * size, BF16)
        add("GELU inputs", b * size * size, BF16)

    def pooled(b: int, size: int) -> None:
        add("max-pool inputs (GELU outputs)", b * size * size, BF16)
        add("max-pool indices", b * (size // 2) ** 2, INT64)

    def residual(name: str, c: int, size: int) -> None:
        add("convolution inputs", c * size * size, BF16)  # the block input (a pool's output)
        conv_bn(f"{name}.body.0", c, c, size)
        add("convolution inputs", c * size * size, BF16)  # the first GELU's output
        conv_bn(f"{name}.body.1", c, c, size)

    add("input convolution's bf16 cast", 3 * s * s, BF16)
    conv_bn("prep", 3, c0, s)
    add("convolution inputs", c0 * s * s, BF16)  # prep's GELU output
    conv_bn("layer1.0", c0, c1, s)
    pooled(c1, s)
    residual("layer1.2", c1, s // 2)
    add("convolution inputs", c1 * (s // 2) ** 2, BF16)  # the residual sum
    conv_bn("layer2.0", c1, c2, s // 2)
    pooled(c2, s // 2)
    add("convolution inputs", c2 * (s // 4) ** 2, BF16)  # the pool's output
    conv_bn("layer3.0", c2, c3, s // 4)
    pooled(c3, s // 4)
    residual("layer3.2", c3, s // 8)
    add("global max (input and result)", c3 * (s // 8) ** 2 + c3, BF16)  # the result is also the head's input
    add("loss (fp32 log-softmax, labels, label smoothing's ignore mask)", num_classes, FP32)
    add("loss (fp32 log-softmax, labels, label smoothing's ignore mask)", 1, INT64)
    add("loss (fp32 log-softmax, labels, label smoothing's ignore mask)", 1, BOOL)
    # BatchNorm buffers (running mean, variance, batches tracked) are no parameters: optimizer and EMA skip them
    linears = (Dense("head", c3, num_classes, bias=False, kind="head"),)
    kernels = KERNELS_CONV_BN * 8 + KERNELS_CLASSIFIER_OUTSIDE
    return ImageNet(f"CifarResNet {c0},{c1},{c2},{c3}", "classifier", s, tuple(convs), linears, tuple(others),
                    tuple(saved),
                    float(kernels), 0.0, {"widths": [c0, c1, c2, c3], "num_classes": num_classes,
                                          "image_size": s})


# ===================================================================================================================
# The adversarial stage's critic (hf_cgpu/flow/adversarial.py): the teacher's encoder and the discriminator heads
# ===================================================================================================================


def feature_heads(config: dict[str, Any], width: int, device: str = "cuda") -> ImageNet:
    """``FeatureHeads(unet_feature_channels(config), width)``: per encoder map (C, H) of the UNet of ``config``, a 3x3
    convolution to ``width`` channels, GroupNorm, LeakyReLU and a 1x1 convolution to one logit per pixel; the tensors
    one image saves through them under ``AUTOCAST[device]`` (the map's bf16 cast, then what GroupNorm, the activation
    and the convolution save, as in the UNet's blocks). Its kernels are the critic's (``KERNELS_ADVERSARIAL``)."""
    unet = {**unet_config(), **config}
    s, c1 = int(unet["sample_size"]), int(unet["base_channels"])
    rules = AUTOCAST[device]
    convs: list[Conv] = []
    others: list[tuple[str, int, str]] = []
    saved: list[Saved] = []

    def add(what: str, elements: int, nbytes: int) -> None:
        saved.append(Saved(what, elements, nbytes))

    for i, (c, size) in enumerate(((c1, s), (2 * c1, s // 2), (2 * c1, s // 4))):
        convs += [Conv(f"heads.{i}.0", c, width, 3, size, input_grad=False), Conv(f"heads.{i}.3", width, 1, 1, size)]
        others += [(f"heads.{i}.1.weight", width, "norm"), (f"heads.{i}.1.bias", width, "bias")]
        add("encoder features' bf16 casts", c * size * size, BF16)
        _norm_silu_conv(add, rules, width * size * size, HEAD_GROUPS, block_input_saved=False)
    return ImageNet(f"FeatureHeads width {width}", "heads", s, tuple(convs), (), tuple(others), tuple(saved), 0.0,
                    0.0, {"width": width})


@dataclass(frozen=True)
class AdversarialCalls:
    """The network calls the adversarial term of ``train flow-distill`` makes on one micro-batch
    (``FlowDistillTask.loss``): the student samples every row in its step count (``row_steps``), one call a step,
    with a backward; the critic judges the real and fake rows (no grad to the UNet), then the fake rows again with
    the gradient going back to the student."""

    batch: int
    groups: tuple[tuple[int, int], ...]
    """(step count n, rows) of each step count in use: n student calls on those rows (``sample_in_steps``)."""

    @property
    def calls(self) -> int:
        return sum(n for n, _ in self.groups)

    @property
    def call_rows(self) -> int:
        """Rows of all the student's calls: each keeps its activations for the backward."""
        return sum(n * rows for n, rows in self.groups)


def adversarial_calls(batch: int, step_counts: tuple[int, ...]) -> AdversarialCalls:
    """The calls of ``sample_in_steps`` on ``batch`` rows whose step counts are ``step_counts`` in turn by row."""
    rows = [step_counts[r % len(step_counts)] for r in range(batch)]
    return AdversarialCalls(batch, tuple((n, rows.count(n)) for n in sorted(set(rows))))


@dataclass(frozen=True)
class Critic:
    """The adversarial stage's critic on a teacher UNet (``critic_nets``): its frozen encoder and the heads."""

    encoder: ImageNet
    heads: ImageNet

    @property
    def saved_bytes(self) -> int:
        """Bytes one fake image's pass through the critic saves for the student's backward."""
        return self.encoder.saved_bytes + self.heads.saved_bytes

    def kernels(self, net: ImageNet, calls: AdversarialCalls, shortcut: bool, device: str = "cuda") -> float:
        """Kernels of the adversarial term of one micro-batch (``KERNELS_ADVERSARIAL``) for the student ``net``: its
        calls, the critic, and autograd's sums of each student weight tensor's gradients over its uses (the fake
        calls, and the shortcut term's training call when ``shortcut``). On CUDA each GroupNorm with a backward adds
        ``CUDA_KERNELS_PER_GROUPNORM``: the student's calls', the encoder's on the fakes, the heads' twice."""
        table = KERNELS_ADVERSARIAL[net.config.get("num_classes") is not None]
        sums = len(net.param_tensors()) * (calls.calls - 1 + shortcut)
        kernels = (table["rest"] + table["call"] * calls.calls + table["count"] * (len(calls.groups) - 1) + sums
                   + table["shortcut"] * shortcut)
        if device == "cuda":
            kernels += CUDA_KERNELS_PER_GROUPNORM * (net.norms * calls.calls + self.encoder.norms
                                                     + 2 * self.heads.norms)
        return float(kernels)


def critic_nets(config: dict[str, Any], width: int, device: str = "cuda") -> Critic:
    """The critic on a teacher UNet of ``config`` with heads of ``width`` channels."""
    return Critic(flow_unet({**config, "step_size_embedding": False, "guidance_embedding": False}, device,
                            encoder=True), feature_heads(config, width, device))


# ===================================================================================================================
# Samplers and distillation: network calls, counted as the code makes them
# ===================================================================================================================


def sampler_calls(sampler: str, steps: int,
                  interval: tuple[float, float] | None = None) -> list[tuple[float, bool]]:
    """(t, guided) of every network call of ``steps`` steps of ``sampler`` on the schedulers' default uniform grid
    (t_k = k / N): Euler calls at t_0 .. t_{N-1}; Heun at t_0 and twice at each interior time (2N - 1 calls, the
    last interval Euler). A call is guided where t lies in ``interval`` (None: every call), as ``call_plan`` says."""
    if steps < 1:
        raise SettingsError(f"{steps} sampler steps; use 1 or more")
    grid = [k / steps for k in range(steps)]
    if sampler == "euler":
        times = grid
    elif sampler == "heun":
        times = grid[:1] + [t for t in grid[1:] for _ in range(2)]
    else:
        raise SettingsError(f"the ledger counts the network calls of euler and heun; {sampler!r} is neither: "
                            "pass --scheduler euler or heun")
    lo, hi = interval if interval is not None else (0.0, 1.0)
    return [(t, lo - 1e-6 <= t <= hi + 1e-6) for t in times]


def evaluations_per_image(sampler: str, steps: int, guidance_scale: float = 1.0,
                          interval: tuple[float, float] | None = None, conditional: bool = True,
                          guide: bool = False) -> int:
    """Network evaluations of one image (a guided call costs two: conditional and null rows, or the model and its
    autoguidance guide); as ``hf_cgpu.flow.samplers.evaluations_per_image`` counts, without importing torch."""
    guided = guidance_scale != 1.0 and (conditional or guide)
    return sum(2 if g and guided else 1 for _, g in sampler_calls(sampler, steps, interval))


def guidance_mode(scale: float, conditional: bool, guide: bool, ranged: str = "") -> str:
    """How a guided network call runs: "cfg" (one call on the conditional and null-class rows together), "guide"
    (autoguidance: the model and its guide, one call each), "none" (scale 1 and no ``ranged`` per-row scales, or
    nothing to guide with)."""
    if (scale == 1.0 and not ranged) or not (conditional or guide):
        return "none"
    return "guide" if guide else "cfg"


def sampling_guidance(net: ImageNet, scale: float, guide: bool) -> str:
    """``guidance_mode`` of sampling from ``net``: "none" for a UNet told the scale (``guidance_embedding``: one call
    of the batch's rows whatever the scale)."""
    if net.config.get("guidance_embedding"):
        return "none"
    return guidance_mode(scale, net.config.get("num_classes") is not None, guide)


def _guided_calls(rows: int, mode: str) -> list[tuple[str, int]]:
    """The network calls of one guided velocity on ``rows`` rows."""
    if mode == "cfg":
        return [("teacher", 2 * rows)]
    if mode == "guide":
        return [("teacher", rows), ("guide", rows)]
    return [("teacher", rows)]


@dataclass(frozen=True)
class DistillRows:
    """The network calls one micro-batch of ``train flow-distill`` makes (``ShortcutObjective.loss``)."""

    batch: int
    flow: int
    """Rows matched to the teacher at d = 0."""
    consistency: int
    """Self-consistency rows (d > 0)."""
    smallest: int
    """Of those, rows at the smallest step, whose target is two Euler steps of the teacher."""
    calls: tuple[tuple[str, int], ...]
    """(teacher | guide | student, rows) of every no-grad call, in order; the student's training call (all
    ``batch`` rows, with a backward) comes after them."""

    def rows(self, who: str) -> int:
        return sum(r for w, r in self.calls if w == who)


def distill_rows(batch: int, levels: int, consistency_fraction: float, mode: str = "cfg") -> DistillRows:
    """The calls of ``ShortcutObjective`` on a micro-batch of ``batch``: the guided teacher on the ``flow_rows``
    rows at d = 0; the self-consistency rows have D = 2^-(row mod (levels + 1)): rows at D = 2^-levels take two
    guided teacher velocities of half a step, the others two no-grad student calls. ``mode``: ``guidance_mode``."""
    if batch < 2:
        raise SettingsError(f"flow-distill needs --micro_batch_size >= 2 (a teacher row and a self-consistency row); "
                            f"got {batch}")
    flow = min(batch - 1, max(1, round(batch * (1 - consistency_fraction))))
    consistency = batch - flow
    smallest = consistency // (levels + 1)
    rest = consistency - smallest
    calls = _guided_calls(flow, mode)
    if smallest:
        calls += _guided_calls(smallest, mode) * 2
    if rest:
        calls += [("student", rest)] * 2
    return DistillRows(batch, flow, consistency, smallest, tuple(calls))


# ===================================================================================================================
# Saved pipelines and teachers (read without torch)
# ===================================================================================================================


@dataclass(frozen=True)
class PipelineInfo:
    """What the ledger needs of a saved ``FlowMatchPipeline`` folder."""

    unet: dict[str, Any]
    sampler: str
    """The saved scheduler's name in ``SAMPLERS`` (empty: not one of ours)."""
    steps: int
    guidance_scale: float | None
    guidance_interval: tuple[float, float] | None
    guide: bool
    """The folder saved an autoguidance guide (``guide_unet``), a UNet of the same shape."""


def read_pipeline(folder: str | Path) -> PipelineInfo:
    """The UNet config, sampler and sampling defaults of a saved pipeline folder (model_index.json and
    unet/config.json); a missing file is one line naming the fix."""
    d = Path(folder)
    index_path, unet_path = d / "model_index.json", d / "unet" / "config.json"
    if not index_path.is_file() or not unet_path.is_file():
        raise MissingPathError(f"{folder} holds no model_index.json and unet/config.json; pass the output_dir of a "
                               "flow run (hf-cgpu train flow)")
    index = json.loads(index_path.read_text())
    guide = index.get("guide_unet")
    interval = index.get("guidance_interval")
    return PipelineInfo(unet=json.loads(unet_path.read_text()), sampler=_sampler_name(index.get("scheduler")),
                        steps=int(index.get("num_inference_steps") or 8), guidance_scale=index.get("guidance_scale"),
                        guidance_interval=tuple(interval) if interval else None,
                        guide=isinstance(guide, list) and guide[0] is not None)


def _sampler_name(entry: Any) -> str:
    from ..flow.samplers import SAMPLERS

    cls = entry[1] if isinstance(entry, list) and len(entry) == 2 else ""
    for name, where in SAMPLERS.items():
        found = where.rpartition(":")[2] if isinstance(where, str) else getattr(where, "__name__", "")
        if found == cls:
            return name
    return ""


# ===================================================================================================================
# Memory
# ===================================================================================================================


@dataclass(frozen=True)
class ImageLedger(Totals):
    """Predicted memory of one training step (or one sampling job) of an image task, in bytes; the same totals as
    ``memory.Ledger``: ``allocated`` compares with max_memory_allocated(), ``total`` with what the card holds."""

    task: str
    net: ImageNet
    rows: tuple[Row, ...]
    allocated: float
    fragmentation: float
    reserved: float
    cuda_context: float
    total: float
    peak_phase: str
    phases: tuple[tuple[str, float], ...]
    """(moment, allocated bytes) of every moment compared; the peak is the largest."""
    memory_cap: float | None = None

    def extra_figures(self) -> dict[str, float]:
        return {f"phase {p}": b for p, b in self.phases}


def _finish(task: str, net: ImageNet, rows: list[Row], phases: list[tuple[str, float]],
            memory_cap: float | None, kept_apart: float = 0.0) -> ImageLedger:
    """The peak moment, and reserved = allocated + ``FRAGMENTATION_FRACTION`` + ``kept_apart`` (segments the peak's
    tensors cannot reuse: the CUDA-graph pool, a compiled step's blocks beside eager ones)."""
    phase, allocated = max(phases, key=lambda p: p[1])
    fragmentation = FRAGMENTATION_FRACTION * allocated + kept_apart
    reserved = allocated + fragmentation
    return ImageLedger(task, net, tuple(rows), allocated, fragmentation, reserved, CUDA_CONTEXT_BYTES,
                       reserved + CUDA_CONTEXT_BYTES, phase, tuple(phases), memory_cap)


TASKS = ("flow", "flow-distill", "classifier")


def task_net(task: str, cfg, teacher_config: dict[str, Any] | None = None, device: str = "cuda") -> ImageNet:
    """The network ``train TASK`` trains, from its settings (flow-distill: the teacher's UNet with the step-size
    embedding switched on, and the guidance one with ``guidance_range``; ``teacher_config`` None = the flow preset's
    UNet)."""
    if task == "flow":
        return flow_unet(unet_config(cfg.base_channels, cfg.class_conditional), device)
    if task == "flow-distill":
        return flow_unet({**(teacher_config or unet_config()), "step_size_embedding": True,
                          "guidance_embedding": bool(cfg.guidance_range)}, device)
    if task == "classifier":
        return cifar_resnet(cfg.width_list)
    raise SettingsError(f"the image ledger prices {', '.join(TASKS)}, not {task!r}")


def _check_train(task: str, train) -> None:
    if task not in TASKS:
        raise SettingsError(f"the image ledger prices {', '.join(TASKS)}, not {task!r}")
    if train.recompute:
        raise SettingsError(f"--recompute: train {task} has no activation checkpointing (its model has no "
                            "transformers checkpointing hook); drop --recompute, or lower --micro_batch_size")


def _dataset_row(task: str, cfg, image_size: int, labels: bool) -> Row:
    """The uint8 images (and int64 labels) the task keeps on the device (``load_data``), CIFAR-10's counts."""
    per = 3 * image_size**2 * UINT8 + (INT64 if labels else 0)
    train = min(cfg.limit, CIFAR10_TRAIN_IMAGES) if cfg.limit else CIFAR10_TRAIN_IMAGES
    if task == "classifier":
        held = min(cfg.test_limit, CIFAR10_TEST_IMAGES) if cfg.test_limit else CIFAR10_TEST_IMAGES
        note = f"{train:,} train + {held:,} test"
    else:
        held = min(FLOW_VALIDATION_IMAGES, cfg.limit or FLOW_VALIDATION_IMAGES)
        note = f"{train:,} train + {held:,} validation"
    return Row("dataset", "data set on the device", float(per * (train + held)),
               f"{note} images, uint8{' + int64 labels' if labels else ''} (CIFAR-10's counts unless --limit)")


def _teacher(cfg, teacher_config: dict[str, Any] | None, guide: bool,
             guidance_scale: float | None) -> tuple[ImageNet, str]:
    """The distillation's teacher and how it is guided: ``cfg.guidance_scale``, else the teacher folder's saved
    scale (``guidance_scale``), else 2.5 (``FlowDistillTask.setup``'s fallback); with ``guidance_range`` every row
    is guided (at its own scale, 1 included)."""
    teacher = flow_unet({**(teacher_config or unet_config()), "step_size_embedding": False,
                         "guidance_embedding": False})
    scale = cfg.guidance_scale or guidance_scale or 2.5
    return teacher, guidance_mode(scale, teacher.config.get("num_classes") is not None, guide, cfg.guidance_range)


def classifier_inference(net: ImageNet) -> Inference:
    """One no-grad classifier row: the fp32 input and its bf16 cast, then each layer's input and output (an
    ``nn.Sequential`` frees each input once the next output exists); the largest pair is the peak."""
    s = net.image_size
    base = FP32 * 3 * s * s
    pairs = [BF16 * (c.c_in + c.c_out) * c.size**2 for c in net.convs]  # conv in + out; BN and GELU likewise
    return Inference(base + max(pairs), base + sum(3 * BF16 * c.c_out * c.out_size**2 for c in net.convs))


def image_ledger(task: str, cfg, train, memory_cap: float | None = None,
                 teacher_config: dict[str, Any] | None = None, guide: bool = False,
                 guidance_scale: float | None = None) -> ImageLedger:
    """Memory of one training step of ``train TASK`` (flow, flow-distill or classifier) with the task's settings
    ``cfg`` and the run's ``train`` (TrainSettings), on one CUDA card.

    Moments compared (the peak allocated is the largest): the start of the backward (weights, optimizer state, EMA,
    bf16 weight copies, the micro-batch's saved activations, the batch, the data set, the gradients too with
    accumulation > 1), the optimizer step (every gradient, the EMA update's fp32 differences), the evaluation (an
    eager no-grad forward of a micro-batch or of the sample grid's rows) and, for flow-distill, each no-grad call of
    the objective (the frozen teacher runs in fp32: it is not under the trainer's autocast) and the adversarial
    stage's discriminator step (``_adversarial_rows``; its fakes' and critic's tensors add to the backward's start).
    With ``distill_weight`` 0 the shortcut term's calls are not made. Reserved adds to the
    allocator's fragmentation what the peak's tensors cannot reuse: the CUDA-graph pool, and beside a compiled step
    the blocks of the eager moments (evaluation, teacher calls), which have other sizes.
    flow-distill: ``teacher_config`` is the teacher's unet/config.json (None: the flow preset's UNet), ``guide``
    whether the teacher folder saved an autoguidance guide (a second fp32 UNet), ``guidance_scale`` its saved scale
    (used where ``cfg.guidance_scale`` is 0)."""
    _check_train(task, train)
    net = task_net(task, cfg, teacher_config)
    b, s = train.micro_batch_size, net.image_size
    labels = task == "classifier" or net.config.get("num_classes") is not None
    spec = optimizer_spec(train.optimizer)
    opt, opt_note = spec.state_bytes([(n, kind) for _, n, kind in net.param_tensors()], train.tier)
    n = net.params
    grads = float(FP32 * n)
    ema = FP32 * n if train.ema_decay > 0 else 0.0
    accumulate = train.gradient_accumulation_steps > 1
    compiled = bool(train.compile)
    share = COMPILED_ACTIVATION_SHARE[net.kind] if compiled else 1.0
    act = float(net.saved_bytes * b * share)
    top = sorted(net.saved_by_kind().items(), key=lambda kv: -kv[1])[:3]
    rows = [
        Row("weights", "weights", float(FP32 * n), f"{fmt_count(n)} parameters, fp32"),
        Row("gradients", "gradients", grads if accumulate else 0.0,
            "fp32, alive all step (accumulation > 1)" if accumulate else
            f"fp32, counted at the step only ({fmt_gib(grads)})"),
        Row("optimizer", "optimizer state", float(opt), opt_note),
        Row("ema", "EMA of the weights", float(ema),
            f"fp32 4 B per param (--ema_decay {train.ema_decay:g})" if ema else "none (--ema_decay 0)"),
        Row("autocast_copies", "autocast weight copies", float(BF16 * net.product_params),
            "bf16 casts of the convolution and linear weights, saved for the backward"),
        Row("activations", "activations", act,
            f"{net.saved_bytes / 1024:,.0f} KiB per image x {b}" + (f" x {share:g} compiled" if compiled else "")
            + " (eager bf16 autocast: " + ", ".join(f"{k} {v / net.saved_bytes:.0%}" for k, v in top) + ")"),
        Row("batch", "batch", float(b * (3 * s * s * FP32 + (INT64 if labels else 0))),
            f"{b} fp32 images{' and labels' if labels else ''}"),
        _dataset_row(task, cfg, s, labels),
        Row("workspace", "workspace (cuDNN, cuBLAS)", float(WORKSPACE_BYTES), "cuDNN/cuBLAS workspaces"),
    ]
    keep = {"weights", "optimizer", "ema", "dataset", "workspace", "teacher", "discriminator"}
    eager: list[tuple[str, float]] = []  # (moment, live bytes beyond the fixed ones) of the eager no-grad moments
    critic_step = 0.0  # the adversarial stage's discriminator step: live bytes beyond the step's own tensors
    if task == "flow-distill":
        teacher, mode = _teacher(cfg, teacher_config, guide, guidance_scale)
        r = distill_rows(b, cfg.levels, cfg.consistency_fraction, mode)
        copies = 2 if mode == "guide" else 1
        rows.insert(4, Row("teacher", "teacher weights (frozen)", float(FP32 * teacher.params * copies),
                           f"fp32 {fmt_count(teacher.params)}" + (" + its autoguidance guide" if copies > 1 else "")))
        if cfg.distill_weight > 0:
            rows.append(Row("targets", "targets", float(FP32 * 3 * s * s * b), f"{b} fp32 target velocities"))
            around = sum(r.bytes for r in rows if r.key in ("batch", "targets"))
            for who, k in r.calls:
                one = unet_inference(net.config, bf16=True, channels_last=True) if who == "student" else \
                    unet_inference(teacher.config, bf16=False)
                eager.append((f"{who} call ({k} rows)", around + one.peak * k))
        else:
            rows = [Row("activations", "activations", 0.0, "none: --distill_weight 0 makes no shortcut call")
                    if r.key == "activations" else r for r in rows]
        if cfg.adversarial_weight > 0:
            adv_rows, critic_step = _adversarial_rows(cfg, net, teacher, b, share)
            rows += adv_rows
    if task == "classifier":
        evaluation = classifier_inference(net).peak * b
    else:
        evaluation = unet_inference(net.config, bf16=True, channels_last=True).peak * _eval_rows(task, cfg, net, b)
    eager.append(("evaluation", evaluation))
    fixed = sum(r.bytes for r in rows if r.key in keep)
    step = sum(r.bytes for r in rows) - fixed
    ema_temp = grads if ema else 0.0  # the deferred EMA update's fp32 (weight - average) of every parameter
    phases = [("backward start", fixed + step), ("optimizer step", fixed + grads + ema_temp),
              *((what, fixed + live) for what, live in eager)]
    if critic_step:
        phases.append(("discriminator step", fixed + step - _row(rows, "critic_activations") + critic_step))
    largest_eager = max(live for _, live in eager)
    apart = min(step, largest_eager) if compiled else 0.0
    pool = CUDA_GRAPH_POOL_SHARE * act if compiled and train.compile_mode in CUDA_GRAPH_MODES else 0.0
    rows += [
        Row("eager_blocks", "eager moments' blocks (reserved)", apart,
            "a compiled step's blocks and the eager no-grad moments' do not share segments" if compiled else
            "none: the eager step's blocks are reused"),
        Row("cuda_graph_pool", "CUDA-graph pool (reserved)", pool,
            f"{CUDA_GRAPH_POOL_SHARE:g} x the activations under --compile_mode {train.compile_mode}" if pool else
            "none (no CUDA graphs)"),
    ]
    return _finish(task, net, rows, phases, memory_cap, kept_apart=apart + pool)


def _row(rows: list[Row], key: str) -> float:
    return sum(r.bytes for r in rows if r.key == key)


def _fake_call_saved(net: ImageNet) -> float:
    """Bytes one row of a student call of the fake sampling saves for the backward: a training call's tensors without
    its loss's (the sampling has no loss of its own)."""
    return net.saved_bytes - net.saved_by_kind().get(FLOW_LOSS_SAVED, 0)


def _adversarial_rows(cfg, net: ImageNet, teacher: ImageNet, b: int, share: float) -> tuple[list[Row], float]:
    """The memory the adversarial term adds to a flow-distill step, and its discriminator step's live bytes.

    Rows: the heads' fp32 weights and Adam moments; what the student's calls of the fake sampling save (the training
    call's tensors without its loss's, ``share`` of them compiled) beside the noise and the fakes; what the critic's
    pass over the fakes saves for the student's backward (the frozen encoder's and the heads' tensors). The
    discriminator step comes before that pass, with the fake calls' tensors alive: the encoder's no-grad call on the
    real and fake rows, the heads' tensors of those rows and their gradients."""
    s, calls = net.image_size, adversarial_calls(b, cfg.adversarial_step_counts)
    critic = critic_nets(teacher.config, cfg.disc_width)
    call_saved = _fake_call_saved(net)
    fakes = float(2 * FP32 * 3 * s * s * b)
    groups = ", ".join(f"{rows} rows x {n} call{'s' if n > 1 else ''}" for n, rows in calls.groups)
    heads = critic.heads.params
    rows = [
        Row("discriminator", "discriminator heads", float(3 * FP32 * heads),
            f"{fmt_count(heads)} parameters: fp32 weights and Adam's m, v (their own optimizer)"),
        Row("fake_activations", "fake samples' activations", call_saved * calls.call_rows * share + fakes,
            f"{call_saved / 1024:,.0f} KiB per row x {calls.call_rows} ({groups})"
            + (f" x {share:g} compiled" if share != 1.0 else "") + " + the noise and the fakes (fp32)"),
        Row("critic_activations", "critic's activations", float(critic.saved_bytes * b),
            f"{critic.saved_bytes / 1024:,.0f} KiB per fake x {b}: the frozen encoder's and the heads' tensors, "
            "for the student's gradient"),
    ]
    encoder = unet_inference(teacher.config, bf16=True, channels_last=True, encoder=True)
    step = 2 * b * (encoder.peak + critic.heads.saved_bytes + FP32 * 3 * s * s) + FP32 * heads
    return rows, float(step)


def _eval_rows(task: str, cfg, net: ImageNet, micro_batch: int) -> int:
    """Rows of the evaluation's largest no-grad call: a micro-batch of the validation loss, or the sample grid
    (8 images per class, 64 without classes; guided by classifier-free guidance in a flow run)."""
    classes = net.config.get("num_classes")
    grid = GRID_IMAGES_PER_CLASS * int(classes) if classes is not None else 64
    guided = task == "flow" and classes is not None and cfg.guidance_scale != 1.0
    return max(micro_batch, 2 * grid if guided else grid)


def sample_memory(unet: dict[str, Any], num_images: int, steps: int, sampler: str = "heun",
                  guidance_scale: float = 1.0, guidance_interval: tuple[float, float] | None = None,
                  batch_size: int | None = None, guide: bool = False, bf16: bool = False,
                  memory_cap: float | None = None) -> ImageLedger:
    """Memory of sampling ``num_images`` from a UNet of config ``unet``, arguments as ``sample_work``'s: the fp32
    weights (and an autoguidance guide's), the sampler's fp32 state of a batch and the largest call's live tensors
    (a call guided by classifier-free guidance has twice the rows). ``bf16``: under autocast (``hf-cgpu eval``'s
    default on a GPU); ``hf-cgpu sample`` runs fp32 and draws all its images in one batch."""
    net = flow_unet(unet)
    mode = sampling_guidance(net, guidance_scale, guide)
    if not any(g for _, g in sampler_calls(sampler, steps, guidance_interval)):
        mode = "none"
    b = min(batch_size or num_images, num_images)
    s = net.image_size
    call = unet_inference(net.config, bf16=bf16)
    rows_per_call = 2 * b if mode == "cfg" else b
    copies = 2 if mode == "guide" else 1
    rows = [
        Row("weights", "weights", float(FP32 * net.params * copies),
            f"{fmt_count(net.params)} parameters, fp32" + (" + the autoguidance guide" if copies > 1 else "")),
        Row("sampler_state", "sampler state", float(FP32 * 3 * s * s * b * 4),
            f"{b} images: the state, Heun's start point and slope, the output (fp32)"),
        Row("activations", "largest call's tensors", call.peak * rows_per_call,
            f"{call.peak / 1024:,.0f} KiB per row x {rows_per_call} rows ({'bf16 autocast' if bf16 else 'fp32'})"),
        Row("workspace", "workspace (cuDNN, cuBLAS)", float(WORKSPACE_BYTES), "cuDNN/cuBLAS workspaces"),
    ]
    return _finish("sample", net, rows, [("largest call", sum(r.bytes for r in rows))], memory_cap)


# ===================================================================================================================
# Time: the work of one step (or one sampling job)
# ===================================================================================================================

EMA_SKIPPABLE_BYTES_PER_PARAM = 32.0
"""The EMA update that a non-finite step can skip on the device (``train/update.py``, the fused-AdamW path): the
difference weight - average (read 8, write 4), scaled in place (8) and added to the average (12)."""


def _passes(train) -> float:
    return ELEMENTWISE_PASSES["compiled" if train.compile else "eager"]


def image_step_work(task: str, cfg, train, teacher_config: dict[str, Any] | None = None, guide: bool = False,
                    guidance_scale: float | None = None) -> StepWork:
    """The work of one optimizer step of ``train TASK`` (every micro-batch), arguments as ``image_ledger``'s.

    The student's and the classifier's products run under bf16 autocast; flow-distill adds its no-grad calls: the
    teacher's in fp32 (``FP32_PRODUCT_COST``), the student's target calls in bf16 (none with ``distill_weight`` 0),
    and the adversarial term's work (``_adversarial_work``). ``model_flops`` is what the trainer's MFU counts: 3 x
    the trained network's forward FLOPs per image (the teacher's and the adversarial term's calls not included)."""
    _check_train(task, train)
    net = task_net(task, cfg, teacher_config)
    micro, b = train.gradient_accumulation_steps, train.micro_batch_size
    s = net.image_size
    compiled = bool(train.compile)
    shortcut = task != "flow-distill" or cfg.distill_weight > 0  # the training call (flow-distill's shortcut term)
    trained = b * micro if shortcut else 0
    gemms = net.gemms(b, micro) if shortcut else []
    n = net.params
    opt_kind = "adamw8bit" if train.tier == "adamw8bit" else train.optimizer
    memory = [
        ("elementwise kernels", net.saved_bytes * trained * _passes(train)),
        ("batch preparation", BATCH_BYTES_PER_VALUE * 3 * s * s * b * micro),
        ("optimizer step", OPTIMIZER_BYTES_PER_PARAM.get(opt_kind, OPTIMIZER_BYTES_PER_PARAM["adamw"]) * n),
        ("autocast weight casts", (FP32 + BF16) * net.product_params * micro),
    ]
    if train.ema_decay > 0:
        memory.append(("EMA update", EMA_SKIPPABLE_BYTES_PER_PARAM * n))
    kernels = net.kernels * micro * (COMPILED_KERNEL_SHARE if compiled else 1.0) if shortcut else 0.0
    notes = {"model": net.describe()}
    if task == "flow-distill":
        teacher, mode = _teacher(cfg, teacher_config, guide, guidance_scale)
    if task == "flow-distill" and cfg.adversarial_weight > 0:
        work = _adversarial_work(cfg, net, teacher, b, micro, shortcut, _passes(train))
        gemms += work.gemms
        memory += work.memory_bytes
        kernels += work.kernels
        notes["adversarial"] = work.notes["adversarial"]
    if task == "flow-distill" and shortcut:
        r = distill_rows(b, cfg.levels, cfg.consistency_fraction, mode)
        teacher_fp32 = unet_inference(teacher.config, bf16=False).written
        student_bf16 = unet_inference(net.config, bf16=True, channels_last=True).written
        call_bytes = 0.0
        for who, k in r.calls:
            if who == "student":
                gemms += net.gemms(k, micro, backward=False, tag="student target call: ")
                call_bytes += student_bf16 * k
                kernels += net.call_kernels * micro * (COMPILED_KERNEL_SHARE if compiled else 1.0)
            else:
                gemms += teacher.gemms(k, micro, backward=False, tag=f"{who} call (fp32): ", cost=FP32_PRODUCT_COST)
                call_bytes += teacher_fp32 * k + FP32 * teacher.params
                kernels += teacher.call_kernels * micro
        memory.append(("no-grad calls' tensors", INFERENCE_PASSES * call_bytes * micro))
        notes["calls"] = (f"per micro-batch: {r.flow} rows matched to the teacher, {r.consistency} self-consistency "
                          f"rows ({r.smallest} at the smallest step); no-grad calls "
                          + ", ".join(f"{w} {k}" for w, k in r.calls) + f"; guidance {mode}")
    model_flops = 3.0 * net.forward_flops(b * micro)
    return StepWork(tuple(gemms), 0.0, tuple(memory), kernels, model_flops, float(b * micro), notes=notes,
                    compiled=compiled, optimizer_kernels=OPTIMIZER_KERNELS.get(opt_kind, OPTIMIZER_KERNELS["adamw"]))


def _adversarial_work(cfg, net: ImageNet, teacher: ImageNet, b: int, micro: int, shortcut: bool,
                      passes: float) -> StepWork:
    """The work the adversarial term adds to ``micro`` micro-batches of ``b`` rows: the student's calls of the fake
    sampling, forward and backward (``passes``: the step's bytes per saved byte); the critic's no-grad encoder call
    on the real and fake rows and the heads' forward and backward on them; the heads' Adam step (every micro-batch);
    the encoder's and heads' forward on the fakes and their backward to the image only (frozen: no weight
    gradients); and their kernels (``Critic.kernels``, the critic eager)."""
    calls = adversarial_calls(b, cfg.adversarial_step_counts)
    critic = critic_nets(teacher.config, cfg.disc_width)
    gemms: list[Gemm] = []
    first = net.convs[0]  # the input convolution: a later step's input is the earlier steps' output
    for n, rows in calls.groups:
        gemms += net.gemms(rows, n * micro, tag=f"fake sample call ({n}-step): ")
        if n > 1:
            gemms.append(Gemm(rows * first.size**2, first.c_in, first.c_out * first.kernel**2, (n - 1) * micro,
                              f"fake sample call ({n}-step): {first.name} input gradient of the later steps"))
    gemms += critic.encoder.gemms(2 * b, micro, backward=False, tag="critic on real and fake rows: ")
    gemms += critic.heads.gemms(2 * b, micro, tag="discriminator heads on real and fake rows: ")
    gemms += critic.encoder.gemms(b, micro, frozen=True, tag="critic on the fakes: ")
    gemms += critic.heads.gemms(b, micro, frozen=True, tag="discriminator heads on the fakes: ")
    call_saved = _fake_call_saved(net)
    encoder = unet_inference(teacher.config, bf16=True, channels_last=True, encoder=True)
    eager = ELEMENTWISE_PASSES["eager"]
    memory = (
        ("fake sample calls' elementwise kernels", call_saved * calls.call_rows * passes * micro),
        ("critic's elementwise kernels", (INFERENCE_PASSES * encoder.written * 2 * b
                                          + eager * (critic.saved_bytes * b + critic.heads.saved_bytes * 2 * b))
         * micro),
        ("discriminator step", OPTIMIZER_BYTES_PER_PARAM["adamw"] * critic.heads.params * micro),
    )
    note = (f"per micro-batch: {calls.calls} student calls with a backward on "
            + ", ".join(f"{rows} rows x {n}" for n, rows in calls.groups)
            + f"; the critic ({critic.heads.describe()}) on {2 * b} real and fake rows, then on the {b} fakes")
    return StepWork(tuple(gemms), 0.0, memory, critic.kernels(net, calls, shortcut) * micro,
                    notes={"adversarial": note})


def sample_work(unet: dict[str, Any], num_images: int, steps: int, sampler: str = "heun", guidance_scale: float = 1.0,
                guidance_interval: tuple[float, float] | None = None, batch_size: int | None = None,
                guide: bool = False, bf16: bool = False) -> StepWork:
    """The work of sampling ``num_images`` images with ``steps`` steps of ``sampler`` from a UNet of config
    ``unet``, in batches of ``batch_size`` (None: one batch); each call's forward products (fp32 outside autocast:
    ``FP32_PRODUCT_COST``), its tensors' traffic and kernels. A guided call (scale != 1 inside the interval) runs
    twice the rows (classifier-free) or two calls (``guide``: autoguidance). ``model_flops``: the network
    evaluations' forward FLOPs; ``samples``: the images (so ``StepTime.samples_per_second`` is images/s)."""
    net = flow_unet(unet)
    mode = sampling_guidance(net, guidance_scale, guide)
    b = min(batch_size or num_images, num_images)
    sizes = {b: num_images // b, **({num_images % b: 1} if num_images % b else {})}  # batch size -> batches
    plan = sampler_calls(sampler, steps, guidance_interval)
    guided = sum(1 for _, g in plan if g) if mode != "none" else 0
    cost = 1.0 if bf16 else FP32_PRODUCT_COST
    per_row = unet_inference(net.config, bf16=bf16).written
    weights = (FP32 + (2 * BF16 if bf16 else 0)) * net.params  # read (and cast under autocast) every call
    gemms: list[Gemm] = []
    traffic = kernels = evaluations = 0.0
    for size, batches in sizes.items():
        for calls, how in ((len(plan) - guided, "none"), (guided, mode)):
            for who, rows in _guided_calls(size, how) if calls else ():
                n = calls * batches
                tag = ("guide call" if who == "guide" else "call") + ("" if bf16 else " (fp32)") + ": "
                gemms += net.gemms(rows, n, backward=False, tag=tag, cost=cost)
                traffic += n * (INFERENCE_PASSES * per_row * rows + weights)
                kernels += n * (net.call_kernels + SAMPLER_KERNELS_PER_CALL)
                evaluations += n * rows
    notes = {"model": net.describe(),
             "calls": f"{len(plan)} calls per batch ({sampler}, {steps} steps, {guided} guided: {mode}), "
                      f"{evaluations / num_images:g} network evaluations per image, batches of up to {b}"}
    return StepWork(tuple(gemms), 0.0, (("network calls' tensors and weights", traffic),), kernels,
                    net.forward_flops(evaluations), float(num_images), notes=notes)


__all__ = ["AUTOCAST", "AdversarialCalls", "CUDA_GRAPH_POOL_SHARE", "Conv", "Critic", "Dense", "DistillRows",
           "FP32_PRODUCT_COST", "ImageLedger", "ImageNet", "Inference", "PipelineInfo", "Saved", "TASKS",
           "adversarial_calls", "cifar_resnet", "classifier_inference", "critic_nets", "distill_rows",
           "evaluations_per_image", "feature_heads", "flow_unet", "guidance_mode", "image_ledger", "image_step_work",
           "read_pipeline", "sample_memory", "sample_work", "sampler_calls", "task_net", "unet_config",
           "unet_inference"]
