"""The time ledger: training FLOPs per token (the one count the trainer's MFU uses too) and hours.

Training FLOPs per token = 6 N + 12 L T d (N = matmul parameters: block linears + the LM head; 12 L T d is the
attention: per layer and token the forward computes QK^T (2 T d) and AV (2 T d), backward twice that, counted
over the full T x T square as in PaLM's MFU convention even though causal kernels skip half). Frozen weights need
no weight gradient (4 N instead of 6 N); recompute adds a forward (2 N + 4 L T d), which MFU leaves out.
Hours = tokens x FLOPs / (peak x utilisation).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bench import load_measured_peak
from .card import Card
from .memory import lora_trainable_params
from .shape import ModelShape, TrainSetup
from .work import Gemm, StepWork

CHINCHILLA_TOKENS_PER_PARAM = 20
DEFAULT_MFU = 0.4
ASSUMED_PEAK_TFLOPS = 165.0
"""Used by ``hf-cgpu budget`` only when neither --peak_tflops nor a saved ``hf-cgpu bench`` exists: the seed's
150-180 TFLOP/s dense bf16 range for a consumer Blackwell card (RTX 5070 Ti)."""


def flops_per_token(shape: ModelShape, setup: TrainSetup, count_recompute: bool = True) -> float:
    """Training FLOPs per token (see the module docstring for the derivation).

    Full: 6 N + 12 L T d. Frozen base (LoRA/QLoRA): 4 N (no weight gradients) + 6 N_adapters + 12 L T d.
    Full recompute adds one more forward, 2 N + 4 L T d, when ``count_recompute`` (executed FLOPs, for hours;
    selective recompute re-runs no matmul and adds none);
    model FLOPs utilisation (MFU) counts the model's FLOPs without it.
    """
    n = shape.matmul_params_per_token
    attn = attention_flops_per_token(shape, setup.seq_len)  # forward a third of it, backward two thirds
    if setup.adapters:
        n_lora = lora_trainable_params(shape, setup.lora_r, setup.lora_targets)
        flops = 4.0 * n + 6.0 * n_lora + attn
        extra = 2.0 * (n + n_lora) + attn / 3
    else:
        flops = 6.0 * n + attn
        extra = 2.0 * n + attn / 3
    return flops + (extra if setup.reruns_forward and count_recompute else 0.0)  # selective: no matmul


def attention_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """12 L T d: QK^T and AV over the full T x T square, forward (4 L T d) and backward (8 L T d)."""
    return 12.0 * shape.depth * seq_len * shape.d_model


def chinchilla_tokens(params: float) -> float:
    """Compute-optimal tokens (Hoffmann et al. 2022): ~20 per parameter."""
    return CHINCHILLA_TOKENS_PER_PARAM * params


def training_hours(tokens: float, flops_token: float, peak_tflops: float, mfu: float = DEFAULT_MFU) -> float:
    """Wall-clock hours for ``tokens`` at ``peak_tflops * mfu`` sustained."""
    return tokens * flops_token / (peak_tflops * 1e12 * mfu) / 3600


def peak_tflops(explicit: float = 0.0, use_bench: bool = True, assumed: float = 0.0) -> tuple[float, str]:
    """The bf16 peak every MFU and hour divides by, with where it came from: ``explicit`` (--peak_tflops), else
    the last ``hf-cgpu bench`` of this machine (when ``use_bench``), else ``assumed`` (0 = unknown)."""
    if explicit > 0:
        return explicit, "--peak_tflops"
    if use_bench:
        measured = load_measured_peak()
        if measured:
            return measured, "hf-cgpu bench"
    if assumed:
        return assumed, "an assumed 5070 Ti figure; run `hf-cgpu bench`"
    return 0.0, "unknown (run `hf-cgpu bench` or pass --peak_tflops)"


# ===================================================================================================================
# Step time: the work of one step at the card's rates
# ===================================================================================================================

ATTENTION_EFFICIENCY = 0.75
"""Share of the card's large-matmul rate fused attention sustains on long sequences (FlashAttention-3 reports ~75% of
an H100's bf16 peak)."""
ATTENTION_HALF_SEQ = 1536
"""Sequence length at which fused attention reaches half of ``ATTENTION_EFFICIENCY``: a short sequence gives each
(batch, head) few tiles of the causal triangle to spread over the SMs. Fitted: set A's sequence-1024 GPTs (0.30 of
the matmul rate)."""
DEVICE_KERNEL_FACTOR = 1.7
"""Device time every kernel costs beyond its work (launch gap, tail, a small grid's idle SMs), as a multiple of the
bench's kernel-in-a-CUDA-graph time. Fitted: set A's SmolLM2-shape LoRA, whose 14,609 small kernels a step are its
device time."""
HOST_KERNEL_FACTOR = {"eager": 5.8, "compiled": 2.0}
"""Host time per kernel of a training step, as a multiple of the bench's bare eager op: autograd, module calls and
peft's wrappers around every op (set A's host-bound LoRA runs: 33.5 and 39.8 us a kernel against 6.3 for a bare op);
a compiled graph launches its kernels from generated code."""
COMPILE_SECONDS = {"base": 12.0, "per_layer": 4.6}
"""A cold torch.compile of a training step: seconds before the first step, plus per block it unrolls."""
HOST_LINK_GBS = 25.0
"""Host<->device copy rate assumed for activation offload: a PCIe 4.0/5.0 x16 link's sustained pinned-memory figure."""
CHECKPOINT_WRITE_GBS = 1.0
"""GB/s a checkpoint is written at (safetensors + torch.save to a local disk, fsynced)."""


