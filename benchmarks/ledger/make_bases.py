"""The random LoRA bases the ledger check fine-tunes: the Pythia-1.4B shape (the seed's LoRA exercise) and the
SmolLM2-135M shape (the README's example, launch-bound), saved in bf16 with a byte-level BPE tokenizer trained on
the built-in corpus (memory and speed do not depend on the weights' values).

    python benchmarks/ledger/make_bases.py --out /tmp/ledger_bases [--dry_run]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_cgpu.data.corpus import builtin_corpus
from hf_cgpu.data.tokenizer import train_tokenizer

PYTHIA = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, intermediate_size=8192,
              vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True,
              tie_word_embeddings=False)
SMOL = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
            rope_theta=100000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=1024,
            max_position_embeddings=256)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--dry_run", action="store_true")
    a = p.parse_args()
    tok = train_tokenizer(builtin_corpus(), vocab_size=1024 if a.dry_run else 8192, show_progress=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, cls, cfg_cls, shape in (("pythia", GPTNeoXForCausalLM, GPTNeoXConfig, PYTHIA),
                                      ("smol", LlamaForCausalLM, LlamaConfig, SMOL)):
        path = Path(a.out) / name
        if (path / "config.json").is_file():
            continue
        cfg = cfg_cls(**(TINY if a.dry_run else shape), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
        torch.manual_seed(0)
        with torch.device(device):
            model = cls(cfg).to(torch.bfloat16)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        del model
        print(f"{path}: {sum(1 for _ in path.iterdir())} files")


if __name__ == "__main__":
    main()
