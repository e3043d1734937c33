"""What the ledger knows of a run: the model's shape, read from its config, and how it is trained.

``ModelShape`` comes from a transformers config only (``from_config``): a GPT preset goes through the same
``GPTSettings.model_config`` -> ``CgptConfig`` that training builds (``cli.preset_shape``), a fine-tuning base
through its ``config.json``.
``TrainSetup`` is the run's ``TrainSettings`` (the very fields, defaults and checks) plus the sequence, loss and
processes of its task and launch, built from those settings (``RunShape.setup``). A task declares its ``RunShape``
(model shape, sequence length, loss chunk, train mode) so the trainer's autofit and ``hf-cgpu budget`` describe a run
the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MissingPathError, SettingsError
from ..gguf import gguf_location
from ..hub.checks import check_hub_model
from ..optim import optimizer_spec
from ..options import ADAPTER_TIERS
from ..settings import TrainSettings

FAMILIES = ("gpt", "gptneox", "llama")
ATTENTIONS = ("sdpa", "eager")

REFERENCE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "pythia-1.4b": ("gpt_neox", dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                                     intermediate_size=8192, vocab_size=50304, tie_word_embeddings=False,
                                     max_position_embeddings=2048)),
}
"""Shapes known without a download: the Pythia-1.4B config of the seed's LoRA exercise (``EleutherAI/pythia-1.4b``)."""
REFERENCE_HUB_IDS = {"EleutherAI/pythia-1.4b": "pythia-1.4b"}
"""Hub ids whose shape is a reference config: priced without asking the Hub."""


