"""Text generation from a saved hf_cgpu GPT (or any causal LM directory) through ``model.generate``."""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch


def continue_texts(
    model, tokenizer, prompts: list[str], max_new_tokens: int = 60, temperature: float = 0.8, top_k: int = 50,
    top_p: float = 0.95, seed: int = 0, do_sample: bool = True,
) -> list[str]:
    """Continue each prompt (one at a time: no padding needed) and return prompt + continuation."""
    model.eval()
    device = next(model.parameters()).device
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    texts = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        if ids.shape[1] == 0:  # an empty prompt starts from the document separator
            ids = torch.tensor([[tokenizer.eos_token_id]], device=device)
        new = max_new_tokens if limit is None else max(0, min(max_new_tokens, limit - ids.shape[1]))
        torch.manual_seed(seed + i)
        # compiled blocks would recompile for every cache length: decode eagerly
        stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else nullcontext()
        with torch.no_grad(), stance:
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=do_sample,
                temperature=temperature, top_k=top_k, top_p=top_p, pad_token_id=tokenizer.eos_token_id,
            )
        texts.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return texts


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_cgpu  # noqa: F401  (registers the cgpt model type)

    p = argparse.ArgumentParser(prog="hf-cgpu generate", description="continue text with a saved model")
    p.add_argument("model_dir")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--max_new_tokens", type=int, default=80)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=50)
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from .errors import require_model

    require_model(a.model_dir)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir)
    from .data.text import check_vocab

    check_vocab(tok, model.config.vocab_size)
    if torch.cuda.is_available():
        model = model.to("cuda", dtype=torch.bfloat16)
    for text in continue_texts(model, tok, a.prompt, a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed,
                               do_sample=not a.greedy):
        print(text)
        print("-" * 40)
    return 0
