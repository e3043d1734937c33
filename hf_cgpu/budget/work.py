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

import dataclasses
from dataclasses import dataclass, field

from .memory import (BF16, FP32, SPARSE_KL_BYTES_PER_ENTRY, adapted_linears, layer_activation_bytes_per_token,
                     regime)
from .shape import ModelShape, TrainSetup

ELEMENTWISE_PASSES = {"eager": 9.4, "compiled": 3.8}
"""Bytes the memory-bound kernels of a block move, as a multiple of the bytes the block saves for its backward
(eager: the autocast casts, transposes and contiguous copies around every product move the saved bytes many times
over; compiled: inductor fuses most of them). Fitted: the non-matmul, non-attention device time of the GPT
configurations of the ledger check's set A (benchmarks/RESULTS.md, "the ledger against 16 configurations")."""
OPTIMIZER_BYTES_PER_PARAM = {"adamw": 40.0, "adamw8bit": 92.0, "muon": 40.0, "lora": 40.0}
"""Bytes the optimizer step moves per trainable parameter: fused AdamW reads weight, gradient and two fp32 moments and
writes three (28), the gradient clip reads and scales the gradients and zeroing writes them (12). bitsandbytes'
8-bit blockwise kernel moves fewer bytes but runs far below the bandwidth: 80 is its measured time at the card's
bandwidth (set B's 770M run: 20.8 ms for 0.77B parameters on an H100), + 12."""
EMA_BYTES_PER_PARAM = 12.0
"""An fp32 EMA update reads the average and the weight and writes the average."""
LOSS_BYTES_PER_LOGIT = {"chunked": 54.0, "eager": 54.0, "compiled": 16.0}
"""Device bytes per logit of the loss's memory-bound kernels: eager, the fp32 upcast, softmax forward and backward and
their copies (set A's 30M run: 76 ms for 4.2G logits); compiled, inductor's fused cross-entropy (set A's 124M run)."""
LORA_BYTES_PER_TOKEN = {"in": 36.0, "out": 30.0, "in_recompute": 12.0, "out_recompute": 10.0}
"""Bytes per token an adapted linear's casts and adds move, per input / output feature: peft casts the input to the
adapter's fp32 and autocast back to bf16 (12 B per input feature forward, twice that backward), scales and adds the
adapter's output (10 B per output feature forward, twice backward); a full recompute repeats the forward."""
NF4_DEQUANT_BYTES_PER_PARAM = 2.5
"""A 4-bit weight de-quantised for one product: half a byte read, a bf16 copy written."""
KERNELS_PER_LAYER = {"gpt": 62, "gptneox": 72, "llama": 68}
"""Kernels one block launches in an eager forward and backward under autocast. gpt: set A's eager GPTs (350M: 1,509
per step over 24 blocks, the optimizer and loss kernels aside); gptneox and llama from set A's LoRA runs less their
adapters' kernels."""
KERNELS_PER_ADAPTED_LINEAR = 25
"""A LoRA adapter's kernels per step (casts, dropout, two products, scale, add, and their backward): set A's
Pythia-shape (4 adapted linears a block) and SmolLM2-shape (7) runs, solved together."""
RECOMPUTE_KERNEL_FACTOR = 4.0 / 3.0
"""A full recompute re-runs the forward: about a third of a block's kernels once more."""
COMPILED_KERNEL_SHARE = 0.82
"""Kernels a compiled step launches, as a share of the eager count: inductor fuses the elementwise chains, but the
products, attention and the norms' reductions stay kernels of their own (set A's 124M: 650 a step)."""
OPTIMIZER_KERNELS = {"adamw": 20, "adamw8bit": 20, "muon": 150, "lora": 20}
"""Kernels of the optimizer step, the clip and the zeroing (multi-tensor kernels; Muon runs its Newton-Schulz
iterations per stacked shape, eagerly)."""
HOST_OPS_PER_TENSOR = {"adamw8bit": 35.0}
"""Optimizers that loop over the parameter tensors in Python (bitsandbytes' 8-bit AdamW calls its kernel tensor by
tensor): host time per tensor, in bare eager-op times of the bench. Fitted: set B's 770M runs, whose optimizer step
spans 33.7 ms of the device's timeline for 20.8 ms of its kernels (147 tensors, a 6.45 us bare op)."""
MASKED_ATTENTION_SLOWDOWN = 1.75
"""Attention under a per-document mask (our GPT's --document_masking with sdpa) runs the memory-efficient kernel, not
flash: this many times the flash time. Fitted: set A's zh-poetry-modern step (6.3 ms against 3.6 for flash)."""
LOSS_KERNELS_PER_CHUNK = 12
"""Kernels of one checkpointed loss chunk, forward, recompute and backward."""
EXTRA_LOSS_BYTES_PER_LOGIT = 127.0
"""Device bytes per logit of a loss a GPT run adds beside its own (a multi-token head's cross-entropy, distillation's
KL per model in it): eager, soft-capped, checkpointed (its forward twice), outside the compiled model. Fitted: the
7-minute zh-poetry-modern run with 2 heads (a step 58 ms longer while the heads ran, 9 ms of it their products)."""
SPARSE_KL_BYTES_PER_LOGIT = 93.0
"""Device bytes per logit a cached teacher's sparse KL adds to the eager cross-entropy it shares a checkpointed chunk
with (``--teacher_top_k``): the logits' fp32 copy, log-sum-exp and gathers recomputed in the backward, the gathers'
scattered gradients and their sums. Fitted to the ratio of a cached top-32 run's step to the plain preset's on one
card (benchmarks/RESULTS.md, "a cached teacher's run against its H200 run")."""
TOP_K_BYTES_PER_LOGIT = 490.0
"""The top-K selection of a teacher cache's build (``--teacher_top_k``) on a GPU, in bytes per logit at the card's
bandwidth: a radix select per row runs far below it, and each batch's rows are copied to the host before the next
starts. Fitted to one measured build of zh-poetry-modern's top-32 (benchmarks/RESULTS.md, "a cached teacher's run
against its H200 run")."""


