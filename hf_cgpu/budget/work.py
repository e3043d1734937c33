"""What one training step does on the card, by kind of work: the input of the time ledger (``time.step_time``).

A ``StepWork`` is counted from the run's description alone (no torch): the tensor-core products with their shapes
(a linear's forward, its input gradient and its weight gradient are three products; a convolution is the implicit
product of its unfolded input), the fused attention kernels' FLOPs, the bytes the memory-bound kernels move (norms,
activations, casts, residual adds, the loss, the optimizer update, the EMA), and the kernels the step launches.
Every task the CLI trains declares its work the same way, so one time model prices them all.

Memory-bound bytes of a block are counted from the bytes its tensors occupy: the forward writes each saved tensor once
and reads it back in the backward, which writes a gradient of the same size and reads the tensors it multiplies by,
so eager PyTorch moves about ``ELEMENTWISE_PASSES["eager"]`` times the block's saved bytes and a compiled step (fused
kernels) fewer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .memory import BF16, FP32, adapted_linears, layer_activation_bytes_per_token, regime
from .shape import ModelShape, TrainSetup

ELEMENTWISE_PASSES = {"eager": 4.0, "compiled": 2.0}
"""Bytes the memory-bound kernels of a block move, as a multiple of the bytes the block saves for its backward."""
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 28.0 + 12.0, "adamw8bit": 14.0 + 12.0, "muon": 28.0 + 12.0, "lora": 40.0}
"""Bytes the optimizer step moves per trainable parameter: fused AdamW reads weight, gradient and two fp32 moments and
writes three (28), the gradient clip reads the gradients and scales them and zeroing writes them (12); 8-bit AdamW
keeps one-byte moments."""
EMA_BYTES_PER_PARAM = 12.0
"""An fp32 EMA update reads the average and the weight and writes the average."""
LOSS_BYTES_PER_LOGIT = {"chunked": 24.0, "eager": 24.0, "compiled": 12.0}
"""Bytes per logit of the loss's memory-bound kernels (fp32 upcast, log-softmax, its gradient)."""
NF4_DEQUANT_BYTES_PER_PARAM = 2.5
"""A 4-bit weight de-quantised for one product: half a byte read, a bf16 copy written."""
KERNELS_PER_LAYER = {"gpt": 60, "gptneox": 70, "llama": 75}
"""Kernels one block launches in an eager forward and backward under autocast (counted on the CPU with a dispatch
trace of each layout: tests/test_budget_time.py)."""
KERNELS_PER_ADAPTED_LINEAR = 14
"""A LoRA adapter's extra kernels per step (dropout, two products, scale, add, their backward)."""
COMPILED_KERNEL_SHARE = 0.35
"""Kernels a compiled step launches, as a share of the eager count (inductor fuses the elementwise chains)."""
OPTIMIZER_KERNELS = 12
"""Kernels of the fused optimizer step, the clip and the zeroing (multi-tensor kernels: a few per step)."""


@dataclass(frozen=True)
class Gemm:
    """``count`` products of an (m x k) by (k x n) matrix, bf16."""

    m: float
    n: float
    k: float
    count: float = 1.0
    label: str = ""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class StepWork:
    """One optimizer step (every micro-batch of it) on one GPU."""

    gemms: tuple[Gemm, ...]
    attention_flops: float = 0.0
    """FLOPs inside fused attention kernels (the causal half of the square: what they execute)."""
    memory_bytes: tuple[tuple[str, float], ...] = ()
    """(what, bytes) of the memory-bound kernels."""
    kernels: float = 0.0
    """Kernels launched, as eager PyTorch runs the step."""
    model_flops: float = 0.0
    """The step's model FLOPs as MFU counts them (no recompute)."""
    samples: float = 0.0
    """Samples (tokens, images) the step trains on."""
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def gemm_flops(self) -> float:
        return sum(g.flops for g in self.gemms)


def linear_gemms(tokens: float, d_in: int, d_out: int, weight_grad: bool, label: str, count: float = 1.0,
                 forwards: float = 1.0) -> list[Gemm]:
    """A linear over ``tokens`` rows: its forward (``forwards`` times: recompute runs it twice), the input gradient,
    and (trainable) the weight gradient."""
    out = [Gemm(tokens, d_out, d_in, count * forwards, f"{label} forward"),
           Gemm(tokens, d_in, d_out, count, f"{label} input gradient")]
    if weight_grad:
        out.append(Gemm(d_in, d_out, tokens, count, f"{label} weight gradient"))
    return out