def fmt_count(n: float) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.{2 if div == 1e9 else 1}f}{suffix}"
    return str(int(n))


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
    o, gated SiLU MLP, RMSNorm, rotary, grouped-query attention). Build it with ``from_config``.
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
    attention: str = "sdpa"
    """The config's attention implementation: sdpa (flash / memory-efficient kernels, no T x T scores) or eager
    (scores saved per head)."""
    qk_norm: bool = False
    """RMSNorm gains on each head's queries and keys (cgpt ``qk_norm``): 2 * head_size parameters per block."""
    value_embeddings: int = 0
    """Value-embedding tables (cgpt ``value_embeddings``): vocab_size * d_model each, and two mixing scalars in each
    of the 2 * value_embeddings layers they feed."""
    unet_skips: bool = False
    """One learnable skip weight per early block, n_layer // 2 in all (cgpt ``unet_skips``)."""
    logit_softcap: float = 0.0
    """Soft-capped logits (cgpt ``logit_softcap``): no parameters, a second saved copy of the logits."""
    layer_loops: int = 1
    """Passes through the block stack with shared weights (cgpt ``layer_loops``): FLOPs and activations count every
    pass (``depth``), parameters once."""
    name: str = ""
    max_positions: int = 0
    """Longest sequence the model takes (n_positions / max_position_embeddings); 0 = unknown."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise SettingsError(f"unknown model family {self.family!r}: choose one of {', '.join(FAMILIES)}")
        if self.attention not in ATTENTIONS:
            raise SettingsError(f"unknown attention {self.attention!r}: choose one of {', '.join(ATTENTIONS)}")
        for key in ("n_layer", "d_model", "n_head", "vocab_size"):
            if int(getattr(self, key)) <= 0:
                raise SettingsError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.head_size == 0:
            if self.d_model % self.n_head:
                raise SettingsError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}: fix the shape")
            object.__setattr__(self, "head_size", self.d_model // self.n_head)
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", int(round(self.mlp_ratio * self.d_model)))
        if self.n_kv_head == 0:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.n_head % self.n_kv_head:
            raise SettingsError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}: fix the shape")
        if self.family == "gpt":
            object.__setattr__(self, "norm_bias", self.bias if self.norm_bias is None else self.norm_bias)
        else:  # GPT-NeoX LayerNorms always carry a bias; Llama's RMSNorm never does
            object.__setattr__(self, "norm_bias", self.family == "gptneox")

    # ---- constructors: every one ends in from_config ----
    @classmethod
    def from_config(cls, config: Any, name: str = "") -> ModelShape:
        """From a transformers config (object or ``config.json`` dict) of a causal LM (gpt2, cgpt, gpt_neox,
        llama-like)."""
        return _shape_from_config(config, name)

    @classmethod
    def reference(cls, name: str) -> ModelShape:
        """A model of ``REFERENCE_CONFIGS``, read as its ``config.json`` would be (no download, no transformers)."""
        if name not in REFERENCE_CONFIGS:
            raise SettingsError(f"unknown reference model {name!r}: choose one of {', '.join(REFERENCE_CONFIGS)}")
        model_type, kwargs = REFERENCE_CONFIGS[name]
        return _shape_from_config({"model_type": model_type, **kwargs}, name)

    @classmethod
    def from_config_file(cls, path: str | Path) -> ModelShape:
        """From a local ``config.json`` (or a directory holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise MissingPathError(f"no config.json at {str(path)!r}: pass the file or the model directory")
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise SettingsError(f"{p} is not valid JSON ({e.msg} at line {e.lineno}): fix or re-download it") from None
        except UnicodeDecodeError:
            raise SettingsError(f"{p} is not a config.json (not text): pass a model's config.json, its folder, or a "
                                ".gguf file") from None
        return _shape_from_config(cfg, p.parent.name)

    @classmethod
    def from_gguf(cls, model: str, gguf_file: str = "") -> ModelShape:
        """From a GGUF checkpoint as the fine-tuning command's ``--model`` (and ``--gguf_file``) name it: its
        metadata through ``transformers.AutoConfig(..., gguf_file=)``; no tensor is read or de-quantised."""
        folder, name = gguf_location(model, gguf_file)
        stat = (folder / name).stat()
        return _gguf_shape(str(folder), name, stat.st_size, stat.st_mtime_ns)

    @classmethod
    def from_hub(cls, model_id: str) -> ModelShape:
        """From a Hub model id through ``transformers.AutoConfig`` (needs network or a cached config); an id that is
        neither cached nor answers one request is one line at once, not after a minute of retries."""
        if model_id in REFERENCE_HUB_IDS:
            return cls.reference(REFERENCE_HUB_IDS[model_id])
        check_hub_model(model_id)
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(model_id)
        except Exception as e:  # offline, gated, typo: all end the same way for the user
            reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            raise SettingsError(
                f"cannot load the config of {model_id!r} from the Hub ({reason}): "
                "download its config.json and pass --config PATH"
            ) from None
        return _shape_from_config(cfg, model_id)

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
        """Every parameter tensor as (name, numel, kind); kind is embedding | head | linear | bias | norm
        (norm also for the other 1-D parameters: value mixes, skip weights)."""
        d, L = self.d_model, self.n_layer
        out: list[tuple[str, int, str]] = [("embed", self.vocab_size * d, "embedding")]
        if self.n_positions:
            out.append(("positions", self.n_positions * d, "embedding"))
        out += [(f"value_embeds.{t}", self.vocab_size * d, "embedding") for t in range(self.value_embeddings)]
        fed = {*range(self.value_embeddings), *range(L - self.value_embeddings, L)}  # the layers the tables feed
        norms_per_layer = 2
        for i in range(L):
            for j in range(norms_per_layer):
                out.append((f"h.{i}.norm{j}.weight", d, "norm"))
                if self.norm_bias:
                    out.append((f"h.{i}.norm{j}.bias", d, "norm"))
            if self.qk_norm:
                out += [(f"h.{i}.q_norm.weight", self.head_size, "norm"), (f"h.{i}.k_norm.weight", self.head_size, "norm")]
            if i in fed:
                out.append((f"h.{i}.value_mix", 2, "norm"))
            for lin in self.linears():
                out.append((f"h.{i}.{lin.name}.weight", lin.d_in * lin.d_out, "linear"))
                if lin.bias:
                    out.append((f"h.{i}.{lin.name}.bias", lin.d_out, "bias"))
        if self.unet_skips:
            out.append(("skip_weights", L // 2, "norm"))
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

    @property
    def depth(self) -> int:
        """Blocks run per token: n_layer, times layer_loops."""
        return self.n_layer * self.layer_loops

    @property
    def matmul_params_per_token(self) -> int:
        """Weights multiplied per token (2 FLOPs each forward): the block linears once per pass, the head once."""
        return self.n_block_linear_params * self.layer_loops + self.vocab_size * self.d_model

    def positions_note(self, seq_len: int) -> str:
        """'' when ``seq_len`` is within the model's positions; a note when it is beyond them but the positions are
        rotary angles computed from ``position_ids`` (GPT-NeoX, Llama: memory and time are what they are, quality past
        the trained length is not promised); a ``SettingsError`` for a position table (GPT-2, our GPT)."""
        if not self.max_positions or seq_len <= self.max_positions:
            return ""
        if self.family == "gpt":
            raise SettingsError(f"--seq_len {seq_len} is longer than the model's {self.max_positions} positions; "
                                f"use --seq_len {self.max_positions} or less")
        return (f"note: --seq_len {seq_len} is beyond the {self.max_positions} positions {self.name} was trained on; "
                "its rotary positions extend to it, but use a long-context base (or rope scaling) for quality there")

    def describe(self) -> str:
        kv = f", {self.n_kv_head} kv heads" if self.n_kv_head != self.n_head else ""
        ff = "" if self.d_ff == 4 * self.d_model else f", d_ff {self.d_ff}"
        attn = "" if self.attention == "sdpa" else f", {self.attention} attention"
        attn += f", the blocks run {self.layer_loops} times" if self.layer_loops > 1 else ""
        return (
            f"{self.name or 'model'} ({self.family}, {self.n_layer} x {self.d_model}, {self.n_head} heads{kv}{ff}"
            f"{attn}, vocab {self.vocab_size}) = {fmt_count(self.n_params)} params"
        )


_NEOX_TYPES = {"gpt_neox"}
_GPT_TYPES = {"gpt2", "cgpt"}


@functools.lru_cache(maxsize=8)
def _gguf_shape(folder: str, name: str, size: int, mtime_ns: int) -> ModelShape:
    """``ModelShape.from_gguf``'s reading, once per file version in a process: transformers parses all the file's
    metadata (the tokenizer's vocabulary too) for a config, seconds for a 135M model."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # a truncated file, an architecture transformers cannot map from GGUF
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise SettingsError(f"cannot read the config of GGUF {Path(folder) / name} ({reason}): pass its config.json "
                            "with --config") from None
    return _shape_from_config(cfg, Path(name).stem)


def _shape_from_config(config: Any, name: str = "") -> ModelShape:
    """Read the keys that matter from a transformers config; unknown model types are treated as Llama-like."""
    cfg = config if isinstance(config, Mapping) else config.to_dict()
    if isinstance(cfg.get("text_config"), Mapping):  # multimodal configs nest the language model's
        cfg = cfg["text_config"]
    cfg = dict(cfg)
    model_type = str(cfg.get("model_type", ""))
    implementation = getattr(config, "_attn_implementation", None) or cfg.get("attn_implementation")
    attention = "eager" if implementation == "eager" else "sdpa"

    def pick(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise SettingsError(f"config has none of {', '.join(keys)}: pass --preset or a causal-LM config.json")
        return default

    d = int(pick("hidden_size", "n_embd", "d_model"))
    positions = next((int(cfg[k]) for k in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length")
                      if isinstance(cfg.get(k), int) and cfg[k] > 0), 0)
    common = dict(
        n_layer=int(pick("num_hidden_layers", "n_layer", "num_layers")),
        d_model=d,
        n_head=int(pick("num_attention_heads", "n_head")),
        vocab_size=int(pick("vocab_size")),
        attention=attention,
        name=name or model_type,
        max_positions=positions,
    )
    if model_type in _GPT_TYPES or ("n_embd" in cfg and model_type not in _NEOX_TYPES):
        gpt2 = model_type == "gpt2"
        ff = cfg.get("n_inner") or int(round(float(cfg.get("mlp_ratio", 4)) * d))
        rotary = cfg.get("position_embedding") == "rotary"  # cgpt: no position table
        return ModelShape(
            **common, family="gpt", d_ff=int(ff),
            n_positions=0 if rotary else int(pick("n_positions", "max_position_embeddings")),
            bias=bool(cfg.get("bias", gpt2)), tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            norm_bias=False if cfg.get("norm") == "rmsnorm" else None, qk_norm=bool(cfg.get("qk_norm", False)),
            value_embeddings=int(cfg.get("value_embeddings", 0)), unet_skips=bool(cfg.get("unet_skips", False)),
            layer_loops=int(cfg.get("layer_loops", 1)), logit_softcap=float(cfg.get("logit_softcap", 0.0)),
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


# ===================================================================================================================
# How the model is trained
# ===================================================================================================================


@dataclass(frozen=True)
class TrainSetup(TrainSettings):
    """A run as the ledger sees it: its ``TrainSettings`` (inherited: the same fields, defaults and checks) and what
    the task and the launch add. Built from the settings by ``RunShape.setup``; the ladder steps down with
    ``dataclasses.replace``."""

    seq_len: int = 1024
    """Tokens per sequence (the task's)."""
    loss_chunk_size: int = 1024
    """Tokens per checkpointed loss chunk (the task's); 0 = full logits."""
    loss_in_forward: bool = True
    """The loss runs inside ``model.forward`` (our GPT), so a whole-model compile fuses it with the head."""
    processes: int = 1
    """Data-parallel processes (one per GPU); the ledger is per GPU, the micro-batch is per process."""
    fsdp: bool = False
    """With ``processes`` > 1: FSDP2 (weights, gradients and optimizer state sharded over the processes) instead of
    DDP (a whole replica per GPU, plus DDP's gradient buckets)."""
    packed: bool = False
    """Rows hold several examples (fine-tuning's ``--packing``, pretraining's ``--document_masking``): positions
    restart per example, and transformers builds a ``T x T`` mask per row from them for sdpa/eager attention."""
    extra_heads: int = 0
    """Multi-token prediction heads (a GPT's ``--mtp_heads``): each a d x d matrix, then the LM head and its
    cross-entropy once more a micro-batch, outside the compiled model."""
    extra_heads_share: float = 1.0
    """Share of the steps the extra heads run (``--mtp_anneal``: none after it)."""
    teachers: tuple[ModelShape, ...] = ()
    """Distillation teachers (a GPT's ``--teacher``): a no-grad forward each a micro-batch from bf16 weights, and
    their logits beside the student's in the KL's chunk."""
    teacher_share: float = 1.0
    """Share of the steps the teachers (or their cache's KL) run (``--distill_anneal``: none after it)."""
    teacher_top_k: int = 0
    """The teacher's predictions read from a cache of its top-K over the training stream (a GPT's
    ``--teacher_top_k``), built by one forward over the stream before the first step: no teacher in the step, the
    cache on the GPU, a sparse KL in the cross-entropy's chunk; 0 = the teachers on the fly."""
    stream_tokens: int = 0
    """Tokens of the training stream: the cache's positions (0 = not known, the cache not priced)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("seq_len", "processes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SettingsError(f"{key} must be a positive integer, got {value!r}")
        if not isinstance(self.loss_chunk_size, int) or self.loss_chunk_size < 0:
            raise SettingsError(f"loss_chunk_size must be 0 (full logits) or a positive token count, "
                                f"got {self.loss_chunk_size!r}")

    @classmethod
    def of(cls, settings: TrainSettings, **run: Any) -> TrainSetup:
        """``settings`` with the task's and the launch's part ``run`` (seq_len, loss_chunk_size, ...)."""
        return cls(**{**{f.name: getattr(settings, f.name) for f in dataclasses.fields(TrainSettings)}, **run})

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_micro_batch * self.gradient_accumulation_steps

    @property
    def recompute_mode(self) -> str:
        """off, full, selective or offload: what the backward re-runs."""
        return self.recompute_policy if self.recompute else "off"

    @property
    def reruns_forward(self) -> bool:
        """The backward re-runs each block's whole forward (full recompute, offloaded or not)."""
        return self.recompute_mode in ("full", "offload")

    @property
    def recompute_words(self) -> str:
        return {"off": "no recompute", "full": "recompute", "selective": "selective recompute",
                "offload": "recompute, block inputs in host memory"}[self.recompute_mode]

    @property
    def adapters(self) -> bool:
        return self.tier in ADAPTER_TIERS

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """``lora_target_modules`` as names; empty = every block linear (what the tiers pick per architecture)."""
        return tuple(t for t in self.lora_target_modules.split(",") if t) or ("all-linear",)

    @property
    def ema(self) -> bool:
        """An fp32 average of every trainable weight, alive all run (``ema_decay`` above 0)."""
        return self.ema_decay > 0

    @property
    def compiled_loss(self) -> bool:
        """The full-logits cross-entropy runs inside torch.compile: our GPT compiled whole with full logits."""
        return self.compile and self.loss_in_forward and not self.loss_chunk_size and not self.adapters

    def describe(self) -> str:
        if self.adapters:
            regime = {"lora": "frozen bf16 base under bf16 autocast, fp32 adapters",
                      "qlora": "frozen nf4 base, bf16 embeddings/norms, bf16 autocast, fp32 adapters"}[self.tier]
            what = f"{self.tier} r={self.lora_r} on {','.join(self.lora_targets)} ({regime})"
        else:
            label = "AdamW8bit" if self.tier == "adamw8bit" else optimizer_spec(self.optimizer).label
            what = f"{self.tier} ({label}, fp32 weights + bf16 autocast)"
        loss = f"loss in chunks of {self.loss_chunk_size} tokens" if self.loss_chunk_size else (
            "full logits, compiled loss" if self.compiled_loss else "full logits, eager loss")
        gpus = ""
        if self.processes > 1:
            gpus = (f" per GPU, x {self.processes} {'FSDP2' if self.fsdp else 'DDP'} processes = "
                    f"{self.tokens_per_step * self.processes:,} tokens/step in all")
        return (
            f"{what}; seq {self.seq_len} x micro-batch {self.micro_batch_size} x accumulation "
            f"{self.gradient_accumulation_steps} = {self.tokens_per_step:,} tokens/step{gpus}; "
            f"{self.recompute_words}; {loss}{'; packed rows' if self.packed else ''}{self.extras_words}"
        )

    @property
    def extras_words(self) -> str:
        """The multi-token heads and distillation teachers, as the description's tail."""
        out = ""
        if self.extra_heads:
            out += f"; {self.extra_heads} multi-token heads for {self.extra_heads_share:.0%} of the steps"
        if self.teachers:
            out += f"; distilled from {len(self.teachers)} teacher{'s' * (len(self.teachers) > 1)} (" + ", ".join(
                f"{t.name}: {fmt_count(t.n_params)} params" for t in self.teachers) + ")"
            if self.teacher_top_k:
                out += f", its top-{self.teacher_top_k} cached over the stream"
            if self.teacher_share < 1:
                out += f", for {self.teacher_share:.0%} of the steps"
        return out


@dataclass(frozen=True)
class RunShape:
    """What a language-model task declares for the ledger: its model's shape and how its sequences and loss run."""

    model: ModelShape
    """From the config of the model the task trains."""
    seq_len: int
    """Tokens per training sequence."""
    loss_chunk_size: int
    """Tokens per chunk of the loss; 0 = full logits."""
    loss_in_forward: bool = True
    """The loss runs inside ``model.forward`` (our GPT), so a whole-model compile fuses it; False when the task
    calls the backbone itself (the fine-tuning loss)."""
    train_mode: str = "finetune"
    """pretrain: trained from random weights (our GPT's task), where the adapter tiers are refused as training
    refuses them; finetune: from a trained model."""
    packed: bool = False
    """Several examples per row, positions restarting at each (fine-tuning's ``--packing`` on instruction data, a
    GPT's ``--document_masking``)."""
    extra_heads: int = 0
    """``TrainSetup.extra_heads``."""
    extra_heads_share: float = 1.0
    """``TrainSetup.extra_heads_share``."""
    teachers: tuple[ModelShape, ...] = ()
    """``TrainSetup.teachers``."""
    teacher_share: float = 1.0
    """``TrainSetup.teacher_share``."""
    teacher_top_k: int = 0
    """``TrainSetup.teacher_top_k``."""
    stream_tokens: int = 0
    """``TrainSetup.stream_tokens``."""

    @property
    def pretrain(self) -> bool:
        return self.train_mode == "pretrain"

    def setup(self, settings: TrainSettings, processes: int = 1, fsdp: bool = False) -> TrainSetup:
        """The ``TrainSetup`` of a run of this shape with ``settings`` on ``processes`` GPUs (its tier checked
        against the task's train mode, as training checks it)."""
        return TrainSetup.of(settings, seq_len=self.seq_len, loss_chunk_size=self.loss_chunk_size,
                             loss_in_forward=self.loss_in_forward, processes=processes, fsdp=fsdp,
                             train_mode=self.train_mode, packed=self.packed, extra_heads=self.extra_heads,
                             extra_heads_share=self.extra_heads_share, teachers=self.teachers,
                             teacher_share=self.teacher_share, teacher_top_k=self.teacher_top_k,
                             stream_tokens=self.stream_tokens)