@dataclass(frozen=True)
class TimeRow:
    key: str
    label: str
    seconds: float
    note: str = ""


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by kind of work; ``seconds`` compares with a run's median step."""

    rows: tuple[TimeRow, ...]
    device_seconds: float
    """Forward and backward on the device."""
    host_seconds: float
    """Forward and backward on the host (launching their kernels)."""
    card: Card
    work: StepWork
    optimizer_device_seconds: float = 0.0
    optimizer_host_seconds: float = 0.0
    copy_seconds: float = 0.0
    """Host<->device copies of the forward and backward (offload), on a side stream beside the compute."""

    @property
    def seconds(self) -> float:
        """The device runs behind the host's launches and beside the side stream's copies: each phase takes the
        longest of them."""
        return (max(self.device_seconds, self.host_seconds, self.copy_seconds)
                + max(self.optimizer_device_seconds, self.optimizer_host_seconds))

    @property
    def bound(self) -> str:
        if self.copy_seconds > max(self.device_seconds, self.host_seconds):
            return "copy-bound (host<->device link)"
        return "launch-bound (host)" if self.host_seconds > self.device_seconds else "device-bound"

    @property
    def samples_per_second(self) -> float:
        return self.work.samples / self.seconds

    @property
    def mfu(self) -> float:
        return self.work.model_flops / self.seconds / (self.card.matmul_tflops * 1e12)


def step_time(work: StepWork, card: Card, cuda_graphs: bool = False) -> StepTime:
    """Seconds of ``work`` on ``card``: each product at the card's rate for its shape, attention at an efficiency that
    grows with the sequence, memory-bound bytes at the bandwidth, and a per-kernel cost on the device; the host
    launches every kernel (eager, or from compiled code) or replays one graph (``cuda_graphs``). Two phases, each as
    long as the slower of device and host: forward + backward, then the optimizer step (eager, after the backward)."""
    optimizer = {"optimizer step"}
    opt_gemm = [g for g in work.gemms if g.label.startswith("muon")]
    matmul = sum(_gemm_seconds(g, card) for g in work.gemms)
    efficiency = ATTENTION_EFFICIENCY * work.seq_len / (work.seq_len + ATTENTION_HALF_SEQ) if work.seq_len else 1.0
    attention = work.attention_flops / (card.matmul_tflops * 1e12 * efficiency)
    bandwidth = card.bandwidth_gbs * 1e9
    memory = sum(b for _, b in work.memory_bytes) / bandwidth
    per_kernel = card.graph_launch_us * DEVICE_KERNEL_FACTOR * 1e-6
    kernels = (work.kernels + work.optimizer_kernels) * per_kernel
    opt_device = (sum(_gemm_seconds(g, card) for g in opt_gemm) + work.optimizer_kernels * per_kernel
                  + sum(b for what, b in work.memory_bytes if what in optimizer) / bandwidth)
    opt_host = (work.optimizer_host_ops or work.optimizer_kernels * HOST_KERNEL_FACTOR["eager"]) * card.launch_us * 1e-6
    if cuda_graphs:  # one replay launches the step's kernels
        host = 0.0
    else:
        host = work.kernels * card.launch_us * HOST_KERNEL_FACTOR["compiled" if work.compiled else "eager"] * 1e-6
    mem_note = ", ".join(f"{what} {b / 1e9:.2f} GB" for what, b in work.memory_bytes if b)
    device = matmul + attention + memory + kernels
    rows = (
        TimeRow("matmul", "matmuls", matmul,
                f"{work.gemm_flops / 1e12:.2f} TFLOP in {len(work.gemms)} shapes at the card's rate per shape"),
        TimeRow("attention", "attention kernels", attention,
                f"{work.attention_flops / 1e12:.2f} TFLOP at {efficiency:.0%} of the matmul rate"),
        TimeRow("memory", "memory-bound kernels", memory, f"at {card.bandwidth_gbs:,.0f} GB/s: {mem_note}"),
        TimeRow("kernels", "kernel overhead", kernels,
                f"{work.kernels + work.optimizer_kernels:,.0f} kernels x {per_kernel * 1e6:.1f} us"),
    )
    copies = work.host_copy_bytes / (HOST_LINK_GBS * 1e9)
    if copies:
        rows += (TimeRow("host_copies", "host copies (beside)", copies,
                         f"{work.host_copy_bytes / 1e9:.2f} GB of block inputs out and back at {HOST_LINK_GBS:g} GB/s "
                         "on a side stream: the step takes the longer of these and the compute"),)
    return StepTime(rows, device - opt_device, host, card, work, opt_device, opt_host, copies)