def lm_step_work(shape: ModelShape, setup: TrainSetup) -> StepWork:
    """The work of one optimizer step of a causal LM run (pretraining or fine-tuning, every tier)."""
    micro = setup.gradient_accumulation_steps
    t = float(setup.tokens_per_micro_batch)
    forwards = 2.0 if setup.recompute_mode == "full" else 1.0
    layers = shape.depth
    trainable_base = not setup.adapters
    adapted = {lin.name for lin in adapted_linears(shape, setup.lora_targets)} if setup.adapters else set()
    gemms: list[Gemm] = []
    for lin in shape.linears():
        gemms += linear_gemms(t, lin.d_in, lin.d_out, trainable_base, lin.name, layers * micro, forwards)
        if lin.name in adapted:
            r = setup.lora_r
            gemms += linear_gemms(t, lin.d_in, r, True, f"{lin.name} lora A", layers * micro, forwards)
            gemms += linear_gemms(t, r, lin.d_out, True, f"{lin.name} lora B", layers * micro, forwards)
    gemms += linear_gemms(t, shape.d_model, shape.vocab_size, trainable_base, "head", micro)
    if setup.optimizer == "muon" and trainable_base:
        gemms += muon_gemms(shape)
    # causal flash attention: QK^T and AV over half the T x T square, forward 4 T d per token, backward 2.5x
    attn = 0.5 * 4.0 * t * setup.seq_len * shape.q_dim * layers * micro
    attention = attn * (1.0 + 2.5 + (1.0 if forwards == 2.0 else 0.0))
    compiled = setup.compile
    passes = ELEMENTWISE_PASSES["compiled" if compiled else "eager"]
    block = layer_activation_bytes_per_token(shape, setup, regime(setup)) * t * layers * micro * passes
    loss_kind = "chunked" if setup.loss_chunk_size else ("compiled" if setup.compiled_loss else "eager")
    loss = LOSS_BYTES_PER_LOGIT[loss_kind] * t * shape.vocab_size * micro
    trainable = _trainable_params(shape, setup)
    opt_kind = "lora" if setup.adapters else ("adamw8bit" if setup.tier == "adamw8bit" else setup.optimizer)
    opt_bytes = OPTIMIZER_BYTES_PER_PARAM.get(opt_kind, OPTIMIZER_BYTES_PER_PARAM["adamw"]) * trainable
    memory = [("blocks' elementwise kernels", block), ("loss", loss), ("optimizer step", opt_bytes)]
    if setup.ema:
        memory.append(("EMA update", EMA_BYTES_PER_PARAM * trainable))
    if setup.tier == "qlora":
        memory.append(("4-bit weights de-quantised", NF4_DEQUANT_BYTES_PER_PARAM * shape.n_block_linear_params
                       * (2.0 + (1.0 if forwards == 2.0 else 0.0)) * micro))
    if not trainable_base:  # frozen base: the autocast copies are made once (bf16 base) or the weights are read
        memory.append(("frozen weights read", BF16 * shape.n_matmul_params * 2.0 * micro))
    else:
        memory.append(("autocast weight casts", (FP32 + BF16) * shape.n_matmul_params * micro))
    kernels = (KERNELS_PER_LAYER[shape.family] * forwards + KERNELS_PER_ADAPTED_LINEAR * len(adapted)) * layers
    kernels = kernels * micro * (COMPILED_KERNEL_SHARE if compiled else 1.0) + OPTIMIZER_KERNELS
    model_flops = 6.0 * shape.matmul_params_per_token * t * micro + attn * 3.0 * 2.0  # MFU counts the full square
    if setup.adapters:
        model_flops -= 2.0 * shape.matmul_params_per_token * t * micro
    return StepWork(tuple(gemms), attention, tuple(memory), kernels, model_flops, t * micro)


def muon_gemms(shape: ModelShape, iterations: int = 5) -> list[Gemm]:
    """Newton-Schulz orthogonalisation of every block matrix (m <= n): per iteration X X^T, A A and B X."""
    out = []
    for lin in shape.linears():
        m, n = sorted((lin.d_in, lin.d_out))
        count = shape.n_layer * iterations
        out += [Gemm(m, m, n, count, f"muon {lin.name} X X^T"), Gemm(m, m, m, count, f"muon {lin.name} A A"),
                Gemm(m, n, m, count, f"muon {lin.name} B X")]
    return out


def _trainable_params(shape: ModelShape, setup: TrainSetup) -> int:
    from .memory import lora_trainable_params

    return lora_trainable_params(shape, setup.lora_r, setup.lora_targets) if setup.adapters else shape.n_params


__all__ = ["Gemm", "StepWork", "linear_gemms", "lm_step_work", "muon_gemms"]
