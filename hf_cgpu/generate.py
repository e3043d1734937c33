"""Text generation from a saved hf_cgpu GPT (or any causal LM directory) through ``model.generate``."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SettingsError


def continue_texts(
    model, tokenizer, prompts: list[str], max_new_tokens: int = 60, temperature: float = 0.8, top_k: int = 50,
    top_p: float = 0.95, seed: int = 0, do_sample: bool = True, log=None,
) -> list[str]:
    """Continue each prompt (one at a time: no padding needed) and return prompt + continuation.

    A continuation ends at the model's context (``n_positions``); ``log`` (default: stderr) says when that cuts
    ``max_new_tokens`` short."""
    if log is None:
        def log(msg: str) -> None:
            print(msg, file=sys.stderr)

    model.eval()
    device = next(model.parameters()).device
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    texts = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        if ids.shape[1] == 0:  # an empty prompt starts from the document separator
            ids = torch.tensor([[tokenizer.eos_token_id]], device=device)
        new = max_new_tokens if limit is None else max(0, min(max_new_tokens, limit - ids.shape[1]))
        if new < max_new_tokens:
            log(f"note: prompt {i + 1} has {ids.shape[1]} tokens and the model's context is {limit}: "
                f"--max_new_tokens {max_new_tokens} is cut to {new} (at most {limit} tokens in all)")
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


@dataclass(frozen=True)
class GenerateSettings:
    """How ``hf-cgpu generate`` decodes."""

    max_new_tokens: int = 80
    """Tokens to generate after each prompt (never beyond the model's context; a note says when it is cut)."""
    temperature: float = 0.8
    """Sampling temperature (lower = more conservative); ignored with --greedy."""
    top_k: int = 50
    """Sample among the k most likely tokens (0 = no limit)."""
    top_p: float = 0.95
    """Nucleus sampling: the smallest set of tokens whose probability reaches p."""
    greedy: bool = False
    """Greedy decoding (always the most likely token) instead of sampling."""
    seed: int = 0
    """Seed of the sampling (prompt i uses seed + i)."""
    trust_remote_code: bool = False
    """Allow the model's own code from its folder or repo (not needed for hf_cgpu's GPT)."""


def main(argv: list[str] | None = None) -> int:
    from .settings import build_parser

    parser = build_parser((GenerateSettings,), description="Continue text with a saved model: a run's output_dir "
                          "(or its best/ or merged/ folder), any causal LM folder or a Hub id.", prog="hf-cgpu generate")
    parser.add_argument("model_dir", help="a trained run's output_dir, its best/ or merged/ folder, or a Hub id")
    parser.add_argument("prompt", nargs="+", help="one or more prompts, each continued separately")
    parser.usage = "%(prog)s MODEL_DIR PROMPT [PROMPT ...] [--SETTING VALUE ...]"
    ns = vars(parser.parse_args(argv))
    model_dir, prompts = ns.pop("model_dir"), ns.pop("prompt")
    s = GenerateSettings(**{k: v for k, v in ns.items() if v is not None})
    if s.max_new_tokens < 1:
        raise SettingsError(f"--max_new_tokens must be >= 1 (got {s.max_new_tokens})")
    tok, model = load_causal_lm(model_dir, s.trust_remote_code)
    if torch.cuda.is_available():
        model = model.to("cuda", dtype=torch.bfloat16)
    for text in continue_texts(model, tok, prompts, s.max_new_tokens, s.temperature, s.top_k, s.top_p, s.seed,
                               do_sample=not s.greedy):
        print(text)
        print("-" * 40)
    return 0


def load_causal_lm(model_dir: str, trust_remote_code: bool = False, dtype: torch.dtype | None = None):
    """(tokenizer, model) of a causal LM folder, a LoRA/QLoRA run's adapter folder (its base + the adapter, through
    peft) or a Hub id; what is not one ends in a one-line ``UserError``."""
    from .errors import MissingPathError, UserError, require_model
    from .finetune import TOKENIZER_FILES

    require_model(model_dir)
    path = Path(model_dir).expanduser()
    base = None
    if path.is_dir():
        if (path / "model_index.json").is_file():
            raise SettingsError(f"{model_dir} is a FlowMatchPipeline (model_index.json), not a language model; "
                                f"use `hf-cgpu sample {model_dir}`")
        if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
            base = adapter_base(path)
        elif not (path / "config.json").is_file():
            raise MissingPathError(f"{model_dir} holds no config.json; pass a trained run's output_dir (or its "
                                   "best/ or merged/ folder)")
        if base is None and not any((path / n).is_file() for n in TOKENIZER_FILES):
            raise MissingPathError(f"{model_dir} has no tokenizer files; save the tokenizer beside the weights "
                                   "(tokenizer.save_pretrained(dir))")
    else:
        from .hub import check_hub_model

        check_hub_model(model_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_cgpu.models.cgpt  # noqa: F401  (registers the cgpt model type)

    try:
        if base is None:
            tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
        else:
            from .finetune import load_adapter

            own = any((path / n).is_file() for n in TOKENIZER_FILES)  # the run saves the tokenizer it trained with
            tok = AutoTokenizer.from_pretrained(str(path) if own else base, trust_remote_code=trust_remote_code)
            model = load_adapter(
                AutoModelForCausalLM.from_pretrained(base, dtype=dtype, trust_remote_code=trust_remote_code), path)
    except (OSError, ValueError) as e:  # a Hub id that does not resolve, offline, a gated repo, a foreign config
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UserError(f"cannot load {model_dir!r} as a causal LM ({first[:160]}); pass a trained run's output_dir "
                        "or a causal LM Hub id (network needed)") from e
    from .data.text import check_vocab

    check_vocab(tok, model.config.vocab_size)
    return tok, model


def adapter_base(path: Path) -> str:
    """The base model of an adapter folder: ``adapter_config.json``'s ``base_model_name_or_path``, checked to exist
    (a local folder) or to answer (a Hub id). A GGUF base whose de-quantised copy was deleted from the cache is
    de-quantised again from the GGUF file the run recorded (``base_model.json``). The adapter is applied to the
    unquantised base, also for a QLoRA run (trained against its 4-bit copy), as ``PeftModel.from_pretrained`` does."""
    import json

    from .errors import MissingPathError

    try:
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SettingsError(f"{path / 'adapter_config.json'} is not valid JSON: re-save the adapter") from None
    recorded = path / "base_model.json"
    if base and not Path(base).exists() and recorded.is_file():
        gguf = json.loads(recorded.read_text()).get("gguf_file") or ""
        if gguf and Path(gguf).is_file():
            from .finetune import resolve_base

            base, _ = resolve_base(gguf)
    if not base:
        raise SettingsError(f"{path / 'adapter_config.json'} names no base model (base_model_name_or_path): set it "
                            "to the base's folder or Hub id")
    if not Path(base).expanduser().exists():
        if base.startswith(("/", ".", "~")):
            raise MissingPathError(f"the adapter's base model {base} is gone: restore it or set "
                                   f"base_model_name_or_path in {path / 'adapter_config.json'}")
        from .hub import check_hub_model

        check_hub_model(base, "base model")
    return base