def _gemm_seconds(g: Gemm, card: Card) -> float:
    return g.count * 2.0 * g.m * g.n * g.k / card.matmul_rate(g.m * g.batch, g.n, g.k)


# ===================================================================================================================
# Run time: the steps, and what a run does besides them
# ===================================================================================================================

FORWARD_SHARE = 1.0 / 3.0
"""An evaluation micro-batch costs about the forward of a training micro-batch: a third of its step."""


@dataclass(frozen=True)
class RunTime:
    """A run's minutes: the step time, the per-run rows (start-up, evaluations, checkpoints) and the steps done."""

    step: StepTime
    rows: tuple[TimeRow, ...]
    steps: int
    """Optimizer steps the run does: max_steps, or those --max_minutes holds."""
    max_steps: int
    minutes: float
    """--max_minutes (0 = none)."""

    @property
    def seconds(self) -> float:
        return self.steps * self.step.seconds + sum(r.seconds for r in self.rows)

    @property
    def limited_by_minutes(self) -> bool:
        return self.steps < self.max_steps


def run_time(step: StepTime, train, startup_s: float = 0.0, eval_batches: float = 0.0,
             checkpoint_bytes: float = 0.0, before: tuple[TimeRow, ...] = ()) -> RunTime:
    """The run of ``train`` (its TrainSettings) at ``step`` per optimizer step: ``startup_s`` before the first step
    (compile), ``eval_batches`` forward micro-batches per evaluation (every ``eval_steps`` and at the end),
    ``checkpoint_bytes`` written every ``checkpointing_steps``; ``--max_minutes`` (counted from the first step's
    start, compile included, as the loop counts it) bounds the steps; ``before``: what the run does before the loop
    (a teacher cache), outside those minutes."""
    micro = max(1, train.gradient_accumulation_steps)
    eval_each = eval_batches * step.seconds / micro * FORWARD_SHARE
    ckpt_each = checkpoint_bytes / (CHECKPOINT_WRITE_GBS * 1e9)
    per_step = step.seconds + (eval_each / train.eval_steps if train.eval_steps else 0.0) + (
        ckpt_each / train.checkpointing_steps if train.checkpointing_steps else 0.0)
    steps = train.max_steps
    if train.max_minutes > 0:
        held = max(0, int((train.max_minutes * 60 - startup_s) / per_step))
        steps = min(steps, held)
    evals = (steps // train.eval_steps if train.eval_steps else 0) + 1
    ckpts = (steps // train.checkpointing_steps if train.checkpointing_steps else 0) + 1
    rows = (TimeRow("startup", "start-up (compile)", startup_s,
                    "torch.compile of the step before the first one" if startup_s else "no compile"),
            TimeRow("evaluation", "evaluations", evals * eval_each,
                    f"{evals} x {eval_batches:,.0f} forward micro-batches" if eval_batches else "none priced"),
            TimeRow("checkpoints", "checkpoints", ckpts * ckpt_each,
                    f"{ckpts} x {checkpoint_bytes / 1e9:.2f} GB at {CHECKPOINT_WRITE_GBS:g} GB/s"),
            *before)
    return RunTime(step, rows, steps, train.max_steps, train.max_minutes)


def compile_seconds(blocks: int, compiled: bool) -> float:
    """``COMPILE_SECONDS`` for a step of ``blocks`` blocks (0 when not compiled)."""
    return COMPILE_SECONDS["base"] + COMPILE_SECONDS["per_layer"] * blocks if compiled else 0.0
