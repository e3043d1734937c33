"""The GPT's architecture options in one place free of torch and transformers: their choices, their defaults (plain
GPT-2), their docs and their checks.

``CgptConfig`` validates with ``check_options`` (this file is saved beside the weights with the config, so a folder
loads with ``trust_remote_code`` where hf_cgpu is not installed), and the training settings (``GPTSettings``) are a
``CgptOptions``: the flags, their ``--help`` and the config the run builds come from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

POSITION_EMBEDDINGS = ("learned", "rotary")
ACTIVATIONS = ("gelu", "relu2")
NORMS = ("layernorm", "rmsnorm")


def check_options(n_embd: int, n_head: int, position_embedding: str = "learned", activation: str = "gelu",
                  norm: str = "layernorm", rope_theta: float = 10000.0, dropout: float = 0.0, n_layer: int = 12,
                  value_embeddings: int = 0, logit_softcap: float = 0.0, zero_init_head: bool = False,
                  tie_word_embeddings: bool = True, unet_skips: bool = False, layer_loops: int = 1,
                  **_: object) -> None:
    """Raise ``ValueError`` (one line naming the fix) for options the model cannot be built with."""
    if n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}; use n_head in "
                         f"{[h for h in range(1, 33) if n_embd % h == 0]}")
    for name, value, allowed in (("position_embedding", position_embedding, POSITION_EMBEDDINGS),
                                 ("activation", activation, ACTIVATIONS), ("norm", norm, NORMS)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r}; choose one of {', '.join(allowed)}")
    if position_embedding == "rotary" and (n_embd // n_head) % 2:
        raise ValueError(f"rotary positions need an even head size (n_embd / n_head = {n_embd // n_head}); change "
                         "n_head or use --position_embedding learned")
    if rope_theta <= 0:
        raise ValueError(f"rope_theta={rope_theta} must be > 0, e.g. 10000")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout} must be in [0, 1); e.g. 0.1 for many epochs of a small corpus")
    if not 0 <= value_embeddings <= n_layer // 2:
        raise ValueError(f"value_embeddings={value_embeddings} must be in [0, n_layer // 2 = {n_layer // 2}] (each "
                         "table feeds one early and one late layer); lower it or add layers")
    if unet_skips and n_layer < 2:
        raise ValueError(f"unet_skips joins the first n_layer // 2 blocks to the last; n_layer={n_layer} has none: "
                         "use n_layer >= 2 or --unet_skips false")
    if layer_loops < 1:
        raise ValueError(f"layer_loops={layer_loops} must be >= 1 (1 = each block once)")
    if logit_softcap < 0:
        raise ValueError(f"logit_softcap={logit_softcap} must be >= 0 (0 = off); e.g. 15 or 30")
    if zero_init_head and tie_word_embeddings:
        raise ValueError("zero_init_head starts the untied LM head at zero, and the head is tied to the token "
                         "embedding; add --tie_word_embeddings false")


@dataclass(frozen=True)
class CgptOptions:
    """The GPT's shape and architecture options (the defaults are GPT-2's, 124M at vocab 50k)."""

    n_layer: int = 12
    """Transformer blocks."""
    n_embd: int = 768
    """Residual width; must be divisible by n_head."""
    n_head: int = 12
    """Attention heads."""
    mlp_ratio: int = 4
    """MLP width = mlp_ratio * n_embd."""
    dropout: float = 0.0
    """Dropout on embeddings, attention and residual branches (0 for single-epoch pretraining)."""
    bias: bool = False
    """Biases in linears and LayerNorms."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of the fp32 loss (0 = materialise all logits)."""
    position_embedding: str = "learned"
    """learned (GPT-2's position table) or rotary (RoPE on queries and keys, no table)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (position_embedding rotary)."""
    qk_norm: bool = False
    """RMSNorm of each head's queries and keys before attention (OLMo 2, modded-nanogpt)."""
    activation: str = "gelu"
    """MLP nonlinearity: gelu (GPT-2) or relu2 (ReLU squared, modded-nanogpt)."""
    norm: str = "layernorm"
    """Block and final norms: layernorm (GPT-2) or rmsnorm (no bias)."""
    tie_word_embeddings: bool = True
    """The LM head shares the token embedding (GPT-2); false gives the head its own matrix."""
    value_embeddings: int = 0
    """Extra token-embedding tables mixed into the attention values (modded-nanogpt): table i feeds layer i and layer
    n_layer - k + i, each as v = a*v + b*table[token] with learnable a, b per layer (starting at 0.5, 0.5; the tables
    start at the values' own spread). 0 = off; at most n_layer // 2."""
    logit_softcap: float = 0.0
    """Soft cap c of the logits, c * tanh(logits / c), in the loss and in every logits returned (generation, eval);
    0 = off. modded-nanogpt uses 15 to 30."""
    unet_skips: bool = False
    """U-net skips (modded-nanogpt): the output of each of the first n_layer // 2 blocks is added, times a learnable
    weight, to the input of its mirror among the last blocks. The weights start at 1 (modded-nanogpt's choice): the
    late blocks read the early features at full strength from the first step, where a zero start would leave the
    skips to grow one small AdamW step at a time."""
    zero_init_head: bool = False
    """Start the untied LM head at zero (modded-nanogpt): the first loss is exactly ln(vocab) and the head learns from
    the features rather than from noise. Needs --tie_word_embeddings false."""
    layer_loops: int = 1
    """Run the whole block stack this many times with the same weights (weight-shared depth, the NanoGPT Slowrun's
    layer looping), value embeddings and U-net skips within each pass: compute and activations grow with it, the
    parameters do not. 1 = each block once."""

    def __post_init__(self) -> None:
        check_options(**self.options())

    def options(self) -> dict[str, object]:
        """These fields by name: the ``CgptConfig`` arguments they are."""
        return {f.name: getattr(self, f.name) for f in fields(CgptOptions)}


__all__ = ["ACTIVATIONS", "NORMS", "POSITION_EMBEDDINGS", "CgptOptions", "check_options"]
