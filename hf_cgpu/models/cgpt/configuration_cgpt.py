"""Configuration of the hf_cgpu GPT (model_type ``cgpt``).

Kept free of any hf_cgpu import but its sibling ``options_cgpt``: ``save_pretrained`` copies this file and the files
it imports relatively next to the weights, so ``AutoConfig.from_pretrained(dir, trust_remote_code=True)`` works
where hf_cgpu is not installed.
"""

from transformers import PretrainedConfig

from .options_cgpt import check_options


class CgptConfig(PretrainedConfig):
    r"""GPT-2 style decoder: pre-norm blocks, learned positions, tied embeddings, optional biases.

    The modern options below are off by default, so a config without them is a plain GPT-2.

    Args:
        vocab_size: tokens in the vocabulary (the tokenizer's ``len()``).
        n_positions: longest sequence the learned position table covers.
        n_embd: width of the residual stream (must be divisible by ``n_head``).
        n_layer: number of transformer blocks.
        n_head: attention heads per block.
        mlp_ratio: MLP hidden width = ``mlp_ratio * n_embd``.
        dropout: dropout on embeddings, attention and residual branches (0 for pretraining runs this short).
        bias: biases in linear layers and LayerNorms (GPT-2 has them; nanoGPT shows they are not needed).
        layer_norm_epsilon: LayerNorm epsilon.
        initializer_range: std of the normal init; residual projections use ``std / sqrt(2 * n_layer)``.
        loss_chunk_size: tokens per chunk when the loss is computed from hidden states without building all fp32
            logits at once (0 = build full logits). Saves ~``B*T*V*4`` bytes.
        position_embedding: "learned" (GPT-2's position table ``wpe``) or "rotary" (RoPE on queries and keys, no
            table; ``n_positions`` still bounds the sequence length).
        rope_theta: base of the rotary frequencies (position_embedding "rotary").
        qk_norm: RMSNorm of each head's queries and keys (before RoPE), as in OLMo 2 and modded-nanogpt.
        activation: MLP nonlinearity, "gelu" (tanh approximation, GPT-2) or "relu2" (ReLU squared, modded-nanogpt).
        norm: "layernorm" (GPT-2) or "rmsnorm" for the block and final norms (RMSNorm has no bias).
        value_embeddings: k extra token-embedding tables mixed into the attention values (modded-nanogpt): table i
            feeds layers i and ``n_layer - k + i`` as ``v = a * v + b * table[token]`` (learnable a, b per layer).
            0 = off; at most ``n_layer // 2``. Needs ``input_ids`` (not ``inputs_embeds`` alone).
        logit_softcap: c > 0 caps every logit softly, ``c * tanh(logits / c)``, in the loss and in returned logits.
        unet_skips: the outputs of the first ``n_layer // 2`` blocks are added, times learnable weights starting at
            1, to the inputs of their mirrored last blocks (modded-nanogpt).
        zero_init_head: the untied LM head starts at zero (needs ``tie_word_embeddings=False``).
        layer_loops: the block stack runs this many times with shared weights; ``num_hidden_layers`` (what caches and
            the recorded hidden states and attentions count) is the depth as run, ``n_layer * layer_loops``.
        document_masking: the model was trained with attention within each document (documents joined by
            ``eos_token_id``), and is run so wherever no ``position_ids`` are given: positions restart after each EOS
            and a token attends only to its own document, in a forward over a stream, in ``generate`` (a prompt's or
            a continuation's EOS starts a new document) and with padding. Given ``position_ids`` mark the documents
            by restarting: a token at position p attends to itself and the p tokens before it.
    """

    model_type = "cgpt"
    document_masking = False  # a class default: a config.json without the key means off, and off writes no key
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    attribute_map = {
        "hidden_size": "n_embd",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "n_positions",
    }

    @property
    def num_hidden_layers(self) -> int:
        """The depth as run: ``n_layer`` blocks, ``layer_loops`` times (caches keep one layer per block and pass)."""
        return self.n_layer * self.__dict__.get("layer_loops", 1)

    @num_hidden_layers.setter
    def num_hidden_layers(self, value: int) -> None:
        self.n_layer = value // self.__dict__.get("layer_loops", 1)

    def __init__(
        self,
        vocab_size: int = 32000,
        n_positions: int = 1024,
        n_embd: int = 768,
        n_layer: int = 12,
        n_head: int = 12,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        bias: bool = False,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        loss_chunk_size: int = 1024,
        use_cache: bool = True,
        bos_token_id: int = 0,
        eos_token_id: int = 0,
        pad_token_id: int | None = None,
        tie_word_embeddings: bool = True,
        position_embedding: str = "learned",
        rope_theta: float = 10000.0,
        qk_norm: bool = False,
        activation: str = "gelu",
        norm: str = "layernorm",
        value_embeddings: int = 0,
        logit_softcap: float = 0.0,
        unet_skips: bool = False,
        zero_init_head: bool = False,
        layer_loops: int = 1,
        **kwargs,
    ):
        check_options(n_embd, n_head, position_embedding, activation, norm, rope_theta, dropout, n_layer=n_layer,
                      value_embeddings=value_embeddings, logit_softcap=logit_softcap, zero_init_head=zero_init_head,
                      tie_word_embeddings=tie_word_embeddings, unet_skips=unet_skips, layer_loops=layer_loops)
        self.vocab_size = vocab_size
        self.n_positions = n_positions
        self.n_embd = n_embd
        self.n_layer = n_layer
        self.n_head = n_head
        self.mlp_ratio = mlp_ratio
        self.dropout = dropout
        self.bias = bias
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.loss_chunk_size = loss_chunk_size
        self.use_cache = use_cache
        self.position_embedding = position_embedding
        self.rope_theta = float(rope_theta)
        self.qk_norm = qk_norm
        self.activation = activation
        self.norm = norm
        self.value_embeddings = value_embeddings
        self.logit_softcap = float(logit_softcap)
        self.unet_skips = unet_skips
        self.zero_init_head = zero_init_head
        self.layer_loops = layer_loops
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )


CgptConfig.register_for_auto_class()  # save_pretrained writes auto_map and copies the files for trust_remote_code

__all__ = ["CgptConfig"]
