"""Memory and time ledger: what fits on one card, and how long training takes.

``hf-cgpu budget`` (or ``python -m hf_cgpu.budget``) prints one row per kind of GPU memory, the verdict against a
memory cap, the next rung of the memory-saving ladder when it does not fit, and the time for a Chinchilla-sized
run. Everything here is pure arithmetic on a ``ModelShape`` and a ``TrainSetup``; ``ledger`` returns the rows in
bytes so a benchmark can print the prediction beside ``torch.cuda.max_memory_allocated()``.

Model states follow the seed chapter: mixed-precision AdamW costs 16 bytes per parameter (bf16 weights 2 + bf16
grads 2 + fp32 master 4 + Adam m, v 8), which ``seed_model_state_bytes`` reproduces (350M -> 5.2 GiB, 770M ->
11.5 GiB, 1.4B -> 20.9 GiB; the seed's "GB" is GiB). What a PyTorch AMP run really holds is also 16 bytes per
parameter (fp32 weights 4 + fp32 grads 4 + Adam 8), plus bf16 copies of the weights that autocast makes during the
forward and keeps for the backward (2 more bytes per matmul weight).

What this ledger corrects in the seed's ``budget.py``:

1. Logits. The seed leaves them out. Full logits cost ``B*T*V`` entries: bf16 from the head, an fp32 copy for the
   loss, fp32 log-softmax saved for backward, and two fp32 gradients at the start of backward (~12-14 bytes per
   entry eager: 3.4 GiB at 350M, micro-batch 8, vocab 32000, more than the seed's whole 0.4 GiB of recomputed
   activations). hf_cgpu computes the loss in chunks of ``loss_chunk`` tokens inside a checkpoint, so only one
   chunk of fp32 logits is alive.
2. Activations by tensor, not 34d. The seed's 34 bytes x d per token per layer (Korthikanti et al. 2022) assumes a
   bf16 residual stream, dropout masks and a 4d MLP. Here every saved tensor is counted with its dtype: under AMP
   the residual stream and the LayerNorm inputs are fp32 (36d for a 4d GPT, no dropout); the MLP terms scale with
   ``d_ff`` (gated MLPs save three ``d_ff`` tensors); frozen LoRA/QLoRA base weights save no inputs but each
   adapter saves its own cast of its input; SDPA/flash attention saves no ``T x T`` scores, eager attention does.
3. Recompute. Full-layer checkpointing keeps each layer's input (2d bf16 as in the seed; 4d when the residual is
   fp32) and during backward re-creates one whole layer's activations: that layer is a row of its own.
4. Gradients are alive through forward and backward only with gradient accumulation > 1; with accumulation 1
   the peak is the larger of "start of backward without gradients" and "optimizer step with all of them".
5. The seed's flat 1.2 GiB reserve becomes three named rows: workspace (inside the allocator), allocator
   fragmentation (reserved - allocated) and the CUDA context (outside the allocator).
6. The memory-saving ladder of the seed (smaller micro-batch with more accumulation -> recompute -> shorter
   sequence -> 8-bit AdamW -> LoRA -> QLoRA) is searched by ``autofit``, with a reason for every rung.

Time: training FLOPs per token = 6 N + 12 L T d (N = matmul parameters: block linears + the LM head; 12 L T d is
the attention: per layer and token the forward computes QK^T (2 T d) and AV (2 T d), backward twice that, counted
over the full T x T square as in PaLM's MFU convention even though causal kernels skip half). Frozen weights need
no weight gradient (4 N instead of 6 N); recompute adds a forward (2 N + 4 L T d). Hours = tokens x FLOPs /
(peak x utilisation).

Calibration constants are module-level names below, each with the measurement it came from. Anchors (H200,
``docs/gpu.md``): nanoGPT-style GPT, vocab 32k, seq 1024, fp32 master + bf16 autocast, whole-model torch.compile,
no recompute, full logits: 350M at micro-batch 8 peaked at 12.8 GiB allocated, 770M at micro-batch 4 at 15.6 GiB
allocated / 16.2 GiB reserved; Pythia-1.4B full training with AdamW8bit: 20.9 GiB. The per-tensor activation
counts were checked against a meta-device trace of live tensors (CUDA autocast rules, flash SDPA) for the GPT,
GPT-NeoX and Llama layouts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ---- units -------------------------------------------------------------------------------------------------------
GiB = 1024**3
MiB = 1024**2
FP32 = 4
BF16 = 2

# ---- model states (exact: dtype sizes and library behaviour) -----------------------------------------------------
ADAM_STATE_BYTES = 2 * FP32
"""AdamW keeps m and v in fp32: 8 bytes per trainable parameter."""
ADAM8BIT_STATE_BYTES = 2
"""bitsandbytes AdamW8bit keeps m and v in one byte each."""
BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps 32-bit state for tensors with fewer elements (``min_8bit_size``): norms, biases."""
BNB_8BIT_BLOCK = 256
"""Blockwise 8-bit state: one fp32 absmax per 256 values, per state tensor (m and v)."""
NF4_BYTES = 0.5
"""4-bit NormalFloat: two weights per byte."""
NF4_BLOCK = 64
"""bitsandbytes 4-bit quantizes blocks of 64 weights, one absmax each (fp32: 4/64 = 0.0625 B/param)."""
NF4_DOUBLE_QUANT_BLOCK = 256
"""Double quantization stores the absmax values in 8 bits, with one fp32 scale per 256 of them."""
FOREACH_ADAMW_TEMP_BYTES = FP32
"""Unfused (foreach) AdamW materialises sqrt(v) for all parameters at the step; fused AdamW needs nothing."""

# ---- activations (structural: per saved tensor, checked against a meta-device trace) -----------------------------
ACTIVATION_SCALE = 1.0
"""Multiplier on the per-tensor activation count. 1.0 reproduces the eager trace exactly (GPT AMP: 36.07 d per token
per layer counted, 36 d predicted; GPT-NeoX stock LoRA 50.1 vs 50; NeoX stock QLoRA 72.3 vs 72) and, with the
logit constants below, the compiled H200 anchors (350M mb8 12.8 GiB, 770M mb4 15.6 GiB) within 2%: inductor saves
about as much inside the blocks as eager does. Calibrate: measured activation bytes / predicted."""
EAGER_SCORE_BYTES = FP32 + BF16
"""Eager attention saves the fp32 softmax output and its bf16 copy: 6 bytes per head per key per token."""
FLASH_LSE_BYTES = FP32
"""Flash/memory-efficient SDPA saves one fp32 log-sum-exp per head per token."""

# ---- logits and loss ---------------------------------------------------------------------------------------------
LOGITS_EAGER_BYTES = 12
"""Full logits, eager cross-entropy with the fp32 upcast: fp32 log-softmax saved (4) + at the start of backward the
fp32 gradient of the log-softmax and of the logits at once (4 + 4). Meta-device trace of a 350M GPT step: 12.0 bytes
per logit. The logits tensor itself is extra when the caller keeps the model output alive (``LOGITS_HELD``)."""
LOGITS_HELD = False
"""Whether the (B*T, V) logits from the head stay alive until backward. HF causal LMs return them in their output
object, but a loop that takes ``model(...).loss`` at once (``benchmarks/bench_memory.py``, and the HF Trainer's
``compute_loss``/``training_step``) drops that object before backward: the loss's fp32 upcast is a new tensor and
log-softmax saves its output, not its input, so nothing references the logits after the forward. Anchor: H200,
torch 2.11, transformers 5.17, Pythia-1.4B shape, micro-batch 4, accumulation 2, recompute, full logits under bf16
autocast: stock peft LoRA 5.60 GiB, stock QLoRA 4.93 GiB measured; held logits predicted 6.04 (+7.9%) and 5.53
(+12.2%, fp32 logits counted), not held 5.66 and 4.76; a meta-device replay of the same steps peaks at 5.53 / 4.81
GiB before the workspace. Set True for a loop that keeps ``outputs`` alive across ``backward()``."""
LOGITS_COMPILED_BYTES = 6
"""Full logits with the cross-entropy inside a torch.compile region (nanoGPT-style whole-model compile): fitted to the
H200 anchors 350M mb8 12.8 GiB and 770M mb4 15.6 GiB (predicted 12.7 and 15.5) with eager activations; inductor
fuses the upcast, log-softmax and its gradient. hf_cgpu compiles blocks only, so its loss is never in this case."""
LOGITS_CHUNK_BYTES = 16
"""One checkpointed loss chunk (``loss_chunk`` tokens x V): bf16 logits 2 + fp32 copy 4 + fp32 log-softmax 4 + its
two fp32 gradients, not all at once. Meta-device trace, 350M, chunk 1024 x 32000: 17 bytes per entry."""