@dataclass(frozen=True)
class Gemm:
    """``count`` products of an (m x k) by (k x n) matrix, bf16."""

    m: float
    n: float
    k: float
    count: float = 1.0
    label: str = ""
    batch: float = 1.0
    """Products of this shape run together as one batched kernel (its rate is that of the whole batch's work)."""

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
    seq_len: int = 0
    """Tokens per sequence of the attention kernels (their efficiency grows with it); 0 = no attention."""
    compiled: bool = False
    """The step runs compiled (fused kernels, launched from generated code)."""
    optimizer_kernels: float = 0.0
    """Kernels of the optimizer step, clip and zeroing: launched eagerly after the backward, so a phase of their own."""
    optimizer_host_ops: float = 0.0
    """Host time of the optimizer step in bare eager-op times, where it is not its kernels' launches (a per-tensor
    Python loop); 0 = the launches of ``optimizer_kernels``."""
    host_copy_bytes: float = 0.0
    """Bytes copied between host and device memory (--recompute_policy offload: every block input out in the forward
    and back in the backward), on a side stream beside the compute."""
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
    forwards = 2.0 if setup.reruns_forward else 1.0
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
    if adapted:
        lb, rc = LORA_BYTES_PER_TOKEN, forwards == 2.0
        per_token = sum((lb["in"] + rc * lb["in_recompute"]) * lin.d_in + (lb["out"] + rc * lb["out_recompute"])
                        * lin.d_out for lin in shape.linears() if lin.name in adapted)
        fused = ELEMENTWISE_PASSES["compiled"] / ELEMENTWISE_PASSES["eager"] if compiled else 1.0  # as the blocks'
        memory.append(("adapters' casts and adds", per_token * t * layers * micro * fused))
    if setup.ema:
        memory.append(("EMA update", EMA_BYTES_PER_PARAM * trainable))
    if setup.tier == "qlora":
        memory.append(("4-bit weights de-quantised", NF4_DEQUANT_BYTES_PER_PARAM * shape.n_block_linear_params
                       * (2.0 + (1.0 if forwards == 2.0 else 0.0)) * micro))
    if not trainable_base:  # frozen base: the autocast copies are made once (bf16 base) or the weights are read
        memory.append(("frozen weights read", BF16 * shape.n_matmul_params * 2.0 * micro))
    else:
        memory.append(("autocast weight casts", (FP32 + BF16) * shape.n_matmul_params * micro))
    recompute = RECOMPUTE_KERNEL_FACTOR if forwards == 2.0 else 1.0
    kernels = (KERNELS_PER_LAYER[shape.family] + KERNELS_PER_ADAPTED_LINEAR * len(adapted)) * recompute * layers
    if setup.loss_chunk_size:
        kernels += LOSS_KERNELS_PER_CHUNK * -(-int(t) // setup.loss_chunk_size)
    kernels = kernels * micro * (COMPILED_KERNEL_SHARE if compiled else 1.0)
    model_flops = 6.0 * shape.matmul_params_per_token * t * micro + attn * 3.0 * 2.0  # MFU counts the full square
    if setup.adapters:
        model_flops -= 2.0 * shape.matmul_params_per_token * t * micro
    if setup.packed and shape.family == "gpt" and shape.attention == "sdpa":
        attention *= MASKED_ATTENTION_SLOWDOWN
    extra_gemms, extra_attention, extra_memory, extra_kernels = extra_loss_work(shape, setup)
    gemms += extra_gemms
    attention += extra_attention
    memory += extra_memory
    kernels += extra_kernels
    offload = setup.recompute_mode == "offload"
    offloaded = 2.0 * layers * regime(setup).resid * shape.d_model * t * micro if offload else 0.0
    return StepWork(tuple(gemms), attention, tuple(memory), kernels, model_flops, t * micro, setup.seq_len, compiled,
                    optimizer_kernels=OPTIMIZER_KERNELS.get(opt_kind, 20), host_copy_bytes=offloaded,
                    optimizer_host_ops=HOST_OPS_PER_TENSOR.get(opt_kind, 0.0) * _trainable_tensors(shape, setup))


def extra_loss_work(shape: ModelShape, setup: TrainSetup) -> tuple[list[Gemm], float, list, float]:
    """(products, attention FLOPs, memory-bound bytes, kernels) a step adds for its multi-token heads (each: a d x d
    residual matrix, then the LM head and its cross-entropy, for ``extra_heads_share`` of the steps) or its
    distillation teachers (each: a no-grad forward, then its LM head in the KL beside the student's; from a cache
    of the teacher's top-K: the sparse KL in the cross-entropy's checkpointed chunk, whose head runs once more)."""
    micro, t, V, d = setup.gradient_accumulation_steps, float(setup.tokens_per_micro_batch), shape.vocab_size, \
        shape.d_model
    chunks = -(-int(t) // setup.loss_chunk_size) if setup.loss_chunk_size else 1
    gemms: list[Gemm] = []
    attention = kernels = 0.0
    memory: list[tuple[str, float]] = []

    def head(width: int, trainable: bool, share: float, label: str) -> list[Gemm]:
        """An LM head inside a checkpointed loss: the forward twice, then (trainable) its two gradients."""
        out = [Gemm(t, V, width, 2 * micro * share, f"{label} forward")]
        if trainable:
            out += [Gemm(t, width, V, micro * share, f"{label} input gradient"),
                    Gemm(width, V, t, micro * share, f"{label} weight gradient")]
        return out

    if setup.extra_heads:
        share = setup.extra_heads_share * setup.extra_heads
        gemms += linear_gemms(t, d, d, True, "multi-token head", micro * share)
        gemms += head(d, True, share, "multi-token head's LM head")
        memory.append(("multi-token heads' loss", EXTRA_LOSS_BYTES_PER_LOGIT * t * V * micro * share))
        kernels += 2 * LOSS_KERNELS_PER_CHUNK * chunks * micro * share
    taught = setup.teacher_share  # --distill_anneal: the KL and the teachers only while their weight is above 0
    if setup.teachers and setup.teacher_top_k:  # the head runs in the checkpointed chunk: its forward once more
        gemms.append(Gemm(t, V, d, micro, "sparse KL chunk's head, recomputed in the backward"))
        memory.append(("sparse KL", (SPARSE_KL_BYTES_PER_ENTRY * setup.teacher_top_k + SPARSE_KL_BYTES_PER_LOGIT * V)
                       * t * micro * taught))
        kernels += LOSS_KERNELS_PER_CHUNK * chunks * micro
    elif setup.teachers:
        gemms += head(d, True, taught, "distillation student head")
        for i, teacher in enumerate(setup.teachers):
            g, a, m, k = teacher_forward(teacher, setup, t, micro * taught, f"teacher {i}")
            gemms += g + head(teacher.d_model, False, taught, f"teacher {i} head")
            attention, kernels = attention + a, kernels + k
            memory.append((f"teacher {i} forward", m))
        memory.append(("distillation KL", EXTRA_LOSS_BYTES_PER_LOGIT * t * V * micro * taught
                       * (1 + len(setup.teachers))))
        kernels += 2 * LOSS_KERNELS_PER_CHUNK * chunks * micro * taught * (1 + len(setup.teachers))
    return gemms, attention, memory, kernels


def teacher_forward(teacher: ModelShape, setup: TrainSetup, tokens: float, count: float, label: str
                    ) -> tuple[list[Gemm], float, float, float]:
    """(products, attention FLOPs, memory-bound bytes, kernels) of ``count`` no-grad forwards of ``teacher``'s blocks
    over ``tokens`` tokens in sequences of ``setup.seq_len`` (its LM head apart)."""
    gemms = [Gemm(tokens, lin.d_out, lin.d_in, teacher.depth * count, f"{label} {lin.name} forward")
             for lin in teacher.linears()]
    masked = MASKED_ATTENTION_SLOWDOWN if setup.packed and teacher.attention == "sdpa" else 1.0
    attention = 0.5 * 4.0 * tokens * setup.seq_len * teacher.q_dim * teacher.depth * count * masked
    passes = ELEMENTWISE_PASSES["compiled" if setup.compile else "eager"]
    per_token = layer_activation_bytes_per_token(teacher, setup, regime(setup))
    memory = per_token * tokens * teacher.depth * count * passes / 3
    return gemms, attention, memory, KERNELS_PER_LAYER[teacher.family] * teacher.depth * count / 3


def teacher_cache_work(setup: TrainSetup, vocab_size: int, gpu: bool = True) -> StepWork:
    """The one-off build of a teacher cache (``--teacher_top_k``): the teacher's eager no-grad forward over the
    training stream in micro-batches, its LM head, and the fp32 log-softmax and top-K of its logits."""
    teacher, t = setup.teachers[0], float(setup.tokens_per_micro_batch)
    count = setup.stream_tokens / t
    eager = dataclasses.replace(setup, compile=False)
    gemms, attention, memory, kernels = teacher_forward(teacher, eager, t, count, "teacher")
    gemms.append(Gemm(t, vocab_size, teacher.d_model, count, "teacher head"))
    select = TOP_K_BYTES_PER_LOGIT if gpu else 0.0
    logits = ("log-softmax and top-K", (4 * FP32 + select) * vocab_size * setup.stream_tokens)
    return StepWork(tuple(gemms), attention, (("teacher forward", memory), logits), kernels,
                    samples=setup.stream_tokens, seq_len=setup.seq_len)


def muon_gemms(shape: ModelShape, iterations: int = 5) -> list[Gemm]:
    """Newton-Schulz orthogonalisation of every block matrix (m <= n): per iteration X X^T, A A and B X, the layers'
    matrices of one shape stacked into one batched product."""
    out = []
    for lin in shape.linears():
        m, n = sorted((lin.d_in, lin.d_out))
        count = shape.n_layer * iterations
        out += [Gemm(m, m, n, count, f"muon {lin.name} X X^T", shape.n_layer),
                Gemm(m, m, m, count, f"muon {lin.name} A A", shape.n_layer),
                Gemm(m, n, m, count, f"muon {lin.name} B X", shape.n_layer)]
    return out


def _trainable_tensors(shape: ModelShape, setup: TrainSetup) -> int:
    """Parameter tensors the optimizer steps (LoRA: two per adapted linear and layer)."""
    if setup.adapters:
        return 2 * len(adapted_linears(shape, setup.lora_targets)) * shape.depth
    return len(shape.param_tensors())


def _trainable_params(shape: ModelShape, setup: TrainSetup) -> int:
    from .memory import lora_trainable_params

    return lora_trainable_params(shape, setup.lora_r, setup.lora_targets) if setup.adapters else shape.n_params


__all__ = ["Gemm", "StepWork", "linear_gemms", "lm_step_work", "muon_gemms"]
