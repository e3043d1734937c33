"""The memory ledger: every kind of GPU memory of one training step, in bytes, and the peak.

Pure arithmetic on a ``ModelShape`` and a ``TrainSetup`` (``shape``); ``ledger`` returns the rows in bytes so a
benchmark can print the prediction beside ``torch.cuda.max_memory_allocated()``.

Model states: a PyTorch AMP run (the trainer's) holds fp32 weights 4 + fp32 gradients 4 bytes per parameter, the
optimizer's state (its registry entry says how much: AdamW m, v 8 bytes per parameter), and bf16 copies of the
weights that autocast makes during the forward and keeps for the backward (2 more bytes per matmul weight).

What it counts beyond the seed chapter's rules (16 bytes per parameter, 34 d bytes per token per layer, a flat 1.2 GB
reserve):

1. Logits. Full logits cost ``B*T*V`` entries: bf16 from the head, an fp32 copy for the loss, fp32 log-softmax saved
   for backward, and two fp32 gradients at the start of backward. hf_cgpu computes the loss in chunks of
   ``loss_chunk_size`` tokens inside a checkpoint, so only one chunk of fp32 logits is alive.
2. Activations by tensor, not 34d. Every saved tensor is counted with its dtype: under AMP the residual stream and
   the LayerNorm inputs are fp32 (36d for a 4d GPT, no dropout); the MLP terms scale with ``d_ff`` (gated MLPs save
   three ``d_ff`` tensors); frozen LoRA/QLoRA base weights save no inputs but each adapter saves its own cast of its
   input; SDPA/flash attention saves no ``T x T`` scores, eager attention does.
3. Recompute. Full-layer checkpointing keeps each layer's input and during backward re-creates one whole layer's
   activations: that layer is a row of its own.
4. Gradients are alive through forward and backward only with gradient accumulation > 1; with accumulation 1
   the peak is the larger of "start of backward without gradients" and "optimizer step with all of them".
5. The flat reserve becomes three named rows: workspace (inside the allocator), allocator fragmentation (reserved -
   allocated) and the CUDA context (outside the allocator).

The constants below are dtype sizes and library facts, or calibrated against measured peaks (the calibration and
its error: benchmarks/RESULTS.md, memory). The per-tensor activation counts were checked against a meta-device trace
of live tensors (CUDA autocast rules, flash SDPA) for the GPT, GPT-NeoX and Llama layouts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SettingsError
from ..optim import optimizer_spec
from .shape import LinearSpec, ModelShape, TrainSetup, fmt_count

# ---- units -------------------------------------------------------------------------------------------------------
GiB = 1024**3
MiB = 1024**2
FP32 = 4
BF16 = 2

# ---- model states (exact: dtype sizes and library behaviour) -----------------------------------------------------
NF4_BYTES = 0.5
"""4-bit NormalFloat: two weights per byte."""
NF4_BLOCK = 64
"""bitsandbytes 4-bit quantizes blocks of 64 weights, one absmax each (fp32: 4/64 = 0.0625 B/param)."""
NF4_DOUBLE_QUANT_BLOCK = 256
"""Double quantization stores the absmax values in 8 bits, with one fp32 scale per 256 of them."""
NF4_DOUBLE_QUANT = True
"""The qlora tier double-quantizes the block scales (``tiers.load_base_model``)."""

# ---- activations (structural: per saved tensor, checked against a meta-device trace) -----------------------------
ACTIVATION_SCALE = 1.0
"""Multiplier on the per-tensor activation count. 1.0 reproduces the eager meta-device trace and, with the logit
constants below, the compiled GPT anchors: inductor saves about as much inside the blocks as eager does. Calibrate:
measured activation bytes / predicted."""
EAGER_SCORE_BYTES = FP32 + BF16
"""Eager attention saves the fp32 softmax output and its bf16 copy: 6 bytes per head per key per token."""
FLASH_LSE_BYTES = FP32
"""Flash/memory-efficient SDPA saves one fp32 log-sum-exp per head per token."""
PACKED_MASK_BYTES = {"sdpa": 1, "eager": BF16}
"""Packed rows: ``create_causal_mask`` turns restarting ``position_ids`` into one (B, 1, T, T) mask shared by every
layer and saved for backward: bool for SDPA (which then runs its memory-efficient kernel), additive in the compute
dtype for eager. Quadratic in T: a reason long sequences are trained one example per row."""

# ---- logits and loss ---------------------------------------------------------------------------------------------
LOGITS_EAGER_BYTES = 12
"""Full logits, eager cross-entropy with the fp32 upcast: fp32 log-softmax saved (4) + at the start of backward the
fp32 gradient of the log-softmax and of the logits at once (4 + 4). A loop that takes ``model(...).loss`` at once (the
trainer's, and the HF Trainer's) drops the logits before backward: the upcast is a new tensor and log-softmax saves
its output. A loop that keeps them alive pays ``Regime.logits`` more per entry (``ledger(logits_held=True)``)."""
LOSS_EXTRA_LOGIT_BYTES = {"head": 12.0, "kl_student": 11.0, "kl_teacher": 12.0}
"""Bytes per logit of the losses a GPT run adds beside its own, each an eager checkpointed call over one loss chunk
(all of a micro-batch's tokens without --loss_chunk_size): a multi-token head's cross-entropy (its bf16 logits, the
fp32 upcast and log-softmax, re-created one head at a time in the backward), and distillation's KL (the student's
logits so, and each teacher's fp32 log-softmax beside them). Fitted to the zh-poetry-modern preset at 16,384 tokens a
micro-batch: 2 heads reserved 1.63 GiB more than the plain run, one teacher 3.33 GiB more (0.21 of it its weights)."""
SPARSE_KL_BYTES_PER_ENTRY = 24.0
"""Bytes per cached entry a micro-batch's sparse KL holds (``--teacher_top_k``): its cache rows gathered (int64 id,
fp32 value) and the K-entry softmax with its gradient (fp32 each); counted, not fitted."""
TEACHER_CACHE_VALUE_BYTES = 2
"""A cached log-probability on CUDA: fp16 (the bf16 teacher's logits lose nothing in it)."""
LOGITS_COMPILED_BYTES = 6
"""Full logits with the cross-entropy inside a torch.compile region (nanoGPT-style whole-model compile): inductor
fuses the upcast, log-softmax and its gradient; fitted to measured peaks of compiled GPTs. Our GPT compiled whole
with full logits is this case (``TrainSetup.compiled_loss``)."""
LOGITS_SOFTCAP_BYTES = {"compiled": 6, "eager": 4}
"""Per logit, what ``c * tanh(logits / c)`` saves on top of the loss's own bytes: eager, tanh's fp32 output; compiled,
fitted to the measured peak of a compiled run with full logits (benchmarks/RESULTS.md, the speedrun options)."""
LOGITS_CHUNK_BYTES = 16
"""One checkpointed loss chunk (``loss_chunk_size`` tokens x V): bf16 logits 2 + fp32 copy 4 + fp32 log-softmax 4 + its
two fp32 gradients, not all at once (a meta-device trace counts 17 per entry)."""
SPARSE_KL_LOGIT_BYTES = 4
"""Per logit, what a cached teacher's sparse KL adds to the chunk (``--teacher_top_k``): the gathers' gradient
scattered into an fp32 buffer of the logits' shape; checked against a cached top-32 run's measured peak
(benchmarks/RESULTS.md, "a cached teacher's run against its H200 run")."""

# ---- several GPUs ------------------------------------------------------------------------------------------------
FSDP_UNSHARDED_BLOCKS = 2
"""FSDP2 all-gathers one block while the previous one computes (forward and backward prefetch): two blocks' whole
bf16 parameters (accelerate's bf16 policy: param_dtype bf16) and, in backward, their bf16 gradients before the
reduce-scatter. Structural (torch's FSDP2 prefetches one unit ahead), not yet measured on GPUs."""

RECOMPUTE_BACKWARD_BYTES_PER_TOKEN = {"adapters": 31.0}
"""x d bytes per token the re-run block's backward holds beside its re-created activations (the gradients of its
intermediates and of its input) with a frozen base (LoRA, QLoRA). Fitted: peak allocated minus the rows above on the
Pythia-1.4B shape at 16k-64k tokens, full recompute and offload, LoRA and QLoRA (28-32 x d; benchmarks/RESULTS.md,
long context)."""
OFFLOAD_FRAGMENTATION_FRACTION = 0.16
"""Reserved beyond ``FRAGMENTATION_FRACTION`` under --recompute_policy offload: the block inputs fetched back on the
copy stream come from that stream's own pool, which the compute stream's tensors cannot reuse. Fitted: LoRA offload on
the Pythia-1.4B shape reserved 1.17-1.26 x its peak allocated at 16k-64k tokens."""
OFFLOAD_DEVICE_BLOCK_INPUTS = 2
"""Block inputs on the device under --recompute_policy offload during the backward: the block being re-run and the one
before it, fetched back from host memory while this one runs (``tiers.recompute.HostOffload``)."""

# ---- outside the tensors -----------------------------------------------------------------------------------------
WORKSPACE_BYTES = 128 * MiB
"""cuBLAS + cuBLASLt workspaces (32 MiB each per stream on sm_90 and newer, allocated through PyTorch's caching
allocator so they count in max_memory_allocated), SDPA scratch and rounding. An assumption: calibrate as
max_memory_allocated - (sum of live tensors) in a one-layer step."""
CUDA_CONTEXT_BYTES = 512 * MiB
"""CUDA context, kernels and cuBLAS handles outside the allocator (with lazy module loading on an RTX 40/50; compiled
Triton kernels add more). An assumption: measure as nvidia-smi's process memory - reserved."""
FRAGMENTATION_FRACTION = 0.04
"""Allocator reserve on top of the peak allocated bytes, fitted to measured reserved / allocated. Varying sequence
lengths fragment more (set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)."""
LOGITS_RESERVE_BYTES = {"eager": 4, "compiled": 2}
"""Full logits (no loss chunks) leave one logits-sized block reserved beyond the peak allocated: the fp32 copy of an
eager loss, the bf16 logits of a compiled one, freed where nothing else of that size fits. Fitted: set A of the
ledger check (the 30M GPT with eager full logits reserved 2.7 GiB over its peak, the compiled 124M 1.2 GiB)."""

# ===================================================================================================================
# Model states
# ===================================================================================================================


def _matches(lin: LinearSpec, targets: Sequence[str]) -> bool:
    for t in targets:
        t = t.strip()
        if t in ("all-linear", "all"):
            return True
        if t == "attn" and lin.group in ("attn_in", "attn_out"):
            return True
        if t == "mlp" and lin.group in ("mlp_in", "mlp_out"):
            return True
        if t in (lin.name, lin.role, *lin.aliases):
            return True
    return False


def adapted_linears(shape: ModelShape, targets: Sequence[str]) -> list[LinearSpec]:
    """The block linears LoRA wraps for ``targets`` (peft's "all-linear" also skips the LM head)."""
    chosen = [lin for lin in shape.linears() if _matches(lin, targets)]
    if not chosen:
        names = ", ".join(lin.name for lin in shape.linears())
        wanted = ",".join(targets)
        raise SettingsError(f"LoRA targets {wanted!r} match no linear of {shape.family}: use all-linear or {names}")
    return chosen


def lora_trainable_params(shape: ModelShape, rank: int = 16, targets: Sequence[str] = ("all-linear",)) -> int:
    """r * (d_in + d_out) per adapted linear per layer (A is r x d_in, B is d_out x r; no adapter bias)."""
    return shape.n_layer * sum(rank * (lin.d_in + lin.d_out) for lin in adapted_linears(shape, targets))


def nf4_bytes_per_param(double_quant: bool) -> float:
    """0.5 B of codes + the block scales: fp32 per 64 weights (0.0625 B), or 8-bit per 64 + fp32 per 256 blocks."""
    if double_quant:
        return NF4_BYTES + 1 / NF4_BLOCK + FP32 / (NF4_BLOCK * NF4_DOUBLE_QUANT_BLOCK)
    return NF4_BYTES + FP32 / NF4_BLOCK


@dataclass(frozen=True)
class StateBytes:
    weights: float
    gradients: float
    optimizer: float
    master: float
    autocast_copies: float
    trainable_params: int
    notes: dict[str, str]


def model_state_bytes(shape: ModelShape, setup: TrainSetup, r: Regime | None = None) -> StateBytes:
    """Weights, gradients, optimizer state (the optimizer's registry entry counts it), master copy and autocast weight
    copies for the tier."""
    r = r or regime(setup)
    tensors = shape.param_tensors()
    n = shape.n_params
    spec = optimizer_spec(setup.optimizer)
    if setup.adapters:
        n_lora = lora_trainable_params(shape, setup.lora_r, setup.lora_targets)
        adapters = FP32 * n_lora
        if setup.tier == "lora":
            base, base_note = BF16 * n, "bf16 base 2 B/param"
        else:
            q = shape.n_block_linear_params
            base = nf4_bytes_per_param(NF4_DOUBLE_QUANT) * q + r.rest_weights * (n - q)
            base_note = (f"nf4 block linears {nf4_bytes_per_param(NF4_DOUBLE_QUANT):.3f} B/param + "
                         f"{'fp32' if r.rest_weights == FP32 else 'bf16'} embeddings/head/norms")
        opt, opt_note = spec.state_bytes([(n_lora, "adapter")], setup.tier)
        return StateBytes(
            weights=base + adapters, gradients=FP32 * n_lora, optimizer=opt, master=0.0,
            autocast_copies=0.0, trainable_params=n_lora,
            notes={
                "weights": f"{base_note} + {fmt_count(n_lora)} fp32 adapter params",
                "gradients": "fp32, adapters only",
                "optimizer": opt_note,
                "master": "none: the base is frozen",
            },
        )
    opt, opt_note = spec.state_bytes([(m, kind) for _, m, kind in tensors], setup.tier)
    cast = BF16 * (shape.n_matmul_params + sum(m for _, m, k in tensors if k == "bias"))
    return StateBytes(
        weights=FP32 * n, gradients=FP32 * n, optimizer=opt, master=0.0, autocast_copies=cast, trainable_params=n,
        notes={
            "weights": "fp32 4 B/param (they are the master copy)",
            "gradients": "fp32 4 B/param",
            "optimizer": opt_note,
            "master": "none: AMP keeps fp32 weights",
            "autocast_copies": "bf16 casts of the matmul weights, made in forward and saved for backward",
        },
    )


# ===================================================================================================================
# Activations
# ===================================================================================================================


@dataclass(frozen=True)
class Regime:
    """Bytes per element of the tensors a block saves, for one way of running it (see ``regime``)."""

    autocast: bool
    norm_save: int
    """Each norm's saved input."""
    norm_shared: bool
    """Norms reading the same tensor share one saved input (no per-norm cast)."""
    norm_out: int
    """Norm output, the input of attn_in / mlp_in linears."""
    proj_out: int
    """Output of the attn_in / mlp_in linears (q, k, v, fc)."""
    attn: int
    """q, k, v and the output as saved by attention."""
    resid: int
    """Residual stream (what checkpointing keeps per block)."""
    base_trainable: bool
    adapter_copy: int
    """Bytes of the copy each adapter saves of its input (0 = it saves the shared input tensor)."""
    logits: int
    """Dtype of the logits the head produces."""
    rest_weights: int = BF16
    """Bytes per weight of what a 4-bit base keeps unquantized (embeddings, head, norms)."""


def regime(setup: TrainSetup) -> Regime:
    """How hf_cgpu's tiers run a block, from the dtypes involved.

    amp (full, adamw8bit): fp32 weights under CUDA autocast: LayerNorm runs in fp32 (its fp32 input and output are
      saved / cast), every linear makes its own bf16 copy of an fp32 input, attention and linear outputs are bf16,
      residual fp32.
    lora: bf16 base under autocast: each norm saves an fp32 cast of the bf16 residual; peft's fp32 cast of an adapter
      input is followed by autocast's bf16 cast, which is what the adapter saves (2 B).
    qlora: as lora, but bnb's Linear4bit returns its input's dtype: q, k, v and the MLP hidden come out fp32 from fp32
      norm outputs, and the residual turns fp32 after the first MLP.
    Another way of running the same tiers (a benchmark's peer) passes its own ``Regime`` to ``ledger``.
    """
    if not setup.adapters:
        return Regime(autocast=True, norm_save=FP32, norm_shared=True, norm_out=FP32, proj_out=BF16, attn=BF16,
                      resid=FP32, base_trainable=True, adapter_copy=0, logits=BF16)
    if setup.tier == "lora":
        return Regime(autocast=True, norm_save=FP32, norm_shared=False, norm_out=FP32, proj_out=BF16, attn=BF16,
                      resid=BF16, base_trainable=False, adapter_copy=BF16, logits=BF16)
    return Regime(autocast=True, norm_save=FP32, norm_shared=True, norm_out=FP32, proj_out=FP32, attn=BF16,
                  resid=FP32, base_trainable=False, adapter_copy=BF16, logits=BF16)


FP32_REGIME = Regime(autocast=False, norm_save=FP32, norm_shared=True, norm_out=FP32, proj_out=FP32, attn=FP32,
                     resid=FP32, base_trainable=True, adapter_copy=0, logits=FP32)
"""A run without autocast (the CPU's fp32): every saved tensor 4 bytes, no bf16 weight copies."""


def host_ledger(shape: ModelShape, setup: TrainSetup) -> Ledger:
    """The memory a CPU run of a full-tier model holds, counted as on a GPU with fp32 tensors: a per-document mask
    (packed rows) sends the CPU's attention to its math kernel, which saves the T x T scores like eager attention."""
    if setup.packed:
        shape = dataclasses.replace(shape, attention="eager")
    led = ledger(shape, setup, regime=FP32_REGIME)
    cast = next(r.bytes for r in led.rows if r.key == "autocast_copies")  # fp32 weights are used as they are
    held = led.allocated - cast + led.host_pinned  # offloaded block inputs are copies in the same memory
    return dataclasses.replace(led, allocated=held, total=held, fragmentation=0.0, reserved=held, cuda_context=0.0)


def _group_input_bytes(shape: ModelShape, setup: TrainSetup, r: Regime) -> float:
    """Linear inputs a block saves for the weight gradients (trainable base) or for the adapters (LoRA)."""
    adapted = {lin.name for lin in adapted_linears(shape, setup.lora_targets)} if setup.adapters else set()
    total = 0.0
    groups: dict[str, list[LinearSpec]] = {}
    for lin in shape.linears():
        groups.setdefault(lin.group, []).append(lin)
    for group, lins in groups.items():
        d_in = lins[0].d_in
        from_norm = group in ("attn_in", "mlp_in")
        in_bytes = r.norm_out if from_norm else (r.attn if group == "attn_out" else r.proj_out)
        users = [lin for lin in lins if r.base_trainable or lin.name in adapted]
        if not users:
            continue
        if r.base_trainable:
            if r.autocast and in_bytes != BF16:
                total += BF16 * d_in * len(users)  # one autocast cast per linear, each saved
            elif not (group == "attn_out" and r.attn == BF16):  # flash's output is the o-proj input (a view)
                total += in_bytes * d_in
            continue
        if r.adapter_copy:  # each adapter casts its input and saves its own copy
            total += r.adapter_copy * d_in * len(users)
        elif not (group == "attn_out" and r.attn == BF16):
            total += in_bytes * d_in  # adapters share the (already fp32) input tensor
    return total


def _attention_stats_bytes(shape: ModelShape, setup: TrainSetup, r) -> float:
    """What attention saves per token besides q, k, v and its output: eager's scores, or flash's log-sum-exp."""
    if shape.attention == "eager":
        return (EAGER_SCORE_BYTES if r.attn == BF16 else FP32) * shape.n_head * setup.seq_len
    return FLASH_LSE_BYTES * shape.n_head


def layer_activation_bytes_per_token(shape: ModelShape, setup: TrainSetup, r: Regime | None = None) -> float:
    """Bytes one block saves for backward per token (no recompute), before ``ACTIVATION_SCALE``.

    Counted per saved tensor: norm inputs, linear inputs (``_group_input_bytes``), q/k/v (+ rotary copies) and the
    attention output, flash's log-sum-exp (or eager scores), and the MLP hidden tensors (scaled by ``d_ff``).
    A 4d GPT under AMP: 8 (two fp32 LayerNorm inputs) + 12 (bf16 linear inputs: qkv 2, fc 2, fc_out 8; proj reads
    the attention output itself) + 8 (q, k, v, output) + 8 (GELU input) = 36 d (the seed's 34 d
    assumes a bf16 residual stream and counts two dropout masks).
    """
    r = r or regime(setup)
    d, ff, q, kv = shape.d_model, shape.d_ff, shape.q_dim, shape.kv_dim
    n_norms = 2
    if shape.family == "llama":  # RMSNorm: fp32 upcast of the input + normalised tensor for a trainable gain
        norm = n_norms * (FP32 + (r.resid if r.base_trainable else 0)) * d
    else:
        shared = shape.parallel_residual and r.norm_shared
        norm = (1 if shared else n_norms) * r.norm_save * d
    # attention inputs: q, k, v as attention saves them (views of the fused projection for gpt, fresh rotary copies
    # for llama; gpt-neox keeps the fused buffer alive through v and adds rotary copies of q and k)
    # (an fp32 projection under autocast is cast to bf16 for SDPA, and the fp32 buffer is then free)
    attn = r.attn * (q + 2 * kv)
    if shape.family == "gptneox" and r.proj_out == r.attn:
        attn += r.attn * (q + kv)
    if shape.family == "gpt" and (shape.qk_norm or not shape.n_positions):
        attn += r.attn * (q + kv)  # cgpt rotary / qk_norm: fresh q, k while v keeps the fused qkv buffer alive
    attn += r.attn * q + _attention_stats_bytes(shape, setup, r)  # output, scores or log-sum-exp
    if shape.family == "llama":  # gate out (SiLU input), up out, SiLU out
        mlp = 3 * r.proj_out * ff
    else:  # GELU input
        mlp = r.proj_out * ff
    return norm + _group_input_bytes(shape, setup, r) + attn + mlp


def outside_blocks_bytes_per_token(shape: ModelShape, setup: TrainSetup, r: Regime | None = None) -> float:
    """The final norm's saved input and the head's input (kept for the head / loss-chunk backward), and the fp32
    lookups of the value-embedding tables (saved for their mixing weights' gradients, kept across recompute), and
    without recompute the mixed values of each layer a table feeds (a fresh bf16 tensor attention saves, in place of
    the qkv buffer's view)."""
    r = r or regime(setup)
    mixed = 0 if setup.recompute else BF16 * 2 * shape.value_embeddings * shape.layer_loops
    return (r.norm_save + BF16 + FP32 * shape.value_embeddings + mixed) * shape.d_model


def selective_kept_bytes_per_token(shape: ModelShape, setup: TrainSetup, r: Regime | None = None) -> float:
    """Bytes one block keeps per token under selective recompute (``tiers.selective_recompute_policy``), before
    ``ACTIVATION_SCALE``: the block input (the checkpoint's), the outputs of its projections (qkv, out, MLP) and of
    attention (output + log-sum-exp); the norms, activations and casts are re-run in the backward. The LoRA A outputs
    (r values per adapted linear) are left out."""
    r = r or regime(setup)
    d, ff, q, kv = shape.d_model, shape.d_ff, shape.q_dim, shape.kv_dim
    mlp = (2 * ff + d) if shape.family == "llama" else (ff + d)
    projections = r.proj_out * (q + 2 * kv + d + mlp)
    return r.resid * d + projections + r.attn * q + _attention_stats_bytes(shape, setup, r)


@dataclass(frozen=True)
class ActivationBytes:
    no_recompute: float
    recompute: float
    """Block inputs kept by checkpointing (+ the final norm and head inputs)."""
    recompute_layer: float
    """One block's activations re-created during backward (only with recompute)."""
    per_token_per_layer: float
    selective: float = 0.0
    """What every block keeps under selective recompute (+ the final norm and head inputs)."""
    selective_layer: float = 0.0
    """One block's re-run norms and activations during the backward under selective recompute."""
    offload: float = 0.0
    """On the device under offload: ``OFFLOAD_DEVICE_BLOCK_INPUTS`` block inputs (+ the final norm and head inputs)."""
    host: float = 0.0
    """In pinned host memory under offload: every block's input."""

    def kept(self, setup: TrainSetup) -> tuple[float, float]:
        """(activations alive at the start of the backward, one block's tensors re-created in it) for ``setup``."""
        return {"off": (self.no_recompute, 0.0), "full": (self.recompute, self.recompute_layer),
                "selective": (self.selective, self.selective_layer),
                "offload": (self.offload, self.recompute_layer)}[setup.recompute_mode]


def activation_bytes(shape: ModelShape, setup: TrainSetup, r: Regime | None = None) -> ActivationBytes:
    tokens = setup.tokens_per_micro_batch
    r = r or regime(setup)
    per_layer = layer_activation_bytes_per_token(shape, setup, r) * ACTIVATION_SCALE
    outside = outside_blocks_bytes_per_token(shape, setup, r) * tokens
    kept = min(per_layer, selective_kept_bytes_per_token(shape, setup, r) * ACTIVATION_SCALE)
    block_input = r.resid * shape.d_model * tokens
    return ActivationBytes(
        no_recompute=shape.depth * per_layer * tokens + outside,
        recompute=shape.depth * block_input + outside,
        recompute_layer=per_layer * tokens,
        per_token_per_layer=per_layer,
        selective=shape.depth * kept * tokens + outside,
        selective_layer=(per_layer - kept) * tokens,
        offload=min(OFFLOAD_DEVICE_BLOCK_INPUTS, shape.depth) * block_input + outside,
        host=shape.depth * block_input,
    )


def logits_bytes(shape: ModelShape, setup: TrainSetup, r: Regime | None = None,
                 logits_held: bool = False) -> tuple[float, str]:
    """Logits and loss: one checkpointed chunk, or the full (B*T, V) logits (compiled or eager cross-entropy)."""
    V, tokens = shape.vocab_size, setup.tokens_per_micro_batch
    compiled = bool(setup.compiled_loss) and not setup.loss_chunk_size
    cap = LOGITS_SOFTCAP_BYTES["compiled" if compiled else "eager"] if shape.logit_softcap else 0
    capped = f", soft-capped (+{cap} B each)" if cap else ""
    if setup.teachers and setup.teacher_top_k:  # the cross-entropy and the sparse KL in checkpointed chunks
        chunk = min(setup.loss_chunk_size or tokens, tokens)
        per = LOGITS_CHUNK_BYTES + SPARSE_KL_LOGIT_BYTES + cap
        return per * chunk * V, (f"one chunk of {chunk} tokens x {V} vocab with the sparse KL, {per} B "
                                 f"each{capped}")
    if setup.loss_chunk_size:
        chunk, per = min(setup.loss_chunk_size, tokens), LOGITS_CHUNK_BYTES + cap
        return per * chunk * V, f"one chunk of {chunk} tokens x {V} vocab, {per} B each{capped}"
    if compiled:
        per = LOGITS_COMPILED_BYTES + cap
        return per * tokens * V, f"full {tokens} x {V} logits, compiled cross-entropy{capped}"
    per = LOGITS_EAGER_BYTES + cap + ((r or regime(setup)).logits if logits_held else 0)
    return per * tokens * V, f"full {tokens} x {V} logits, eager fp32 loss, {per} B each{capped}"


def teacher_cache_bytes(setup: TrainSetup, vocab_size: int) -> float:
    """The teacher cache on the GPU: K (token id, log-probability) per position of the training stream, the ids in
    2 bytes where the vocabulary fits int16."""
    ids = 2 if vocab_size <= 2**15 else 4
    return float(setup.stream_tokens * setup.teacher_top_k * (ids + TEACHER_CACHE_VALUE_BYTES))


def extra_loss_rows(shape: ModelShape, setup: TrainSetup) -> list[Row]:
    """The multi-token heads' and the distillation's memory (none when the run has neither): the teachers' bf16
    weights and the KL's chunk of logits, or the heads' chunk (the settings refuse both in one run)."""
    rows = []
    chunk = (min(setup.loss_chunk_size, setup.tokens_per_micro_batch) if setup.loss_chunk_size
             else setup.tokens_per_micro_batch) * shape.vocab_size
    b = LOSS_EXTRA_LOGIT_BYTES
    if setup.teachers and setup.teacher_top_k:  # the teacher let go once its cache is built
        k, n = setup.teacher_top_k, setup.stream_tokens
        rows.append(Row("teacher_cache", "teacher cache", teacher_cache_bytes(setup, shape.vocab_size),
                        f"top-{k} (id, fp16 log-probability) at {n:,} stream positions, on the GPU all run" if n else
                        "not priced: the stream's size is not known (hf-cgpu budget: --corpus_tokens N)"))
        rows.append(Row("distill_logits", "sparse KL", SPARSE_KL_BYTES_PER_ENTRY * setup.tokens_per_micro_batch * k,
                        f"the micro-batch's cache rows, {SPARSE_KL_BYTES_PER_ENTRY:g} B an entry; the student's logits "
                        "are the cross-entropy's chunk"))
    elif setup.teachers:
        rows.append(Row("teachers", "teachers' weights", sum(BF16 * t.n_params for t in setup.teachers),
                        f"{len(setup.teachers)} frozen bf16 model{'s' * (len(setup.teachers) > 1)} (--teacher), "
                        "their forward under no_grad"))
        per = b["kl_student"] + b["kl_teacher"] * len(setup.teachers)
        rows.append(Row("distill_logits", "distillation logits", per * chunk,
                        f"the KL's chunk: {chunk // shape.vocab_size:,} tokens x {shape.vocab_size} vocab, "
                        f"{per:g} B each"))
    elif setup.extra_heads:
        rows.append(Row("head_logits", "multi-token heads' logits", b["head"] * chunk,
                        f"one head's chunk at a time: {chunk // shape.vocab_size:,} tokens x {shape.vocab_size} "
                        f"vocab, {b['head']:g} B each ({setup.extra_heads} heads, d x d each)"))
    return rows


# ===================================================================================================================
# The ledger
# ===================================================================================================================


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    bytes: float
    note: str = ""


class Totals:
    """What every ledger (language models' ``Ledger``, the image tasks' ``ImageLedger``) answers from its rows and
    totals: the verdict against the cap, one row's bytes, and the figures a benchmark prints beside its
    measurement."""

    rows: tuple[Row, ...]
    allocated: float
    fragmentation: float
    reserved: float
    cuda_context: float
    total: float
    memory_cap: float | None

    @property
    def fits(self) -> bool:
        return self.memory_cap is None or self.total <= self.memory_cap

    def row(self, key: str) -> float:
        return next(r.bytes for r in self.rows if r.key == key)

    def as_dict(self) -> dict[str, float]:
        """Bytes per row plus the totals (and the ledger's ``extra_figures``)."""
        return {**{r.key: r.bytes for r in self.rows}, **self.extra_figures(), "allocated": self.allocated,
                "fragmentation": self.fragmentation, "reserved": self.reserved, "cuda_context": self.cuda_context,
                "total": self.total}

    def extra_figures(self) -> dict[str, float]:
        return {}


@dataclass(frozen=True)
class Ledger(Totals):
    """Predicted memory of one training step, in bytes. ``allocated`` compares with max_memory_allocated()."""

    shape: ModelShape
    setup: TrainSetup
    rows: tuple[Row, ...]
    allocated: float
    fragmentation: float
    reserved: float
    cuda_context: float
    total: float
    peak_phase: str
    """'backward start' (activations + logits) or 'optimizer step' (all gradients + states)."""
    activations_no_recompute: float
    activations_recompute: float
    memory_cap: float | None = None
    host_pinned: float = 0.0
    """Pinned host memory (not on the card): the block inputs --recompute_policy offload keeps there."""

    def extra_figures(self) -> dict[str, float]:
        return {"activations_no_recompute": self.activations_no_recompute,
                "activations_recompute": self.activations_recompute, "host_pinned": self.host_pinned}


def parallel_rows(shape: ModelShape, setup: TrainSetup, rows: list[Row], st: StateBytes) -> list[Row]:
    """The rows of one GPU of ``setup.processes``. DDP: a whole replica plus its gradient buckets (the reducer's flat
    fp32 copies of the trainable gradients, allocated for the whole run). FSDP2: weights, gradients, optimizer state
    (and master) divided by the processes; no autocast copies (the blocks are gathered in bf16); the gathered units:
    the root's parameters (embeddings, head, final norm: not resharded between forward and backward) and
    ``FSDP_UNSHARDED_BLOCKS`` blocks' parameters and gradients in bf16."""
    p = setup.processes
    if p == 1:
        return rows
    if not setup.fsdp:
        return [*rows, Row("ddp_buckets", "DDP gradient buckets", st.gradients,
                           f"fp32 copies of the trainable gradients for the all-reduce ({p} processes)")]
    shard = {"weights", "gradients", "optimizer", "master", "ema"}
    out = [Row(r.key, r.label, r.bytes / p, f"{r.note}; 1/{p} per GPU (FSDP2 shard)") if r.key in shard else r
           for r in rows]
    out = [Row(r.key, r.label, 0.0, "none: FSDP2 gathers the blocks in bf16") if r.key == "autocast_copies" else r
           for r in out]
    block = sum(n for name, n, _ in shape.param_tensors() if name.startswith("h.0."))
    root = shape.n_params - shape.n_layer * block
    blocks = min(FSDP_UNSHARDED_BLOCKS, shape.n_layer)
    unsharded = BF16 * root + blocks * block * (BF16 + (BF16 if st.trainable_params == shape.n_params else 0))
    return [*out, Row("fsdp_unsharded", "FSDP2 gathered units", unsharded,
                      f"bf16 root (embeddings/head) + {blocks} blocks' bf16 weights and gradients being gathered")]


def packed_mask_row(shape: ModelShape, setup: TrainSetup) -> Row:
    """The attention mask of packed rows (``PACKED_MASK_BYTES``); 0 when rows hold one example each."""
    if not setup.packed:
        return Row("packed_mask", "packed-rows mask", 0.0, "none: one example per row, causal kernel")
    per = PACKED_MASK_BYTES[shape.attention]
    return Row("packed_mask", "packed-rows mask", float(per * setup.micro_batch_size * setup.seq_len**2),
               f"B x T x T, {per} B each, from the restarting positions")


def ledger(
    shape: ModelShape, setup: TrainSetup | None = None, memory_cap: float | None = None,
    regime: Regime | None = None, logits_held: bool = False, **overrides: Any
) -> Ledger:
    """Predict the memory of a training step of ``shape`` under ``setup`` (fields can be overridden by keyword).

    The peak is the larger of two moments: the start of backward (all activations and the loss's logits alive,
    gradients only if accumulation > 1) and the optimizer step (all gradients, no activations). ``regime`` counts
    another way of running the same tier (a benchmark's peer) and ``logits_held`` a loop that keeps the model's
    logits alive through the backward.
    """
    setup = dataclasses.replace(setup or TrainSetup(), **overrides)
    st = model_state_bytes(shape, setup, regime)
    act = activation_bytes(shape, setup, regime)
    logits, logits_note = logits_bytes(shape, setup, regime, logits_held)
    accumulate = setup.gradient_accumulation_steps > 1
    grads_at_peak = st.gradients if accumulate else 0.0
    activations, recompute_layer = act.kept(setup)
    backward_grads = (RECOMPUTE_BACKWARD_BYTES_PER_TOKEN["adapters"] * shape.d_model * setup.tokens_per_micro_batch
                      if setup.recompute and setup.adapters else 0.0)
    per_d = act.per_token_per_layer / shape.d_model
    if setup.recompute_mode == "selective":
        act_note = (f"block inputs, projection and attention outputs; without recompute {fmt_gib(act.no_recompute)} "
                    f"({per_d:.1f} x d/token/layer)")
    elif setup.recompute_mode == "offload":
        act_note = (f"{min(OFFLOAD_DEVICE_BLOCK_INPUTS, shape.depth)} block inputs (the re-run one and the next, "
                    f"fetched back); all {shape.depth} in host memory ({fmt_gib(act.host)}); on the card with full "
                    f"recompute {fmt_gib(act.recompute)}")
    elif setup.recompute:
        act_note = f"block inputs only; without recompute {fmt_gib(act.no_recompute)} ({per_d:.1f} x d/token/layer)"
    else:
        act_note = f"{per_d:.1f} x d bytes/token/layer; with recompute {fmt_gib(act.recompute + act.recompute_layer)}"
    grad_note = st.notes["gradients"] + (
        ", alive all step (accumulation > 1)" if accumulate else f", counted at the step only ({fmt_gib(st.gradients)})"
    )
    rows = [
        Row("weights", "weights", st.weights, st.notes["weights"]),
        Row("gradients", "gradients", grads_at_peak, grad_note),
        Row("optimizer", "optimizer state", st.optimizer, st.notes["optimizer"]),
        Row("master", "fp32 master copy", st.master, st.notes["master"]),
        Row("ema", "EMA of the weights", FP32 * st.trainable_params if setup.ema else 0.0,
            "fp32 4 B per trainable param (--ema_decay)" if setup.ema else "none (--ema_decay 0)"),
        Row("autocast_copies", "autocast weight copies", st.autocast_copies, st.notes.get("autocast_copies", "none")),
        Row("activations", "activations", activations, act_note),
        Row("recompute_layer", "recomputed block", recompute_layer + backward_grads,
            ("one block's activations re-created in backward" + (
                f" + {fmt_gib(backward_grads)} of its gradients" if backward_grads else ""))
            if setup.recompute else "no recompute"),
        Row("logits", "logits + loss", logits, logits_note),
        *extra_loss_rows(shape, setup),
        packed_mask_row(shape, setup),
        Row("workspace", "workspace (cuBLAS etc.)", WORKSPACE_BYTES, "cuBLAS/cuBLASLt workspaces, SDPA scratch"),
    ]
    if setup.recompute:  # the loss's backward frees the logits before the first block is re-run
        rows.append(Row("overlap", "not at the same time", -min(logits, recompute_layer + backward_grads),
                        "recomputed block and logits never coexist: only the larger counts"))
    rows = parallel_rows(shape, setup, rows, st)
    states = sum(r.bytes for r in rows if r.key in ("weights", "optimizer", "master", "ema", "ddp_buckets"))  # FSDP2
    # units are resharded by the optimizer step
    backward_start = sum(r.bytes for r in rows)
    grads_all = (st.gradients / setup.processes) if setup.processes > 1 and setup.fsdp else st.gradients
    optimizer_step = states + grads_all + WORKSPACE_BYTES  # fused AdamW: no temp
    if optimizer_step > backward_start:
        allocated, phase = optimizer_step, "optimizer step"
    else:
        allocated, phase = backward_start, "backward start"
    fragmentation = (FRAGMENTATION_FRACTION + (OFFLOAD_FRAGMENTATION_FRACTION if setup.recompute_mode == "offload"
                                               else 0.0)) * allocated
    if not setup.loss_chunk_size:
        kind = "compiled" if setup.compiled_loss else "eager"
        fragmentation += LOGITS_RESERVE_BYTES[kind] * setup.tokens_per_micro_batch * shape.vocab_size
    reserved = allocated + fragmentation
    return Ledger(
        shape=shape, setup=setup, rows=tuple(rows), allocated=allocated, fragmentation=fragmentation,
        reserved=reserved, cuda_context=CUDA_CONTEXT_BYTES, total=reserved + CUDA_CONTEXT_BYTES, peak_phase=phase,
        activations_no_recompute=act.no_recompute, activations_recompute=act.recompute + act.recompute_layer,
        memory_cap=memory_cap, host_pinned=act.host if setup.recompute_mode == "offload" else 0.0,
    )



# ===================================================================================================================
# Sizes in and out
# ===================================================================================================================

_UNITS = {"mb": MiB, "mib": MiB, "m": MiB, "gb": GiB, "gib": GiB, "g": GiB, "tb": 1024 * GiB, "tib": 1024 * GiB}


def parse_memory(text: str) -> int:
    """'16GB', '15.5 GiB', '12000MB' -> bytes. GB is read as GiB: a "16 GB" card has 16 GiB of DRAM."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise SettingsError(f"cannot read memory size {text!r}: write a number and a unit, e.g. 16GB, 15.5GiB or 12000MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"