# ---- outside the tensors -----------------------------------------------------------------------------------------
WORKSPACE_BYTES = 128 * MiB
"""cuBLAS + cuBLASLt workspaces (32 MiB each per stream on sm_90 and newer, allocated through PyTorch's caching
allocator so they count in max_memory_allocated), SDPA scratch and rounding. Assumption, not yet measured: calibrate
as max_memory_allocated - (sum of live tensors) in a one-layer step."""
CUDA_CONTEXT_BYTES = 512 * MiB
"""CUDA context, kernels and cuBLAS handles outside the allocator (torch with lazy module loading on an RTX 40/50:
~300-500 MiB; compiled Triton kernels add more). Assumption: measure as nvidia-smi's process memory - reserved."""
FRAGMENTATION_FRACTION = 0.04
"""Allocator reserve on top of the peak allocated bytes: 770M at micro-batch 4 on H200 reserved 16.2 GiB for 15.6 GiB
allocated (+3.8%). Varying sequence lengths fragment more (set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)."""

# ---- the seed's rules, kept for comparison -----------------------------------------------------------------------
SEED_STATE_BYTES_PER_PARAM = 16
SEED_ACT_BYTES_PER_D = 34
SEED_RECOMPUTE_BYTES_PER_D = 2
SEED_RESERVED_BYTES = int(1.2 * GiB)

# ---- time ----------------------------------------------------------------------------------------------------------
CHINCHILLA_TOKENS_PER_PARAM = 20
DEFAULT_MFU = 0.4
ASSUMED_PEAK_TFLOPS = 165.0
"""Used only when neither --peak_tflops nor a saved ``hf-cgpu bench`` exists: the seed's 150-180 TFLOP/s dense bf16
range for a consumer Blackwell card (RTX 5070 Ti)."""

# ---- the ladder --------------------------------------------------------------------------------------------------
MIN_AUTOFIT_SEQ_LEN = 256
"""autofit halves the sequence no further than this (shorter contexts change what the model can learn)."""
MAX_AUTOFIT_MICRO_BATCH = 64

TIERS = ("full", "adamw8bit", "lora", "qlora")
FAMILIES = ("gpt", "gptneox", "llama")
PRECISIONS = ("amp", "bf16-master")
ATTENTIONS = ("sdpa", "eager")
PRESET_DIR = Path(__file__).parent / "presets" / "gpt"


class BudgetError(ValueError):
    """A bad input to the ledger; the message is one line that names the fix."""


# ===================================================================================================================
# Model shape
# ===================================================================================================================


@dataclass(frozen=True)
class LinearSpec:
    """One linear layer of a transformer block."""

    name: str
    """Module name as in the transformers model (what peft's target_modules matches)."""
    role: str
    """qkv | q | k | v | attn_out | mlp_in | gate | up | mlp_out."""
    d_in: int
    d_out: int
    group: str
    """Linears in one group read the same input tensor: attn_in, attn_out, mlp_in, mlp_out."""
    bias: bool
    aliases: tuple[str, ...] = ()
    """Other names of the same layer (GPT-2's c_attn, c_proj, c_fc for cgpt's qkv, proj/fc_out, fc)."""


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer, enough to count its parameters, activations and FLOPs.

    ``family`` decides which linears exist: "gpt" (GPT-2 / hf_cgpu's cgpt: fused qkv, GELU MLP, LayerNorm, learned
    positions), "gptneox" (fused qkv, GELU MLP, LayerNorm with bias, rotary, parallel residual) or "llama" (q, k, v,
    o, gated SiLU MLP, RMSNorm, rotary, grouped-query attention).
    """

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    n_positions: int = 0
    """Rows of a learned position table (0 = rotary, no table)."""
    d_ff: int = 0
    """MLP hidden width; 0 = ``mlp_ratio * d_model``."""
    mlp_ratio: float = 4.0
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention); 0 = ``n_head``."""
    head_size: int = 0
    """Width of one head; 0 = ``d_model // n_head`` (Qwen3 and Gemma set a wider ``head_dim``)."""
    tie_embeddings: bool = True
    bias: bool = False
    """Biases in the attention and MLP linears."""
    norm_bias: bool | None = None
    """Biases in the norms; None = same as ``bias`` (GPT), forced True for gptneox and False for llama."""
    family: str = "gpt"
    parallel_residual: bool = False
    """GPT-NeoX: attention and MLP read the same input (one norm input saved instead of two)."""
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise BudgetError(f"unknown model family {self.family!r}: choose one of {', '.join(FAMILIES)}")
        for key in ("n_layer", "d_model", "n_head", "vocab_size"):
            if int(getattr(self, key)) <= 0:
                raise BudgetError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.head_size == 0:
            if self.d_model % self.n_head:
                raise BudgetError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}: fix the shape")
            object.__setattr__(self, "head_size", self.d_model // self.n_head)
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", int(round(self.mlp_ratio * self.d_model)))
        if self.n_kv_head == 0:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.n_head % self.n_kv_head:
            raise BudgetError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}: fix the shape")
        if self.family == "gpt":
            object.__setattr__(self, "norm_bias", self.bias if self.norm_bias is None else self.norm_bias)
        else:  # GPT-NeoX LayerNorms always carry a bias; Llama's RMSNorm never does
            object.__setattr__(self, "norm_bias", self.family == "gptneox")

    # ---- constructors ----
    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        """A GPT preset: ``hf_cgpu/presets/gpt/<name>.json`` if present, else the built-in table (plus pythia-1.4b)."""
        return _preset_shape(name)

    @classmethod
    def from_config_dict(cls, cfg: Mapping[str, Any], name: str = "") -> ModelShape:
        """From a transformers ``config.json`` of a causal LM (gpt2, cgpt, gpt_neox, llama-like)."""
        return _shape_from_config(cfg, name)

    @classmethod
    def from_config_file(cls, path: str | Path) -> ModelShape:
        """From a local ``config.json`` (or a directory holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise BudgetError(f"no config.json at {str(path)!r}: pass the file or the model directory")
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise BudgetError(f"{p} is not valid JSON ({e.msg} at line {e.lineno}): fix or re-download it") from None
        return _shape_from_config(cfg, p.parent.name)

    @classmethod
    def from_hub(cls, model_id: str) -> ModelShape:
        """From a Hub model id through ``transformers.AutoConfig`` (needs network or a cached config)."""
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(model_id)
        except Exception as e:  # offline, gated, typo: all end the same way for the user
            reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            raise BudgetError(
                f"cannot load the config of {model_id!r} from the Hub ({reason}): "
                "download its config.json and pass --config PATH"
            ) from None
        return _shape_from_config(cfg.to_dict(), model_id)

    # ---- derived sizes ----
    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output (= d_model unless head_size says otherwise)."""
        return self.n_head * self.head_size

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_size

    def linears(self) -> list[LinearSpec]:
        """The linears of one block, in forward order."""
        d, ff, q, kv, b = self.d_model, self.d_ff, self.q_dim, self.kv_dim, self.bias
        if self.family == "gpt":
            return [
                LinearSpec("qkv", "qkv", d, q + 2 * kv, "attn_in", b, ("c_attn",)),
                LinearSpec("proj", "attn_out", q, d, "attn_out", b, ("c_proj",)),
                LinearSpec("fc", "mlp_in", d, ff, "mlp_in", b, ("c_fc",)),
                LinearSpec("fc_out", "mlp_out", ff, d, "mlp_out", b, ("c_proj",)),
            ]
        if self.family == "gptneox":  # GPT-NeoX's MLP always has biases; attention follows attention_bias
            return [
                LinearSpec("query_key_value", "qkv", d, q + 2 * kv, "attn_in", b),
                LinearSpec("dense", "attn_out", q, d, "attn_out", b),
                LinearSpec("dense_h_to_4h", "mlp_in", d, ff, "mlp_in", True),
                LinearSpec("dense_4h_to_h", "mlp_out", ff, d, "mlp_out", True),
            ]
        return [
            LinearSpec("q_proj", "q", d, q, "attn_in", b),
            LinearSpec("k_proj", "k", d, kv, "attn_in", b),
            LinearSpec("v_proj", "v", d, kv, "attn_in", b),
            LinearSpec("o_proj", "attn_out", q, d, "attn_out", b),
            LinearSpec("gate_proj", "gate", d, ff, "mlp_in", False),
            LinearSpec("up_proj", "up", d, ff, "mlp_in", False),
            LinearSpec("down_proj", "mlp_out", ff, d, "mlp_out", False),
        ]

    def param_tensors(self) -> list[tuple[str, int, str]]:
        """Every parameter tensor as (name, numel, kind); kind is embedding | head | linear | bias | norm."""
        d, L = self.d_model, self.n_layer
        out: list[tuple[str, int, str]] = [("embed", self.vocab_size * d, "embedding")]
        if self.n_positions:
            out.append(("positions", self.n_positions * d, "embedding"))
        norms_per_layer = 2
        for i in range(L):
            for j in range(norms_per_layer):
                out.append((f"h.{i}.norm{j}.weight", d, "norm"))
                if self.norm_bias:
                    out.append((f"h.{i}.norm{j}.bias", d, "norm"))
            for lin in self.linears():
                out.append((f"h.{i}.{lin.name}.weight", lin.d_in * lin.d_out, "linear"))
                if lin.bias:
                    out.append((f"h.{i}.{lin.name}.bias", lin.d_out, "bias"))
        out.append(("final_norm.weight", d, "norm"))
        if self.norm_bias:
            out.append(("final_norm.bias", d, "norm"))
        if not self.tie_embeddings:
            out.append(("head", self.vocab_size * d, "head"))
        return out

    @property
    def n_params(self) -> int:
        """Total parameters, tied embeddings counted once."""
        return sum(n for _, n, _ in self.param_tensors())

    @property
    def n_block_linear_params(self) -> int:
        """Weights of the block linears (what 4-bit quantization and autocast copies apply to)."""
        return sum(n for _, n, k in self.param_tensors() if k == "linear")

    @property
    def n_matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: block linears + the LM head (tied or not)."""
        return self.n_block_linear_params + self.vocab_size * self.d_model

    def describe(self) -> str:
        kv = f", {self.n_kv_head} kv heads" if self.n_kv_head != self.n_head else ""
        ff = "" if self.d_ff == 4 * self.d_model else f", d_ff {self.d_ff}"
        return (
            f"{self.name or 'model'} ({self.family}, {self.n_layer} x {self.d_model}, {self.n_head} heads{kv}{ff}, "
            f"vocab {self.vocab_size}) = {fmt_count(self.n_params)} params"
        )


def _builtin_presets() -> dict[str, ModelShape]:
    """Shapes known without any file: our GPT presets and the Pythia-1.4B shape of the seed's LoRA exercise."""
    gpt = dict(family="gpt", bias=False, tie_embeddings=True, mlp_ratio=4.0)
    return {
        "tiny": ModelShape(4, 128, 4, 4096, n_positions=128, name="tiny", **gpt),
        "30m": ModelShape(6, 384, 6, 32000, n_positions=1024, name="30m", **gpt),
        "124m": ModelShape(12, 768, 12, 32000, n_positions=1024, name="124m", **gpt),
        "350m": ModelShape(24, 1024, 16, 32000, n_positions=1024, name="350m", **gpt),
        "770m": ModelShape(24, 1536, 16, 32000, n_positions=1024, name="770m", **gpt),
        "pythia-1.4b": ModelShape(
            24, 2048, 16, 50304, d_ff=8192, tie_embeddings=False, bias=True, family="gptneox",
            parallel_residual=True, name="pythia-1.4b",
        ),
    }


