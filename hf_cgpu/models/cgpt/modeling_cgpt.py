"""hf_cgpu GPT: a GPT-2 style causal LM as a transformers ``PreTrainedModel`` + ``GenerationMixin``.

Read leaf to root: attention, MLP, block, backbone, LM head. Self-contained on purpose (only a relative import of
its config): ``save_pretrained`` copies both files next to the weights so that
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` works where hf_cgpu is not installed.

Works on transformers 5.17 (forward argument ``past_key_values``) through 5.24+ (renamed ``cache``): both names are
accepted and the returned output uses whichever field name the installed ``CausalLMOutputWithPast`` has.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_cgpt import CgptConfig

try:  # transformers >= 5: init functions that leave weights loaded from a checkpoint untouched
    from transformers import initialization as init
except ImportError:  # pragma: no cover - older transformers
    from torch.nn import init

# transformers 5.24 renamed the output/input field ``past_key_values`` to ``cache``.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
IGNORE_INDEX = -100


def _chunk_ce_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # (n, V): matmul in the operands' dtype, softmax in fp32
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    denominator: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean token cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets`` without holding all logits.

    hidden (N, C), weight (V, C), targets (N,). Each chunk's fp32 logits live only inside a checkpointed call, so
    forward and backward hold one ``chunk_size x V`` block instead of ``N x V`` (1 GB at 124M, micro-batch 8).
    ``denominator`` replaces the count of non-ignored targets (for accumulation over uneven micro-batches).
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start : start + chunk_size], weight, bias, targets[start : start + chunk_size], ignore_index)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_ce_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_ce_sum(*args)
    if denominator is None:
        denominator = (targets != ignore_index).sum().clamp(min=1)
    if torch.is_tensor(denominator):
        denominator = denominator.to(total.device)
    return total / denominator


class CgptAttention(nn.Module):
    def __init__(self, config: CgptConfig, layer_idx: int):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.layer_idx = layer_idx
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj.is_residual_projection = True  # read by _init_weights (a flag: parents are not visited)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: Cache | None, attn_mask: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, nh, past + T, hs)
        # Causal without a mask only when queries and keys start together; otherwise the caller built a mask.
        is_causal = attn_mask is None and T > 1 and k.shape[2] == T
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0, is_causal=is_causal
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y))


class CgptMLP(nn.Module):
    def __init__(self, config: CgptConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd, bias=config.bias)
        self.act = nn.GELU(approximate="tanh")
        self.fc_out = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd, bias=config.bias)
        self.fc_out.is_residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc(x))))


class CgptBlock(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: CgptConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.attn = CgptAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.mlp = CgptMLP(config)

    def forward(self, hidden_states: torch.Tensor, attn_mask=None, cache: Cache | None = None) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), cache, attn_mask)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class CgptPreTrainedModel(PreTrainedModel):
    config_class = CgptConfig
    config: CgptConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["CgptBlock"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if getattr(module, "is_residual_projection", False):
            # GPT-2 scheme: the two residual projections of each block start at std / sqrt(2 * n_layer).
            std = std / math.sqrt(2 * self.config.n_layer)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)


def _attention_mask(
    attention_mask: torch.Tensor | None, past: int, T: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean (B|1, 1, T, past + T) mask, or None when plain causal SDPA (or no mask at all) is exact."""
    if attention_mask is None and (past == 0 or T == 1):
        return None
    q_pos = torch.arange(past, past + T, device=device)[:, None]
    k_pos = torch.arange(past + T, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]  # (1, 1, T, past + T)
    if attention_mask is not None:
        keys = attention_mask[:, None, None, : past + T].bool()  # (B, 1, 1, past + T)
        # A padded query would see no key at all (NaN softmax); let every query see itself.
        mask = (mask & keys) | (k_pos == q_pos)[None, None]
    return mask


class CgptModel(CgptPreTrainedModel):
    def __init__(self, config: CgptConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([CgptBlock(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)  # (B, T, C)
        B, T, _ = inputs_embeds.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.training and torch.is_grad_enabled():
            use_cache = False  # training never reads a cache; checkpointed layers would write it twice
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if not use_cache:
            cache = None
        past = cache.get_seq_length() if cache is not None else 0
        if past + T > self.config.n_positions:
            raise ValueError(
                f"sequence of {past + T} tokens is longer than n_positions={self.config.n_positions}; "
                "shorten the input (seq_len / max_new_tokens) or train a model with larger n_positions"
            )
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: keep the fast causal path
        if position_ids is None:
            if attention_mask is not None:  # left padding: count real tokens only
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past : past + T]
            else:
                position_ids = torch.arange(past, past + T, device=inputs_embeds.device)[None]
        mask = _attention_mask(attention_mask, past, T, inputs_embeds.device)
        x = self.drop(inputs_embeds + self.wpe(position_ids))
        for block in self.h:
            x = block(x, mask, cache=cache)
        x = self.ln_f(x)
        return BaseModelOutputWithPast(last_hidden_state=x, **{_CACHE_FIELD: cache})


class CgptForCausalLM(CgptPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: CgptConfig):
        super().__init__(config)
        self.transformer = CgptModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        r"""
        labels: (B, T) targets aligned with ``input_ids``; shifted by one inside (HF convention). -100 is ignored.
        shift_labels: (B, T) targets already shifted (position t predicts ``shift_labels[:, t]``), as produced by a
            packer that cuts ``seq_len + 1`` token blocks. Give one of the two.
        logits_to_keep: if > 0, only the last that many positions get logits (generation needs one).

        With a loss requested and ``config.loss_chunk_size > 0`` the logits are not materialised and ``logits`` is
        None: the loss comes from the hidden states chunk by chunk, in fp32.
        """
        out = self.transformer(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state  # (B, T, C)
        if labels is not None and shift_labels is None:
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        loss, logits = None, None
        chunk = self.config.loss_chunk_size
        if shift_labels is not None and chunk > 0:
            loss = chunked_cross_entropy(
                hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, shift_labels.reshape(-1), chunk
            )
        else:
            keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
            logits = self.lm_head(hidden[:, keep])  # (B, T', V)
            if shift_labels is not None:
                loss = F.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=IGNORE_INDEX
                )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)})


__all__ = ["CgptForCausalLM", "CgptModel", "CgptPreTrainedModel", "chunked_cross_entropy"]
