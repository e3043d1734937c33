"""hf_cgpu GPT: a GPT-2 style causal LM as a transformers ``PreTrainedModel`` + ``GenerationMixin``.

Read leaf to root: loss, attention, MLP, block, backbone, LM head. Self-contained on purpose (only a relative import of
its config): ``save_pretrained`` copies both files next to the weights so that
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` works where hf_cgpu is not installed.

Follows the conventions of transformers' own decoders (GPT-2, Llama):
- attention through ``ALL_ATTENTION_FUNCTIONS``: ``attn_implementation`` "sdpa" (default), "eager",
  "flash_attention_2" where installed, "flex_attention", or any registered backend. Only "eager" returns weights, so a
  call that asks for attentions runs eager for that call.
- masks from ``create_causal_mask`` (padding, 4D masks, static caches, packed sequences given by ``position_ids``).
  Without any of those and with SDPA the mask stays None and SDPA runs ``is_causal=True`` (the training path).
- ``hidden_states`` / ``attentions`` recorded by ``capture_outputs`` and ``_can_record_outputs``; ``return_dict=False``
  returns tuples (``can_return_tuple``).
- no Python branch on tensor values, so ``torch.export`` and ``torch.compile(fullgraph=True)`` trace it.

Modern options, all off by default (``CgptConfig``): rotary positions (``position_embedding="rotary"``, Llama's
rotate-half form, cos/sin looked up in a fixed table by ``position_ids`` so caches, left padding and packed sequences
work as with the learned table),
RMSNorm of queries and keys per head (``qk_norm``), ReLU squared (``activation="relu2"``), RMSNorm blocks
(``norm="rmsnorm"``); from modded-nanogpt: value embeddings (``value_embeddings``), soft-capped logits
(``logit_softcap``), U-net skips from early to late blocks (``unet_skips``), a zero-initialised untied head
(``zero_init_head``); from the NanoGPT Slowrun: the block stack run ``layer_loops`` times with shared weights (each
pass its own layers in the cache). Each creates its parameters only when on, so with all off the model, its
state_dict and its initialisation's random stream are the plain one.

A model trained with attention within each document (``document_masking``, recorded in its config) runs so by
itself: without ``position_ids`` its positions restart after each EOS and each token attends only to its own document,
in a plain forward over a stream of documents, in ``generate`` (with a cache, across an EOS of the prompt or of the
continuation) and with padding; ``position_ids`` given by the caller mark the documents instead.

Beyond upstream: the chunked fp32 loss (``loss_chunk_size``) that never builds all the logits.
In eval mode a call with labels returns logits too (Trainer's evaluation reads them); training builds none.

Works on transformers 5.17 (forward argument ``past_key_values``) through 5.24+ (renamed ``cache``): both names are
accepted and the returned output uses whichever field name the installed ``CausalLMOutputWithPast`` has.
"""

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_masks_for_generate
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_cgpt import CgptConfig

try:  # transformers >= 5: init functions that leave weights loaded from a checkpoint untouched
    from transformers import initialization as init
except ImportError:  # pragma: no cover - older transformers
    from torch.nn import init

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the output/input field ``past_key_values`` to ``cache``.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
IGNORE_INDEX = -100