def preset_names() -> list[str]:
    """Preset files plus built-in shapes, smallest first."""
    files = {p.stem for p in PRESET_DIR.glob("*.json")} if PRESET_DIR.is_dir() else set()
    builtin = _builtin_presets()
    return sorted(files | set(builtin), key=lambda n: (builtin[n].n_params if n in builtin else 0, n))


def load_preset_json(name: str) -> dict[str, Any]:
    """The raw preset JSON (model shape and training settings), or {} for a built-in shape without a file."""
    path = PRESET_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _preset_shape(name: str) -> ModelShape:
    raw = load_preset_json(name)
    if raw:  # the lead's preset keys: n_layer, n_embd, n_head, seq_len (= n_positions), vocab_size, ...
        return ModelShape(
            n_layer=int(raw["n_layer"]), d_model=int(raw["n_embd"]), n_head=int(raw["n_head"]),
            vocab_size=int(raw.get("vocab_size", 32000)),
            n_positions=int(raw.get("n_positions", raw.get("seq_len", 1024))),
            mlp_ratio=float(raw.get("mlp_ratio", 4)), bias=bool(raw.get("bias", False)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", True)), family="gpt", name=name,
        )
    builtin = _builtin_presets()
    if name in builtin:
        return builtin[name]
    raise BudgetError(f"unknown preset {name!r}: choose one of {', '.join(preset_names())} or pass --config PATH")


_NEOX_TYPES = {"gpt_neox"}
_GPT_TYPES = {"gpt2", "cgpt"}


def _shape_from_config(cfg: Mapping[str, Any], name: str = "") -> ModelShape:
    """Read the keys that matter from a transformers config dict; unknown model types are treated as Llama-like."""
    if isinstance(cfg.get("text_config"), Mapping):  # multimodal configs nest the language model's
        cfg = cfg["text_config"]
    cfg = dict(cfg)
    model_type = str(cfg.get("model_type", ""))

    def pick(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise BudgetError(f"config has none of {', '.join(keys)}: pass --preset or a causal-LM config.json")
        return default

    d = int(pick("hidden_size", "n_embd", "d_model"))
    common = dict(
        n_layer=int(pick("num_hidden_layers", "n_layer", "num_layers")),
        d_model=d,
        n_head=int(pick("num_attention_heads", "n_head")),
        vocab_size=int(pick("vocab_size")),
        name=name or model_type,
    )
    if model_type in _GPT_TYPES or ("n_embd" in cfg and model_type not in _NEOX_TYPES):
        gpt2 = model_type == "gpt2"
        ff = cfg.get("n_inner") or int(round(float(cfg.get("mlp_ratio", 4)) * d))
        return ModelShape(
            **common, family="gpt", d_ff=int(ff), n_positions=int(pick("n_positions", "max_position_embeddings")),
            bias=bool(cfg.get("bias", gpt2)), tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )
    if model_type in _NEOX_TYPES:
        return ModelShape(
            **common, family="gptneox", d_ff=int(pick("intermediate_size", default=4 * d)),
            bias=bool(cfg.get("attention_bias", True)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            parallel_residual=bool(cfg.get("use_parallel_residual", True)),
        )
    n_head = common["n_head"]
    return ModelShape(
        **common, family="llama", d_ff=int(pick("intermediate_size")),
        n_kv_head=int(cfg.get("num_key_value_heads") or n_head), head_size=int(cfg.get("head_dim") or 0),
        bias=bool(cfg.get("attention_bias", model_type in ("qwen2",))),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def resolve_model(spec: str) -> ModelShape:
    """A preset name, a local config.json (or its directory), or a Hub id, in that order."""
    if spec in preset_names():
        return ModelShape.from_preset(spec)
    p = Path(spec)
    if p.is_file() or (p.is_dir() and (p / "config.json").is_file()):
        return ModelShape.from_config_file(p)
    if p.suffix == ".json" or spec.startswith((".", "/")):
        raise BudgetError(f"no config.json at {spec!r}: pass an existing file, a preset ({', '.join(preset_names())})")
    return ModelShape.from_hub(spec)


# ===================================================================================================================
# Training setup
# ===================================================================================================================


@dataclass(frozen=True)
class TrainSetup:
    """How the model is trained: everything besides the shape that moves the memory peak."""

    seq_len: int = 1024
    """Tokens per sequence."""
    micro_batch_size: int = 8
    """Sequences per forward/backward."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step. Above 1 the gradients stay allocated through every forward and backward."""
    tier: str = "full"
    """full (AdamW), adamw8bit (bitsandbytes 8-bit m, v), lora (frozen bf16 base + adapters), qlora (nf4 base)."""
    recompute: bool = False
    """Full-layer activation checkpointing: keep each block's input, re-run one block at a time in backward."""
    precision: str = "amp"
    """full/adamw8bit only: 'amp' = fp32 weights + bf16 autocast (accelerate's bf16, hf_cgpu's default);
    'bf16-master' = bf16 weights and grads + an fp32 master copy (the seed's 2+2+4+8 accounting)."""
    lora_rank: int = 16
    """LoRA rank r: each adapted linear gains r * (d_in + d_out) trainable parameters."""
    lora_targets: tuple[str, ...] = ("all-linear",)
    """Module names (qkv, q_proj, ...), roles (attn, mlp) or 'all-linear' (every block linear, not the head)."""
    stock_peft: bool = False
    """Model a stock peft run instead of hf_cgpu's tier: LoRA on a bf16 model without autocast (peft upcasts every
    adapted input to fp32 and saves it); QLoRA through prepare_model_for_kbit_training (embeddings, head, norms and
    so the residual stream in fp32)."""
    nf4_double_quant: bool = True
    """QLoRA: quantize the 4-bit block scales too (hf_cgpu's tier does; bitsandbytes' default does not)."""
    loss_chunk: int = 1024
    """Tokens per checkpointed loss chunk (hf_cgpu's GPT and tiers); 0 = full logits (stock transformers)."""
    compiled_loss: bool = False
    """The cross-entropy runs inside torch.compile (nanoGPT-style whole-model compile; the H200 anchors).
    hf_cgpu compiles blocks only, so its loss is eager."""
    attention: str = "sdpa"
    """sdpa (flash / memory-efficient kernels, no T x T scores) or eager (scores saved per head)."""
    fused_optimizer: bool = True
    """Fused AdamW (hf_cgpu's default on CUDA); foreach AdamW adds a 4 B/param temporary at the step."""

    def __post_init__(self) -> None:
        for key in ("seq_len", "micro_batch_size", "accumulation_steps", "lora_rank"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BudgetError(f"{key} must be a positive integer, got {value!r}")
        if self.tier not in TIERS:
            raise BudgetError(f"unknown tier {self.tier!r}: choose one of {', '.join(TIERS)} (add --recompute to any)")
        if self.precision not in PRECISIONS:
            raise BudgetError(f"unknown precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.attention not in ATTENTIONS:
            raise BudgetError(f"unknown attention {self.attention!r}: choose one of {', '.join(ATTENTIONS)}")
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise BudgetError(f"loss_chunk must be 0 (full logits) or a positive token count, got {self.loss_chunk!r}")
        if isinstance(self.lora_targets, str):
            object.__setattr__(self, "lora_targets", tuple(t for t in self.lora_targets.split(",") if t))

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_micro_batch * self.accumulation_steps

    @property
    def adapters(self) -> bool:
        return self.tier in ("lora", "qlora")

    def describe(self) -> str:
        if self.adapters:
            regime = {
                ("lora", False): "frozen bf16 base under bf16 autocast, fp32 adapters",
                ("lora", True): "stock peft: bf16 model, no autocast, adapters upcast their inputs to fp32",
                ("qlora", False): "frozen nf4 base, bf16 embeddings/norms, bf16 autocast, fp32 adapters",
                ("qlora", True): "stock prepare_model_for_kbit_training: nf4 base, fp32 embeddings/norms/residual",
            }[(self.tier, self.stock_peft)]
            what = f"{self.tier} r={self.lora_rank} on {','.join(self.lora_targets)} ({regime})"
        else:
            opt = "AdamW8bit" if self.tier == "adamw8bit" else "AdamW"
            prec = "fp32 weights + bf16 autocast" if self.precision == "amp" else "bf16 weights + fp32 master"
            what = f"{self.tier} ({opt}, {prec})"
        loss = f"loss in chunks of {self.loss_chunk} tokens" if self.loss_chunk else (
            "full logits, compiled loss" if self.compiled_loss else "full logits, eager loss")
        return (
            f"{what}; seq {self.seq_len} x micro-batch {self.micro_batch_size} x accumulation "
            f"{self.accumulation_steps} = {self.tokens_per_step:,} tokens/step; "
            f"{'recompute' if self.recompute else 'no recompute'}; {loss}; {self.attention} attention"
        )


# ===================================================================================================================
# Model states
# ===================================================================================================================


def seed_model_state_bytes(params: float, bytes_per_param: int = SEED_STATE_BYTES_PER_PARAM) -> float:
    """The seed's mixed-precision AdamW: bf16 weights 2 + bf16 grads 2 + fp32 master 4 + Adam m, v 8 = 16 Psi."""
    return bytes_per_param * params


def seed_activation_bytes(n_layer: int, d_model: int, seq_len: int, micro_batch_size: int, recompute: bool) -> float:
    """The seed's rule: ~34 d bytes per token per layer (bf16, no recompute), ~2 d with full-layer recompute."""
    per_d = SEED_RECOMPUTE_BYTES_PER_D if recompute else SEED_ACT_BYTES_PER_D
    return n_layer * seq_len * micro_batch_size * per_d * d_model


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
        raise BudgetError(f"LoRA targets {wanted!r} match no linear of {shape.family}: use all-linear or {names}")
    return chosen


def lora_trainable_params(shape: ModelShape, rank: int = 16, targets: Sequence[str] = ("all-linear",)) -> int:
    """r * (d_in + d_out) per adapted linear per layer (A is r x d_in, B is d_out x r; no adapter bias)."""
    return shape.n_layer * sum(rank * (lin.d_in + lin.d_out) for lin in adapted_linears(shape, targets))


def adamw8bit_state_bytes(numels: Sequence[int]) -> float:
    """bitsandbytes AdamW8bit: 2 B/param + blockwise absmax for big tensors; fp32 m, v for tensors < 4096 elements."""
    total = 0.0
    for n in numels:
        if n < BNB_MIN_8BIT_SIZE:
            total += ADAM_STATE_BYTES * n
        else:
            total += ADAM8BIT_STATE_BYTES * n + 2 * FP32 * math.ceil(n / BNB_8BIT_BLOCK)
    return total


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


def model_state_bytes(shape: ModelShape, setup: TrainSetup) -> StateBytes:
    """Weights, gradients, optimizer state, master copy and autocast weight copies for the tier."""
    tensors = shape.param_tensors()
    n = shape.n_params
    if setup.adapters:
        n_lora = lora_trainable_params(shape, setup.lora_rank, setup.lora_targets)
        adapters = FP32 * n_lora
        if setup.tier == "lora":
            base, base_note = BF16 * n, "bf16 base 2 B/param"
        else:
            q = shape.n_block_linear_params
            rest_bytes = FP32 if setup.stock_peft else BF16
            base = nf4_bytes_per_param(setup.nf4_double_quant) * q + rest_bytes * (n - q)
            base_note = (
                f"nf4 block linears {nf4_bytes_per_param(setup.nf4_double_quant):.3f} B/param + "
                f"{'fp32' if setup.stock_peft else 'bf16'} embeddings/head/norms"
            )
        return StateBytes(
            weights=base + adapters, gradients=FP32 * n_lora, optimizer=ADAM_STATE_BYTES * n_lora, master=0.0,
            autocast_copies=0.0, trainable_params=n_lora,
            notes={
                "weights": f"{base_note} + {fmt_count(n_lora)} fp32 adapter params",
                "gradients": "fp32, adapters only",
                "optimizer": "AdamW m, v fp32 on the adapters (8 B/param)",
                "master": "none: the base is frozen",
            },
        )
    numels = [m for _, m, _ in tensors]
    if setup.tier == "adamw8bit":
        opt, opt_note = adamw8bit_state_bytes(numels), "AdamW8bit: 2 B/param (+absmax); fp32 for tensors < 4096"
    else:
        opt, opt_note = ADAM_STATE_BYTES * n, "AdamW m, v fp32: 8 B/param"
    if setup.precision == "bf16-master":
        return StateBytes(
            weights=BF16 * n, gradients=BF16 * n, optimizer=opt, master=FP32 * n, autocast_copies=0.0,
            trainable_params=n,
            notes={"weights": "bf16 2 B/param", "gradients": "bf16 2 B/param", "optimizer": opt_note,
                   "master": "fp32 4 B/param"},
        )
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


def regime(setup: TrainSetup) -> Regime:
    """How each tier runs a block, from the dtypes involved.

    amp: fp32 weights under CUDA autocast: LayerNorm runs in fp32 (its fp32 input and output are saved / cast),
      every linear makes its own bf16 copy of an fp32 input, attention and linear outputs are bf16, residual fp32.
    bf16-master: everything bf16 (the seed's accounting), one saved tensor per shared input.
    lora (hf_cgpu): bf16 base under autocast: each norm saves an fp32 cast of the bf16 residual; peft's fp32 cast of
      an adapter input is followed by autocast's bf16 cast, which is what the adapter saves (2 B).
    lora stock: bf16 model, no autocast: peft casts each adapted input to fp32 and saves it (4 B).
    qlora (hf_cgpu): as lora, but bnb's Linear4bit returns its input's dtype: q, k, v and the MLP hidden come out
      fp32 from fp32 norm outputs, and the residual turns fp32 after the first MLP.
    qlora stock (prepare_model_for_kbit_training): fp32 embeddings and norms make every activation fp32; the fp32
      adapters share their fp32 inputs; attention runs fp32 (memory-efficient kernel).
    """
    if not setup.adapters and setup.precision == "amp":
        return Regime(autocast=True, norm_save=FP32, norm_shared=True, norm_out=FP32, proj_out=BF16, attn=BF16,
                      resid=FP32, base_trainable=True, adapter_copy=0, logits=BF16)
    if not setup.adapters:
        return Regime(autocast=False, norm_save=BF16, norm_shared=True, norm_out=BF16, proj_out=BF16, attn=BF16,
                      resid=BF16, base_trainable=True, adapter_copy=0, logits=BF16)
    if setup.tier == "lora" and not setup.stock_peft:
        return Regime(autocast=True, norm_save=FP32, norm_shared=False, norm_out=FP32, proj_out=BF16, attn=BF16,
                      resid=BF16, base_trainable=False, adapter_copy=BF16, logits=BF16)
    if setup.tier == "lora":
        return Regime(autocast=False, norm_save=BF16, norm_shared=True, norm_out=BF16, proj_out=BF16, attn=BF16,
                      resid=BF16, base_trainable=False, adapter_copy=FP32, logits=BF16)
    if not setup.stock_peft:
        return Regime(autocast=True, norm_save=FP32, norm_shared=True, norm_out=FP32, proj_out=FP32, attn=BF16,
                      resid=FP32, base_trainable=False, adapter_copy=BF16, logits=BF16)
    return Regime(autocast=False, norm_save=FP32, norm_shared=True, norm_out=FP32, proj_out=FP32, attn=FP32,
                  resid=FP32, base_trainable=False, adapter_copy=0, logits=FP32)


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


def layer_activation_bytes_per_token(shape: ModelShape, setup: TrainSetup) -> float:
    """Bytes one block saves for backward per token (no recompute), before ``ACTIVATION_SCALE``.

    Counted per saved tensor: norm inputs, linear inputs (``_group_input_bytes``), q/k/v (+ rotary copies) and the
    attention output, flash's log-sum-exp (or eager scores), and the MLP hidden tensors (scaled by ``d_ff``).
    A 4d GPT under AMP: 8 (two fp32 LayerNorm inputs) + 12 (bf16 linear inputs: qkv 2, fc 2, fc_out 8; proj reads
    the attention output itself) + 8 (q, k, v, output) + 8 (GELU input) = 36 d. All-bf16: 32 d (the seed's 34 d
    adds two dropout masks).
    """
    r = regime(setup)
    d, ff, q, kv, H, T = shape.d_model, shape.d_ff, shape.q_dim, shape.kv_dim, shape.n_head, setup.seq_len
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
    attn += r.attn * q  # output
    if setup.attention == "eager":
        attn += (EAGER_SCORE_BYTES if r.attn == BF16 else FP32) * H * T
    else:
        attn += FLASH_LSE_BYTES * H
    if shape.family == "llama":  # gate out (SiLU input), up out, SiLU out
        mlp = 3 * r.proj_out * ff
    else:  # GELU input
        mlp = r.proj_out * ff
    return norm + _group_input_bytes(shape, setup, r) + attn + mlp


def outside_blocks_bytes_per_token(shape: ModelShape, setup: TrainSetup) -> float:
    """The final norm's saved input and the head's input (kept for the head / loss-chunk backward)."""
    r = regime(setup)
    return (r.norm_save + BF16) * shape.d_model


@dataclass(frozen=True)
class ActivationBytes:
    no_recompute: float
    recompute: float
    """Block inputs kept by checkpointing (+ the final norm and head inputs)."""
    recompute_layer: float
    """One block's activations re-created during backward (only with recompute)."""
    per_token_per_layer: float


def activation_bytes(shape: ModelShape, setup: TrainSetup) -> ActivationBytes:
    tokens = setup.tokens_per_micro_batch
    per_layer = layer_activation_bytes_per_token(shape, setup) * ACTIVATION_SCALE
    outside = outside_blocks_bytes_per_token(shape, setup) * tokens
    r = regime(setup)
    return ActivationBytes(
        no_recompute=shape.n_layer * per_layer * tokens + outside,
        recompute=shape.n_layer * r.resid * shape.d_model * tokens + outside,
        recompute_layer=per_layer * tokens,
        per_token_per_layer=per_layer,
    )


def logits_bytes(shape: ModelShape, setup: TrainSetup) -> tuple[float, str]:
    """Logits and loss: one checkpointed chunk, or the full (B*T, V) logits (compiled or eager cross-entropy)."""
    V, tokens = shape.vocab_size, setup.tokens_per_micro_batch
    if setup.loss_chunk:
        chunk = min(setup.loss_chunk, tokens)
        return LOGITS_CHUNK_BYTES * chunk * V, f"one chunk of {chunk} tokens x {V} vocab, {LOGITS_CHUNK_BYTES} B each"
    if setup.compiled_loss:
        return LOGITS_COMPILED_BYTES * tokens * V, f"full {tokens} x {V} logits, compiled cross-entropy"
    per = LOGITS_EAGER_BYTES + (regime(setup).logits if LOGITS_HELD else 0)
    return per * tokens * V, f"full {tokens} x {V} logits, eager fp32 loss, {per} B each"


# ===================================================================================================================
# The ledger
# ===================================================================================================================


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    bytes: float
    note: str = ""


@dataclass(frozen=True)
class Ledger:
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

    @property
    def fits(self) -> bool:
        return self.memory_cap is None or self.total <= self.memory_cap

    def row(self, key: str) -> float:
        return next(r.bytes for r in self.rows if r.key == key)

    def as_dict(self) -> dict[str, float]:
        """Bytes per row plus the totals, for a benchmark to print beside its measurement."""
        out = {r.key: r.bytes for r in self.rows}
        out.update(
            allocated=self.allocated, fragmentation=self.fragmentation, reserved=self.reserved,
            cuda_context=self.cuda_context, total=self.total,
            activations_no_recompute=self.activations_no_recompute, activations_recompute=self.activations_recompute,
        )
        return out


def ledger(
    shape: ModelShape, setup: TrainSetup | None = None, memory_cap: float | None = None, **overrides: Any
) -> Ledger:
    """Predict the memory of a training step of ``shape`` under ``setup`` (fields can be overridden by keyword).

    The peak is the larger of two moments: the start of backward (all activations and the loss's logits alive,
    gradients only if accumulation > 1) and the optimizer step (all gradients, no activations).
    """
    setup = dataclasses.replace(setup or TrainSetup(), **overrides)
    st = model_state_bytes(shape, setup)
    act = activation_bytes(shape, setup)
    logits, logits_note = logits_bytes(shape, setup)
    accumulate = setup.accumulation_steps > 1
    grads_at_peak = st.gradients if accumulate else 0.0
    activations = act.recompute if setup.recompute else act.no_recompute
    recompute_layer = act.recompute_layer if setup.recompute else 0.0
    per_d = act.per_token_per_layer / shape.d_model
    if setup.recompute:
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
        Row("autocast_copies", "autocast weight copies", st.autocast_copies, st.notes.get("autocast_copies", "none")),
        Row("activations", "activations", activations, act_note),
        Row("recompute_layer", "recomputed block", recompute_layer,
            "one block's activations re-created in backward" if setup.recompute else "no recompute"),
        Row("logits", "logits + loss", logits, logits_note),
        Row("workspace", "workspace (cuBLAS etc.)", WORKSPACE_BYTES, "cuBLAS/cuBLASLt workspaces, SDPA scratch"),
    ]
    if setup.recompute:  # the loss's backward frees the logits before the first block is re-run
        rows.append(Row("overlap", "not at the same time", -min(logits, recompute_layer),
                        "recomputed block and logits never coexist: only the larger counts"))
    backward_start = sum(r.bytes for r in rows)
    step_temp = 0.0 if setup.fused_optimizer else FOREACH_ADAMW_TEMP_BYTES * st.trainable_params
    optimizer_step = st.weights + st.gradients + st.optimizer + st.master + step_temp + WORKSPACE_BYTES
    if optimizer_step > backward_start:
        allocated, phase = optimizer_step, "optimizer step"
    else:
        allocated, phase = backward_start, "backward start"
    fragmentation = FRAGMENTATION_FRACTION * allocated
    reserved = allocated + fragmentation
    return Ledger(
        shape=shape, setup=setup, rows=tuple(rows), allocated=allocated, fragmentation=fragmentation,
        reserved=reserved, cuda_context=CUDA_CONTEXT_BYTES, total=reserved + CUDA_CONTEXT_BYTES, peak_phase=phase,
        activations_no_recompute=act.no_recompute, activations_recompute=act.recompute + act.recompute_layer,
        memory_cap=memory_cap,
    )


# ===================================================================================================================
# Time
# ===================================================================================================================


def flops_per_token(shape: ModelShape, setup: TrainSetup) -> float:
    """Training FLOPs per token actually executed (see the module docstring for the derivation).

    Full: 6 N + 12 L T d. Frozen base (LoRA/QLoRA): 4 N (no weight gradients) + 6 N_adapters + 12 L T d.
    Recompute adds one more forward: 2 N + 4 L T d.
    """
    n = shape.n_matmul_params
    attn_fwd = 4.0 * shape.n_layer * setup.seq_len * shape.d_model
    if setup.adapters:
        n_lora = lora_trainable_params(shape, setup.lora_rank, setup.lora_targets)
        flops = 4.0 * n + 6.0 * n_lora + 3 * attn_fwd
        extra = 2.0 * (n + n_lora) + attn_fwd
    else:
        flops = 6.0 * n + 3 * attn_fwd
        extra = 2.0 * n + attn_fwd
    return flops + (extra if setup.recompute else 0.0)


def chinchilla_tokens(params: float) -> float:
    """Compute-optimal tokens (Hoffmann et al. 2022): ~20 per parameter."""
    return CHINCHILLA_TOKENS_PER_PARAM * params


def training_hours(tokens: float, flops_token: float, peak_tflops: float, mfu: float = DEFAULT_MFU) -> float:
    """Wall-clock hours for ``tokens`` at ``peak_tflops * mfu`` sustained."""
    return tokens * flops_token / (peak_tflops * 1e12 * mfu) / 3600


# ===================================================================================================================
# The ladder and autofit
# ===================================================================================================================


@dataclass(frozen=True)
class FitPlan:
    """What ``autofit`` chose: the setup, its ledger, whether it fits, and why each rung was taken."""

    setup: TrainSetup
    ledger: Ledger
    fits: bool
    reasons: tuple[str, ...]
    memory_cap: float


_RUNG_NAMES = {"adamw8bit": "8-bit AdamW (tier adamw8bit)", "lora": "LoRA (tier lora)", "qlora": "QLoRA (tier qlora)"}
LADDER = ("micro-batch", "recompute", "sequence", "adamw8bit", "lora", "qlora")
"""The seed's order: smaller micro-batch with more accumulation -> recompute -> shorter sequence -> 8-bit AdamW ->
LoRA -> QLoRA."""


def _with_micro_batch(setup: TrainSetup, micro_batch: int, tokens_per_step: int) -> TrainSetup:
    acc = max(1, math.ceil(tokens_per_step / (micro_batch * setup.seq_len)))
    return dataclasses.replace(setup, micro_batch_size=micro_batch, accumulation_steps=acc)


def autofit(
    shape: ModelShape,
    memory_cap: float,
    seq_len: int = 1024,
    effective_batch_tokens: int | None = None,
    micro_batch_size: int | None = None,
    accumulation_steps: int | None = None,
    allow_lora: bool = True,
    allow_shorter_seq: bool = True,
    min_micro_batch: int = 1,
    base: TrainSetup | None = None,
) -> FitPlan:
    """Walk the seed's ladder until the ledger fits ``memory_cap``; keep the tokens per optimizer step.

    Start from ``micro_batch_size`` (x ``accumulation_steps``) or the largest power-of-two micro-batch within
    ``effective_batch_tokens``. Rung 1 halves the micro-batch (doubling accumulation) down to ``min_micro_batch``
    (1 in the seed's ladder; a floor of 4 keeps a consumer GPU busier and reaches recompute sooner). Every later rung is
    switched on cumulatively, and after each one the micro-batch (and the sequence) grow back as far as they fit,
    because a memory saving is best spent on throughput.
    """
    base = dataclasses.replace(base or TrainSetup(), seq_len=seq_len)
    if effective_batch_tokens is None:
        mb = micro_batch_size or base.micro_batch_size
        effective_batch_tokens = mb * (accumulation_steps or base.accumulation_steps) * seq_len
    if micro_batch_size is None:
        micro_batch_size = 1
        while micro_batch_size * 2 * seq_len <= effective_batch_tokens and micro_batch_size < MAX_AUTOFIT_MICRO_BATCH:
            micro_batch_size *= 2
    if effective_batch_tokens < seq_len:
        raise BudgetError(f"effective batch {effective_batch_tokens} tokens is below one sequence of {seq_len}")
    tokens = effective_batch_tokens
    reasons: list[str] = []
    setup = _with_micro_batch(base, micro_batch_size, tokens)
    cap = memory_cap

    def total(s: TrainSetup) -> float:
        return ledger(shape, s, cap).total

    def over(s: TrainSetup) -> str:
        return f"{fmt_gib(total(s))} > {fmt_gib(cap)} cap"

    def grow(s: TrainSetup, rung: str) -> TrainSetup:
        """After a saving, restore the sequence, then the micro-batch, as far as they fit."""
        while s.seq_len < seq_len:
            t = dataclasses.replace(s, seq_len=min(seq_len, s.seq_len * 2))
            t = _with_micro_batch(t, t.micro_batch_size, tokens)
            if total(t) > cap:
                break
            reasons.append(f"{rung}: sequence back {s.seq_len} -> {t.seq_len} ({fmt_gib(total(t))})")
            s = t
        while s.micro_batch_size < micro_batch_size:
            t = _with_micro_batch(s, s.micro_batch_size * 2, tokens)
            if total(t) > cap:
                break
            reasons.append(
                f"{rung}: micro-batch back {s.micro_batch_size} -> {t.micro_batch_size} ({fmt_gib(total(t))})"
            )
            s = t
        return s

    # rung 1: smaller micro-batch, more accumulation
    while total(setup) > cap and setup.micro_batch_size // 2 >= max(1, min_micro_batch):
        smaller = _with_micro_batch(setup, setup.micro_batch_size // 2, tokens)
        reasons.append(
            f"micro-batch {setup.micro_batch_size} -> {smaller.micro_batch_size} "
            f"(accumulation {setup.accumulation_steps} -> {smaller.accumulation_steps}): {over(setup)}"
        )
        setup = smaller
    # rung 2: recompute
    if total(setup) > cap and not setup.recompute:
        reasons.append(f"recompute on: {over(setup)} at micro-batch {setup.micro_batch_size}")
        setup = grow(dataclasses.replace(setup, recompute=True), "recompute")
    # rung 3: shorter sequence
    while allow_shorter_seq and total(setup) > cap and setup.seq_len // 2 >= MIN_AUTOFIT_SEQ_LEN:
        shorter = dataclasses.replace(setup, seq_len=setup.seq_len // 2)
        shorter = _with_micro_batch(shorter, shorter.micro_batch_size, tokens)
        reasons.append(f"sequence {setup.seq_len} -> {shorter.seq_len}: {over(setup)}")
        setup = shorter
    # rungs 4-6: 8-bit AdamW, LoRA, QLoRA
    for tier in ("adamw8bit", "lora", "qlora"):
        if total(setup) <= cap:
            break
        if tier != "adamw8bit" and not allow_lora:
            break
        if TIERS.index(setup.tier) >= TIERS.index(tier):
            continue
        reasons.append(f"{_RUNG_NAMES[tier]}: {over(setup)}")
        setup = grow(dataclasses.replace(setup, tier=tier), tier)
    final = ledger(shape, setup, cap)
    if final.fits:
        reasons.append(f"fits: {fmt_gib(final.total)} <= {fmt_gib(cap)} at micro-batch {setup.micro_batch_size} "
                       f"x accumulation {setup.accumulation_steps}, seq {setup.seq_len}, tier {setup.tier}"
                       f"{', recompute' if setup.recompute else ''}")
    else:
        reasons.append(f"nothing on the ladder fits: {over(setup)} even at the last rung; pick a smaller model")
    return FitPlan(setup=setup, ledger=final, fits=final.fits, reasons=tuple(reasons), memory_cap=cap)


def next_rung(shape: ModelShape, setup: TrainSetup, memory_cap: float) -> tuple[str, Ledger] | None:
    """The first rung of the seed's ladder that changes ``setup``, with its ledger (None when all are taken)."""
    tokens = setup.tokens_per_step
    candidates: list[tuple[str, TrainSetup]] = []
    if setup.micro_batch_size > 1:
        s = _with_micro_batch(setup, setup.micro_batch_size // 2, tokens)
        candidates.append((f"micro-batch {setup.micro_batch_size} -> {s.micro_batch_size}, accumulation "
                           f"{setup.accumulation_steps} -> {s.accumulation_steps}", s))
    if not setup.recompute:
        candidates.append(("recompute on", dataclasses.replace(setup, recompute=True)))
    if setup.seq_len // 2 >= MIN_AUTOFIT_SEQ_LEN:
        s = _with_micro_batch(dataclasses.replace(setup, seq_len=setup.seq_len // 2), setup.micro_batch_size, tokens)
        candidates.append((f"sequence {setup.seq_len} -> {s.seq_len}", s))
    for tier in ("adamw8bit", "lora", "qlora"):
        if TIERS.index(setup.tier) < TIERS.index(tier):
            candidates.append((f"tier {tier}", dataclasses.replace(setup, tier=tier)))
    for label, s in candidates:
        led = ledger(shape, s, memory_cap)
        if led.total < ledger(shape, setup, memory_cap).total:
            return label, led
    return None


# ===================================================================================================================
# Formatting and the command line
# ===================================================================================================================

_UNITS = {"mb": MiB, "mib": MiB, "m": MiB, "gb": GiB, "gib": GiB, "g": GiB, "tb": 1024 * GiB, "tib": 1024 * GiB}


def parse_memory(text: str) -> int:
    """'16GB', '15.5 GiB', '12000MB' -> bytes. GB is read as GiB, like the seed: a "16 GB" card has 16 GiB of DRAM."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise BudgetError(f"cannot read memory size {text!r}: write a number and a unit, e.g. 16GB, 15.5GiB or 12000MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def fmt_count(n: float) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.{2 if div == 1e9 else 1}f}{suffix}"
    return str(int(n))


def format_ledger(led: Ledger) -> str:
    """The aligned table: one row per kind of memory, the totals, the verdict."""
    label_w = max(len(r.label) for r in led.rows) + 2
    lines = [f"  {'':<{label_w}}{'GiB':>8}   how"]
    for r in led.rows:
        lines.append(f"  {r.label:<{label_w}}{r.bytes / GiB:>8.2f}   {r.note}")
    rule = f"  {'-' * (label_w + 8)}"
    lines.append(rule)
    phase = (f"peak at the {led.peak_phase}" if led.peak_phase == "backward start"
             else "peak at the optimizer step: weights + all gradients + optimizer state")
    lines.append(f"  {'= allocated':<{label_w}}{led.allocated / GiB:>8.2f}   {phase}; compare max_memory_allocated()")
    lines.append(f"  {'fragmentation':<{label_w}}{led.fragmentation / GiB:>8.2f}   "
                 f"{FRAGMENTATION_FRACTION:.0%} of allocated (allocator reserve)")
    lines.append(f"  {'CUDA context':<{label_w}}{led.cuda_context / GiB:>8.2f}   outside the allocator")
    lines.append(f"  {'= total on the card':<{label_w}}{led.total / GiB:>8.2f}")
    if led.memory_cap is not None:
        spare = led.memory_cap - led.total
        verdict = f"FITS ({fmt_gib(spare)} spare)" if led.fits else f"DOES NOT FIT ({fmt_gib(-spare)} over)"
        lines.append(f"  verdict vs {fmt_gib(led.memory_cap)} cap: {verdict}")
    return "\n".join(lines)


def format_seed_comparison(shape: ModelShape, setup: TrainSetup, led: Ledger) -> str:
    """One line: what the seed's rules would say for the same run, and what this ledger adds."""
    act = seed_activation_bytes(shape.n_layer, shape.d_model, setup.seq_len, setup.micro_batch_size, setup.recompute)
    per_d = SEED_RECOMPUTE_BYTES_PER_D if setup.recompute else SEED_ACT_BYTES_PER_D
    if setup.adapters:  # the seed's LoRA exercise: bf16 base 2 B/param, adapters at 16 B/param
        n_lora = lora_trainable_params(shape, setup.lora_rank, setup.lora_targets)
        states, rule = BF16 * shape.n_params + SEED_STATE_BYTES_PER_PARAM * n_lora, "2 B/param base + 16 B/adapter"
    else:
        states, rule = seed_model_state_bytes(shape.n_params), "16 B/param"
    seed = states + act + SEED_RESERVED_BYTES
    return (f"  seed's rule ({rule} + {per_d} d/token/layer + 1.2 GiB): {fmt_gib(seed)} on the card; this ledger\n"
            f"  adds the logits, autocast copies, per-dtype activations and the recomputed block (module docstring)")


def format_time(shape: ModelShape, setup: TrainSetup, peak_tflops: float, peak_source: str, mfu: float) -> str:
    fpt = flops_per_token(shape, setup)
    attn = 12.0 * shape.n_layer * setup.seq_len * shape.d_model
    rate = peak_tflops * 1e12 * mfu / fpt
    lines = [
        f"time (bf16 peak {peak_tflops:.0f} TFLOP/s from {peak_source}, x utilisation {mfu:.2f}):",
        f"  FLOPs per token  {fpt / 1e9:.2f} GFLOP = {'4' if setup.adapters else '6'} N "
        f"(N = {fmt_count(shape.n_matmul_params)} matmul params) + 12 L T d ({attn / 1e9:.2f} GFLOP attention)"
        f"{' + recompute forward' if setup.recompute else ''}",
        f"  throughput       {rate:,.0f} tokens/s; {training_hours(1e9, fpt, peak_tflops, mfu):.1f} h per 1B tokens",
    ]
    if not setup.adapters:
        tokens = chinchilla_tokens(shape.n_params)
        lines.append(f"  Chinchilla       {tokens / 1e9:.1f}B tokens (20/param) -> "
                     f"{training_hours(tokens, fpt, peak_tflops, mfu):.1f} h")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hf-cgpu budget",
        description="Memory ledger and training time for one GPU. Sizes: GB is read as GiB (like the seed).",
    )
    src = p.add_argument_group("model (one of)")
    src.add_argument("--preset", help=f"GPT preset or shape (default 124m): {', '.join(preset_names())}")
    src.add_argument("--config", help="a local config.json of a transformers causal LM (or its directory)")
    src.add_argument("--model", help="preset name, local config path, or Hub id (needs network)")
    run = p.add_argument_group("training")
    run.add_argument("--seq_len", type=int, help="tokens per sequence (default: preset's, else 1024)")
    run.add_argument("--micro_batch_size", type=int, help="sequences per forward/backward (default: preset's, else 8)")
    run.add_argument("--accumulation", type=int, help="micro-batches per optimizer step (default: preset's, else 1)")
    run.add_argument("--tier", help=f"{', '.join(TIERS)} (or 'recompute' = full + --recompute)")
    run.add_argument("--recompute", action="store_true", default=None, help="full-layer activation checkpointing")
    run.add_argument("--no_recompute", action="store_false", dest="recompute", help="override a preset's recompute")
    run.add_argument("--precision", help="full tiers: amp (fp32 weights + bf16 autocast) or bf16-master")
    run.add_argument("--lora_rank", type=int, default=16)
    run.add_argument("--lora_targets", default="all-linear", help="comma list of module names, attn, mlp or all-linear")
    run.add_argument("--stock_peft", action="store_true", help="model stock peft (no autocast / kbit upcast)")
    run.add_argument("--loss_chunk", type=int,
                     help="tokens per loss chunk, 0 = full logits (default: 1024; 0 with --stock_peft)")
    run.add_argument("--compiled_loss", action="store_true", help="cross-entropy inside torch.compile (nanoGPT style)")
    run.add_argument("--attention", default="sdpa", help="sdpa (flash) or eager")
    fit = p.add_argument_group("verdict and time")
    fit.add_argument("--memory_cap", default="16GB", help="card memory, e.g. 16GB, 24GiB, 12000MB")
    fit.add_argument("--autofit", action="store_true", help="walk the seed's ladder until it fits")
    fit.add_argument("--effective_batch_tokens", type=int, help="autofit: tokens per optimizer step to keep")
    fit.add_argument("--no_lora", action="store_true", help="autofit: never switch to LoRA/QLoRA")
    fit.add_argument("--min_micro_batch", type=int, default=1, help="autofit: smallest micro-batch of rung 1")
    fit.add_argument("--peak_tflops", type=float, help="bf16 peak (default: `hf-cgpu bench` result)")
    fit.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="fraction of the peak sustained")
    return p


def _setup_from_args(args: argparse.Namespace, preset: Mapping[str, Any]) -> TrainSetup:
    tier = args.tier or preset.get("tier", "full")
    recompute = args.recompute if args.recompute is not None else bool(preset.get("recompute", False))
    if tier == "recompute":
        tier, recompute = "full", True
    if tier not in TIERS:
        raise BudgetError(f"unknown tier {tier!r}: choose one of {', '.join(TIERS)} (add --recompute to any)")
    loss_chunk = args.loss_chunk
    if loss_chunk is None:  # hf_cgpu chunks the loss for its GPT and (causal_lm_loss_from_hidden) for HF models
        loss_chunk = 0 if args.stock_peft else int(preset.get("loss_chunk_size", 1024))
    def pick(value: Any, key: str, default: int) -> int:  # command line > preset file > default
        return int(preset.get(key, default)) if value is None else value

    return TrainSetup(
        seq_len=pick(args.seq_len, "seq_len", 1024),
        micro_batch_size=pick(args.micro_batch_size, "micro_batch_size", 8),
        accumulation_steps=pick(args.accumulation, "gradient_accumulation_steps", 1),
        tier=tier, recompute=recompute, precision=args.precision or "amp", lora_rank=args.lora_rank,
        lora_targets=tuple(t for t in args.lora_targets.split(",") if t), stock_peft=args.stock_peft,
        loss_chunk=loss_chunk, compiled_loss=args.compiled_loss, attention=args.attention,
    )


def _peak(args: argparse.Namespace) -> tuple[float, str]:
    if args.peak_tflops:
        return args.peak_tflops, "--peak_tflops"
    from .bench import load_measured_peak

    measured = load_measured_peak()
    if measured:
        return measured, "hf-cgpu bench"
    return ASSUMED_PEAK_TFLOPS, "an assumed 5070 Ti figure; run `hf-cgpu bench`"


def run(argv: Sequence[str] | None = None) -> str:
    """Parse ``argv`` and return the report text (BudgetError on bad input)."""
    args = build_parser().parse_args(argv)
    sources = [x for x in (args.preset, args.config, args.model) if x]
    if len(sources) > 1:
        raise BudgetError("give one of --preset, --config or --model")
    preset: dict[str, Any] = {}
    if args.config:
        shape = ModelShape.from_config_file(args.config)
    elif args.model and args.model not in preset_names():
        shape = resolve_model(args.model)
    else:
        name = args.preset or args.model or "124m"
        shape = ModelShape.from_preset(name)
        preset = load_preset_json(name)
        if args.seq_len and shape.n_positions:  # hf_cgpu's GPT sizes its position table to seq_len
            shape = dataclasses.replace(shape, n_positions=args.seq_len)
    cap = parse_memory(args.memory_cap)
    if not 0 < args.mfu <= 1:
        raise BudgetError(f"--mfu must be in (0, 1], got {args.mfu}: typical is 0.3-0.5")
    setup = _setup_from_args(args, preset)
    out = [f"hf-cgpu budget: {shape.describe()}", f"  {setup.describe()}", ""]
    if args.autofit:
        plan = autofit(
            shape, cap, seq_len=setup.seq_len, effective_batch_tokens=args.effective_batch_tokens,
            micro_batch_size=None if args.effective_batch_tokens else setup.micro_batch_size,
            accumulation_steps=setup.accumulation_steps, allow_lora=not args.no_lora,
            min_micro_batch=args.min_micro_batch, base=setup,
        )
        out.append("autofit (the seed's ladder: micro-batch -> recompute -> sequence -> 8-bit AdamW -> LoRA -> QLoRA):")
        out += [f"  {i}. {r}" for i, r in enumerate(plan.reasons, 1)]
        out += ["", f"  plan: {plan.setup.describe()}", ""]
        setup, led = plan.setup, plan.ledger
    else:
        led = ledger(shape, setup, cap)
    out.append(format_ledger(led))
    if not led.fits and not args.autofit:
        nxt = next_rung(shape, setup, cap)
        if nxt:
            label, nled = nxt
            verdict = "fits" if nled.fits else "still over"
            out.append(f"  next rung (seed's order): {label}: {fmt_gib(nled.total)}, {verdict}; --autofit for a plan")
        else:
            out.append("  no rung left on the ladder: pick a smaller model")
    out.append(format_seed_comparison(shape, setup, led))
    out.append("")
    peak, source = _peak(args)
    out.append(format_time(shape, setup, peak, source, args.mfu))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``hf-cgpu budget``: print the ledger; bad input ends with a one-line error (SystemExit)."""
    try:
        text = run(argv)
    except BudgetError as e:
        raise SystemExit(f"hf-cgpu budget: error: {e}") from None
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
