"""Shared fixtures: tiny models saved locally (no downloads)."""

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

TINY_VOCAB = 256


def tiny_neox_config() -> GPTNeoXConfig:
    return GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         vocab_size=TINY_VOCAB, max_position_embeddings=64)


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory):
    """A random tiny GPTNeoX causal LM saved with save_pretrained."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("neox")
    GPTNeoXForCausalLM(tiny_neox_config()).save_pretrained(path)
    return path

# tests/upstream holds vendored mixin sources of transformers / diffusers: imported by our test modules, not collected.
collect_ignore = ["upstream"]