def _past_key_values_is_deprecated(forward: Callable) -> Callable:
    """Where ``cache`` is the name (5.24+), ``past_key_values`` warns like in transformers' models and is renamed."""
    if _CACHE_FIELD == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)
    return forward  # transformers 5.17: ``past_key_values`` is the current name, generate passes it


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` in fp32 (modded-nanogpt's logit soft-capping); ``cap = 0``: the logits as they are."""
    if not cap:
        return logits
    return cap * torch.tanh(logits.float() / cap)


def _chunk_ce_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, ignore_index: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # (n, V): matmul in the operands' dtype, softmax in fp32
    logits = soft_cap(logits, softcap)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    denominator: int | torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Mean token cross-entropy of ``hidden @ weight.T (+ bias)`` (soft-capped at ``softcap`` if > 0) against
    ``targets`` without holding all logits.

    hidden (N, C), weight (V, C), targets (N,). Each chunk's fp32 logits live only inside a checkpointed call, so
    forward and backward hold one ``chunk_size x V`` block instead of ``N x V`` (1 GB at 124M, micro-batch 8).
    ``denominator`` replaces the count of non-ignored targets (for accumulation over uneven micro-batches).
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start : start + chunk_size], weight, bias, targets[start : start + chunk_size], ignore_index,
                softcap)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_ce_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_ce_sum(*args)
    if denominator is None:
        denominator = (targets != ignore_index).sum().clamp(min=1)
    if torch.is_tensor(denominator):
        denominator = denominator.to(total.device)
    return total / denominator


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin of the rotary angles ``position * theta ** (-2i / head_dim)``, each (B|1, T, head_dim)."""
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    freqs = position_ids.to(torch.float32)[..., None] / theta**exponent  # (B|1, T, head_dim / 2)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


class CgptRotaryTable(nn.Module):
    """cos and sin of the rotary angles of every position below ``n_positions`` (fp32 buffers, each
    (n_positions, head_dim); not saved: ``_init_weights`` rebuilds them on load), looked up by ``position_ids``.

    A table, not the angles computed in forward: under torch.compile inductor inlines that computation (pow, sin,
    cos) into every query and key kernel, forward and backward, so each angle would be evaluated once per batch row
    and head, a large share of the step (benchmarks/RESULTS.md)."""

    def __init__(self, config: CgptConfig):
        super().__init__()
        self.head_dim, self.theta = config.n_embd // config.n_head, config.rope_theta
        cos, sin = self.angles(config.n_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def angles(self, n: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(torch.arange(n, device=device), self.head_dim, self.theta)

    @torch.no_grad()
    def reset(self) -> None:
        cos, sin = self.angles(self.cos.shape[0], self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def _apply(self, fn, recurse=True):
        """``.to(bfloat16)`` / ``.half()`` of the model keep the table fp32, rebuilt (not cast back from bf16)."""
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos, self.sin = (torch.empty_like(b, dtype=torch.float32) for b in (self.cos, self.sin))
            self.reset()
        return self

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B|1, T) positions -> fp32 cos, sin (B|1, T, head_dim)."""
        return self.cos[position_ids].float(), self.sin[position_ids].float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """Rotate the pairs ``(x[i], x[i + hs/2])`` of x by the angles of cos, sin (B|1, T, hs), in fp32; x is
    (B, nh, T, hs) with ``unsqueeze_dim=1`` or (B, T, nh, hs) with ``unsqueeze_dim=2`` (the layout the model uses)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class ReLUSquared(nn.Module):
    """relu(x)^2 (Primer; modded-nanogpt's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


def make_norm(config: CgptConfig, dim: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.layer_norm_epsilon)
    return nn.LayerNorm(dim, eps=config.layer_norm_epsilon, bias=config.bias)


def value_table_of(layer_idx: int, n_layer: int, tables: int) -> int | None:
    """Which value-embedding table feeds layer ``layer_idx``: table i feeds layers i and ``n_layer - tables + i``
    (modded-nanogpt's U-shaped sharing), the middle layers none."""
    if layer_idx < tables:
        return layer_idx
    if layer_idx >= n_layer - tables:
        return layer_idx - (n_layer - tables)
    return None


def document_position_ids(is_eos: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Positions counted from each document's start, (B, S): a document starts at the first token and after each EOS
    (``is_eos`` (B, S) bool; an EOS ends its own document and keeps its position). Only real tokens count
    (``attention_mask`` (B, S), 0 for padding; left padding gets position 0). Cumulative sums: no host sync."""
    real = torch.ones_like(is_eos) if attention_mask is None else attention_mask.bool()
    count = real.long().cumsum(-1)  # real tokens up to and including each token
    ends = torch.where(is_eos & real, count, 0).cummax(-1).values  # real tokens up to the latest EOS so far
    # the real tokens of earlier documents: the latest EOS strictly before each token (a roll, not a slice, so that
    # torch.export puts no guard on a dynamic length)
    before = torch.roll(ends, 1, -1).masked_fill(torch.arange(ends.shape[-1], device=ends.device) == 0, 0)
    return (count - 1 - before).clamp(min=0)


def document_mask_function(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, past,
                           kv_length: int) -> Callable:
    """A transformers mask function (and-ed with the causal one) keeping each query within its document, as its
    position counts it: the query at position p sees itself and the p real tokens before it. ``position_ids``
    (B, T) of this call's queries, ``attention_mask`` the 2D (B, past + T) padding mask or None, ``past`` the tokens
    already cached, ``kv_length`` the keys the mask spans. Both sides are looked up by index (mask functions get
    absolute indices), as transformers' own mask functions do, with no arithmetic on the indices."""
    B, T = position_ids.shape
    device = position_ids.device
    if attention_mask is None:
        count = torch.arange(1, kv_length + 1, device=device).repeat(B, 1)  # real tokens up to each key
    else:
        count = F.pad(attention_mask.long().cumsum(-1), (0, kv_length - attention_mask.shape[-1]))
    queries = (torch.arange(T, device=device) + past).expand(B, -1)  # the queries' key indices
    # the count at the first token of each query's document, at the query's own index
    first = torch.zeros_like(count).scatter(1, queries, count.gather(1, queries) - position_ids)
    # one tensor for both: inductor's CPU FlexAttention kernel does not compile a mask that reads two captured
    # tensors once the shapes turn dynamic
    table = torch.stack((count, first))

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return table[0, batch_idx, kv_idx] >= table[1, batch_idx, q_idx]

    return inner


def cgpt_causal_mask(config: CgptConfig, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                     cache: Cache | None, position_ids: torch.Tensor | None, build: Callable = create_causal_mask,
                     **kwargs):
    """transformers' causal mask (``build``: ``create_causal_mask``, or ``create_masks_for_generate``), with
    ``document_masking`` kept within the documents that ``position_ids`` mark by restarting. Without a cache and a
    padding mask transformers reads restarting positions as packed sequences already; with either it does not, so
    the document rule is added (``document_mask_function``)."""
    documents = None
    padding = attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None
    if config.document_masking and position_ids is not None and (cache is not None or padding is not None):
        if config._attn_implementation.startswith("flash"):
            logger.warning_once("document_masking: flash attention keeps no document mask beside a cache or padding "
                                "(attention crosses documents there); use attn_implementation='sdpa'")
        T = inputs_embeds.shape[1]
        if cache is not None:  # the keys the mask spans: the cache's (all of a static cache's slots)
            past, kv_length = cache.get_seq_length(), cache.get_mask_sizes(T, 0)[0]
        else:
            past, kv_length = 0, T if padding is None else padding.shape[-1]
        documents = document_mask_function(position_ids.expand(inputs_embeds.shape[0], -1), padding, past, kv_length)
    return build(config, inputs_embeds, attention_mask, cache, position_ids, and_mask_function=documents, **kwargs)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scaling + mask) v in plain torch ops; also returns the weights. q, k, v (B, nh, T, hs)."""
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, nh, T, S)
    if attention_mask is not None:  # additive float mask from create_causal_mask, (B|1, 1, T, S)
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()  # (B, T, nh, hs)
    return attn_output, attn_weights


class CgptAttention(nn.Module):
    def __init__(self, config: CgptConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.scaling = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.is_causal = True  # read by the sdpa / flash backends
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj.is_residual_projection = True  # read by _init_weights (a flag: parents are not visited)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.layer_norm_epsilon)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.layer_norm_epsilon)
        if value_table_of(layer_idx, config.n_layer, config.value_embeddings) is not None:
            self.value_mix = nn.Parameter(torch.empty(2))  # v = value_mix[0] * v + value_mix[1] * value embedding

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        output_attentions: bool = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        value_embedding: torch.Tensor | None = None,
        cache_index: int | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``cache_index``: this call's layer in the cache (default ``layer_idx``; pass p of ``layer_loops`` gives
        ``p * n_layer + layer_idx``)."""
        B, T, C = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(B, T, 3, self.n_head, self.head_dim).unbind(2)  # (B, T, nh, hs)
        if value_embedding is not None:  # this layer's table, looked up by token (B, T, C); the cache keeps mixed v
            mixed = self.value_mix[0] * v + self.value_mix[1] * value_embedding.view_as(v)
            v = mixed.to(v.dtype)  # fp32 mix of the bf16 values under autocast, back to their dtype
        # q/k norm and rotary act on (B, T, nh, hs), the projection's memory order, before the transpose: over the
        # transposed (B, nh, T, hs) views the fused rotary kernel reads and writes across heads and is several times
        # slower (benchmarks/RESULTS.md).
        if self.config.qk_norm:  # in the gains' dtype: fp32 under autocast, as autocast runs the LayerNorms
            dtype = self.q_norm.weight.dtype
            q, k = self.q_norm(q.to(dtype)), self.k_norm(k.to(dtype))
        if position_embeddings is not None:  # rotary: the cache stores rotated keys
            cos, sin = position_embeddings
            q, k = apply_rotary(q, cos, sin, unsqueeze_dim=2), apply_rotary(k, cos, sin, unsqueeze_dim=2)
        q, k = q.to(v.dtype), k.to(v.dtype)  # back to the projection's dtype (bf16 under autocast)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx if cache_index is None else cache_index)  # (B, nh, past + T, hs)

        implementation = "eager" if output_attentions else self.config._attn_implementation  # only eager has weights
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        y, attn_weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            # FlexAttention has no dropout of the attention weights (transformers refuses it): there the residual and
            # MLP dropout carry the regularisation alone.
            dropout=self.dropout if self.training and implementation != "flex_attention" else 0.0,
            scaling=self.scaling,
            **kwargs,
        )  # y (B, T, nh, hs)
        y = y.reshape(B, T, C)
        return self.resid_dropout(self.proj(y)), attn_weights


class CgptMLP(nn.Module):
    def __init__(self, config: CgptConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd, bias=config.bias)
        self.act = ReLUSquared() if config.activation == "relu2" else nn.GELU(approximate="tanh")
        self.fc_out = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd, bias=config.bias)
        self.fc_out.is_residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc(x))))


class CgptBlock(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: CgptConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = make_norm(config, config.n_embd)
        self.attn = CgptAttention(config, layer_idx)
        self.ln_2 = make_norm(config, config.n_embd)
        self.mlp = CgptMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        value_embedding: torch.Tensor | None = None,
        cache: Cache | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """``value_embedding`` (B, T, C): this layer's value-embedding lookup, if any; positional, like the hidden
        states, so a reentrant checkpoint carries its gradient (one lookup feeds two layers)."""
        attn_output, _ = self.attn(self.ln_1(hidden_states), attention_mask, cache=cache,
                                   position_embeddings=position_embeddings, value_embedding=value_embedding, **kwargs)
        hidden_states = hidden_states + attn_output
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class CgptPreTrainedModel(PreTrainedModel):
    config_class = CgptConfig
    config: CgptConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["CgptBlock"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": CgptBlock,
        "attentions": OutputRecorder(CgptAttention, index=1),
    }

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """transformers' resize of the token embedding (and an untied head), and of the value-embedding tables."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        backbone = getattr(self, self.base_model_prefix, self)
        if backbone.value_embeds is not None:
            backbone.value_embeds = nn.ModuleList(
                self._get_resized_embeddings(t, embeddings.weight.shape[0], mean_resizing=mean_resizing)
                for t in backbone.value_embeds)
            for table in backbone.value_embeds:
                table.is_value_embedding = True
        return embeddings

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if getattr(module, "is_residual_projection", False):
            # GPT-2 scheme: the two residual projections of each block start at std / sqrt(2 * n_layer).
            std = std / math.sqrt(2 * self.config.n_layer)
        if getattr(module, "is_value_embedding", False):
            # the spread of the values themselves (a std-``std`` projection of a unit-RMS input): an even 0.5/0.5 mix
            std = std * math.sqrt(self.config.n_embd)
        if getattr(module, "is_zero_init_head", False):
            init.zeros_(module.weight)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, CgptRotaryTable):  # non-persistent buffers: empty after a load until rebuilt here
            module.reset()
        elif isinstance(module, CgptAttention) and hasattr(module, "value_mix"):
            init.constant_(module.value_mix, 0.5)  # modded-nanogpt's even mix of the values and the value embedding
        elif isinstance(module, CgptModel) and module.skip_weights is not None:
            init.ones_(module.skip_weights)  # each late block reads its mirror's output at full strength


class CgptModel(CgptPreTrainedModel):
    def __init__(self, config: CgptConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # GPT-2's learned position table, or rotary positions' fixed cos/sin table
        self.wpe = nn.Embedding(config.n_positions, config.n_embd) if config.position_embedding == "learned" else None
        self.rotary = CgptRotaryTable(config) if config.position_embedding == "rotary" else None
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([CgptBlock(config, i) for i in range(config.n_layer)])
        self.ln_f = make_norm(config, config.n_embd)
        self.value_embeds = None  # options below: modules and parameters exist only when on
        self.value_tables = [value_table_of(i, config.n_layer, config.value_embeddings) for i in range(config.n_layer)]
        if config.value_embeddings:
            self.value_embeds = nn.ModuleList(nn.Embedding(config.vocab_size, config.n_embd)
                                              for _ in range(config.value_embeddings))
            for table in self.value_embeds:
                table.is_value_embedding = True
        # the output of block j < n_layer // 2, times skip_weights[j], joins the input of block n_layer - 1 - j
        self.skip_weights = nn.Parameter(torch.empty(config.n_layer // 2)) if config.unet_skips else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def _check_positions(self, past, T: int, position_ids: torch.Tensor | None, name: str = "position_ids") -> None:
        """Every position must be below ``n_positions``: the length is what counts without ``position_ids``; with
        them (packed sequences restart at 0, so a row may be longer than any position) their largest value, read
        outside compilation only (a branch on a tensor's value would break the graph). ``name`` says whose."""
        if position_ids is not None:
            if torch.compiler.is_compiling():
                return
            top = int(position_ids.max()) + 1 if position_ids.numel() else 0
            what = f"{name} reach {top - 1}, beyond"
        elif isinstance(past, int):
            top, what = past + T, f"sequence of {past + T} tokens is longer than"
        else:
            return
        if top > self.config.n_positions:
            raise ValueError(
                f"{what} n_positions={self.config.n_positions}; shorten the input (seq_len / "
                "max_new_tokens) or train a model with larger n_positions"
            )

    def _document_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, past) -> torch.Tensor:
        """``document_masking`` without ``position_ids``: positions counted from each document's start (restarting
        after each EOS), over the real tokens of a 2D ``attention_mask``. Only from the first token: what came before
        a cache's tokens is not known here (``generate`` passes the positions of the whole sequence)."""
        known = not torch.is_tensor(past) or not torch.compiler.is_compiling()  # a static cache's length: a tensor
        if known and int(past):
            raise ValueError(
                "document_masking: a cache that holds earlier tokens and no position_ids; the document the new tokens "
                "continue is unknown here: pass position_ids (restarting after each EOS) or use generate()"
            )
        padding = attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None
        return document_position_ids(input_ids == self.config.eos_token_id, padding)

    def _attention_mask(self, inputs_embeds, attention_mask, cache, position_ids, output_attentions: bool):
        """The mask each layer gets: None for plain causal SDPA (its ``is_causal=True`` flash kernel), else
        transformers' mask for the backend that runs (eager when attentions are asked for)."""
        mask_config = self.config
        if output_attentions and self.config._attn_implementation != "eager":
            # Only eager attention returns weights: this call runs it, with the mask eager expects.
            logger.warning_once(f"{self.config._attn_implementation} attention returns no weights; "
                                "output_attentions=True runs eager attention")
            mask_config = copy.copy(self.config)
            mask_config._attn_implementation = "eager"
        plain_causal = attention_mask is None and cache is None and position_ids is None
        if plain_causal and mask_config._attn_implementation == "sdpa":
            # Plain causal attention: SDPA's is_causal=True (flash kernel). create_causal_mask would give the same under
            # eager execution but, while compiling, transformers 5.17 materialises the full mask.
            return None
        return cgpt_causal_mask(mask_config, inputs_embeds, attention_mask, cache, position_ids)

    def _blocks(self, hidden_states, causal_mask, input_ids, cache, output_attentions, position_embeddings, **kwargs):
        """The block stack, ``layer_loops`` times (each pass its own layers in the cache), with the U-net skips and
        the value embeddings where configured."""
        values = [table(input_ids) for table in self.value_embeds] if self.value_embeds is not None else []
        n = len(self.h)
        for loop in range(self.config.layer_loops):
            skips = []
            for i, block in enumerate(self.h):
                if self.skip_weights is not None and i >= n - n // 2:  # U-net: the mirrored early block's output
                    hidden_states = hidden_states + self.skip_weights[n - 1 - i] * skips[n - 1 - i]
                table = self.value_tables[i]
                hidden_states = block(
                    hidden_states, causal_mask, None if table is None else values[table], cache=cache,
                    cache_index=loop * n + i, output_attentions=output_attentions,
                    position_embeddings=position_embeddings, **kwargs
                )
                if self.skip_weights is not None and i < n // 2:
                    skips.append(hidden_states)
        return hidden_states

    @_past_key_values_is_deprecated
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""
        attention_mask: (B, past + T) with 1 for tokens and 0 for padding, or a prepared 4D mask.
        position_ids: (B|1, T). Default: positions counted over the real tokens of ``attention_mask`` (left padding),
            else ``past .. past + T - 1``; with ``config.document_masking`` and ``input_ids``, counted from each
            document's start instead (``document_position_ids``). Given explicitly without a mask, restarts mark
            packed sequences; with ``document_masking``, restarts mark documents whatever else is given.
        cache / past_key_values: a transformers ``Cache`` (both names accepted; 5.24 renamed the argument).
        output_hidden_states / output_attentions / return_dict: as in every transformers model.
        """
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if self.value_embeds is not None and input_ids is None:
            raise ValueError("value_embeddings look the values up by token: pass input_ids, not inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)  # (B, T, C)
        T = inputs_embeds.shape[1]
        if self.training and torch.is_grad_enabled():
            use_cache = False  # training never reads a cache; checkpointed layers would write it twice
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if not use_cache:
            cache = None
        past = cache.get_seq_length() if cache is not None else 0  # an int, or a tensor for a static cache
        name = "position_ids"
        if position_ids is None and self.config.document_masking and input_ids is not None:
            position_ids, name = self._document_positions(input_ids, attention_mask, past), "the documents' positions"
        self._check_positions(past, T, position_ids, name)

        output_attentions = kwargs.pop("output_attentions", None)
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        causal_mask = self._attention_mask(inputs_embeds, attention_mask, cache, position_ids, output_attentions)
        if position_ids is None:
            if attention_mask is not None and attention_mask.ndim == 2:  # left padding: count real tokens only
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = (torch.arange(T, device=inputs_embeds.device) + past)[None]

        kwargs.pop("output_hidden_states", None)  # recorded by capture_outputs
        position_embeddings = None
        if self.wpe is not None:
            hidden_states = self.drop(inputs_embeds + self.wpe(position_ids))
        else:
            hidden_states = self.drop(inputs_embeds)
            position_embeddings = self.rotary(position_ids)
        hidden_states = self._blocks(hidden_states, causal_mask, input_ids, cache, output_attentions,
                                     position_embeddings, **kwargs)
        hidden_states = self.ln_f(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{_CACHE_FIELD: cache})


class CgptForCausalLM(CgptPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: CgptConfig):
        super().__init__(config)
        self.transformer = CgptModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.zero_init_head:
            self.lm_head.is_zero_init_head = True  # read by _init_weights
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def _loss_and_logits(self, hidden_states, shift_labels, keep, num_items_in_batch, return_logits: bool):
        """(loss or None, logits or None) from the last hidden states (B, T, C); ``keep`` selects the positions
        that get logits."""
        chunk, cap = self.config.loss_chunk_size, self.config.logit_softcap
        if shift_labels is None:
            return None, soft_cap(self.lm_head(hidden_states[:, keep]), cap)  # (B, T', V)
        if chunk > 0:
            loss = chunked_cross_entropy(
                hidden_states.reshape(-1, hidden_states.shape[-1]),
                self.lm_head.weight,
                shift_labels.reshape(-1),
                chunk,
                denominator=num_items_in_batch,
                softcap=cap,
            )
            return loss, soft_cap(self.lm_head(hidden_states[:, keep]), cap) if return_logits else None
        logits = soft_cap(self.lm_head(hidden_states), cap)  # loss_chunk_size = 0: the standard transformers loss
        loss = self.loss_function(
            logits=logits,
            labels=None,
            vocab_size=self.config.vocab_size,
            shift_labels=shift_labels.contiguous(),  # it views them flat; a packer's [:, 1:] slice is strided
            num_items_in_batch=num_items_in_batch,
        )
        return loss, logits[:, keep]

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        """``document_masking``: none here, so that ``prepare_inputs_for_generation`` counts them at every step over
        the whole sequence (generate's own would run on across an EOS). Position ids given to ``generate`` win."""
        if self.config.document_masking:
            return None
        return super()._prepare_position_ids_for_generation(inputs_tensor, model_kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *, attention_mask=None, inputs_embeds=None,
                                      **kwargs):
        """``document_masking`` without given position ids: the positions of the whole sequence so far counted from
        each document's start (the prompt's and the continuation's EOS start new ones), sliced to this step's tokens
        by transformers; a prompt given as ``inputs_embeds`` counts as one document (its EOS cannot be seen)."""
        if self.config.document_masking and kwargs.get("position_ids") is None:
            prompt = inputs_embeds.shape[1] if inputs_embeds is not None else 0  # embeddings before generated ids
            width = attention_mask.shape[-1] if attention_mask is not None else prompt + input_ids.shape[1]
            if inputs_embeds is None and input_ids.shape[1] < width:
                raise ValueError("document_masking: generate() got part of the sequence (prefill_chunk_size?); "
                                 "the positions need all of it: generate without prefill_chunk_size")
            is_eos = F.pad(input_ids == self.config.eos_token_id, (width - input_ids.shape[1], 0), value=False)
            kwargs["position_ids"] = document_position_ids(is_eos, attention_mask)
        return super().prepare_inputs_for_generation(input_ids, attention_mask=attention_mask,
                                                     inputs_embeds=inputs_embeds, **kwargs)

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, cache=None, position_ids=None,
                                  **kwargs):
        """The 4D mask ``generate`` builds ahead for compiled static caches: transformers' own, kept within each
        document under ``document_masking`` (``cgpt_causal_mask``)."""
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)  # transformers < 5.24: that name
        return cgpt_causal_mask(config, inputs_embeds, attention_mask, cache, position_ids,
                                build=create_masks_for_generate, **kwargs)

    @_past_key_values_is_deprecated
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        return_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        labels: (B, T) targets aligned with ``input_ids``; shifted by one inside (HF convention). -100 is ignored.
        shift_labels: (B, T) targets already shifted (position t predicts ``shift_labels[:, t]``), as produced by a
            packer that cuts ``seq_len + 1`` token blocks; give this or ``labels``. A keyword argument (not in the
            signature, as in transformers' models) because Trainer treats every ``*label*`` parameter as required.
        logits_to_keep: if an int > 0, only the last that many positions get logits (generation needs one); a 1D
            tensor keeps those sequence indices.
        return_logits: whether ``logits`` is returned next to a chunked loss. Default (None): in eval mode yes
            (Trainer's prediction_step and metrics read them), in train mode no.

        With ``config.loss_chunk_size > 0`` the loss is computed from the hidden states chunk by chunk in fp32, so the
        full fp32 logits never exist, and in train mode no logits are built at all; logits returned next to that loss
        cost one more head matmul. With ``loss_chunk_size = 0`` the full logits are built, used and returned.
        ``num_items_in_batch`` (Trainer, gradient accumulation) replaces the count of target tokens in the mean.
        """
        shift_labels = kwargs.pop("shift_labels", None)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        outputs: BaseModelOutputWithPast = self.transformer(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,  # even with config.return_dict=False: can_return_tuple makes the tuple at the end
            **kwargs,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        if labels is not None and shift_labels is None:
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        if return_logits is None:
            return_logits = not self.training
        loss, logits = self._loss_and_logits(outputs.last_hidden_state, shift_labels, keep, num_items_in_batch,
                                             return_logits)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD)},
        )


CgptForCausalLM.register_for_auto_class("AutoModelForCausalLM")  # saved folders load with trust_remote_code

__all__ = ["CgptForCausalLM", "CgptModel", "CgptPreTrainedModel", "CgptRotaryTable", "apply_rotary",
           "cgpt_causal_mask", "chunked_cross_entropy", "document_mask_function", "document_position_ids",
           "rotary_cos_sin", "soft_cap", "value_table_of"]
