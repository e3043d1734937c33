"""Text generation from a saved hf_cgpu GPT (or any causal LM directory) through ``model.generate``."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .data.tokenizer import check_vocab
from .errors import MissingPathError, SettingsError, UserError, about, require_model
from .finetune import BASE_RECORD, TOKENIZER_FILES, check_base_digest, load_adapter, resolve_base
from .gguf import gguf_location
from .hub.checks import check_hub_model
from .models import cgpt
from .options import VERIFY_MODES, check_choice
from .settings import build_parser
from .verify import check_saved


def continue_texts(
    model, tokenizer, prompts: list[str], max_new_tokens: int = 60, temperature: float = 0.8, top_k: int = 50,
    top_p: float = 0.95, seed: int = 0, do_sample: bool = True, log=None, chat: bool = False,
) -> list[str]:
    """Continue each prompt (one at a time: no padding needed) and return prompt + continuation.

    With ``chat`` each prompt is a user turn in the tokenizer's chat template (generation prompt added) and the
    text returned is the prompt, a newline and the model's answer. A continuation ends at the model's context
    (``n_positions``); ``log`` (default: stderr) says when that cuts ``max_new_tokens`` short, and when the model
    ends at once (its end-of-text token first)."""
    if log is None:
        def log(msg: str) -> None:
            print(msg, file=sys.stderr)

    model.eval()
    device = next(model.parameters()).device
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    texts = []
    for i, prompt in enumerate(prompts):
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt")
            ids = (ids["input_ids"] if hasattr(ids, "keys") else ids).to(device)
        else:
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
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p) if do_sample else {}
        with torch.no_grad(), stance:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=do_sample,
                                 pad_token_id=tokenizer.eos_token_id, **sampling)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        if new and not answer.strip():
            hint = "" if chat or not getattr(tokenizer, "chat_template", None) else (
                ": an instruction model answers inside its chat template (--chat true)")
            log(f"note: prompt {i + 1}: the model ended at once (its end token came first){hint}")
        texts.append(prompt + "\n" + answer if chat else tokenizer.decode(out[0], skip_special_tokens=True))
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
    gguf_file: str = ""
    """GGUF file inside MODEL_DIR (a folder or Hub id); a .gguf path as MODEL_DIR needs none. De-quantised once into
    the cache (needs the gguf package), as train lora does."""
    chat: str = "auto"
    """auto: a tokenizer with a chat template (an instruction model, a chat fine-tune) gets each prompt as a user
    turn and prints the answer; true: require the template; false: continue the raw text."""
    verify: str = field(default="auto", metadata={"choices": lambda: VERIFY_MODES})
    """What of MODEL_DIR's manifest.json (and an adapter's record of its base) is checked before it is read: auto
    (the sizes; the SHA-256 too up to 512 MiB; an adapter's base always), sizes, full, or off (a folder edited by
    hand); see docs/outputs.md."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SettingsError(f"--max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if self.temperature <= 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise SettingsError(f"--temperature must be > 0, --top_k >= 0 and --top_p in (0, 1] (got "
                                f"{self.temperature}, {self.top_k}, {self.top_p}); --greedy decodes without sampling")
        if self.chat not in ("auto", "true", "false"):
            raise SettingsError(f"--chat {self.chat!r}: choose auto, true or false")
        check_choice("verify", self.verify, VERIFY_MODES)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser((GenerateSettings,), description=about(
        "Continue text, or answer in the model's chat template, with a saved model: a run's output_dir (or its best/ "
        "or merged/ folder), any causal LM folder, a .gguf file or a Hub id.",
        'hf-cgpu generate runs/tiny "The meaning of" --max_new_tokens 40'), prog="hf-cgpu generate")
    parser.add_argument("model_dir", help="a trained run's output_dir, its best/ or merged/ folder, a causal LM "
                        "folder, a .gguf file or a Hub id")
    parser.add_argument("prompt", nargs="+", help="one or more prompts, each continued separately")
    parser.usage = "%(prog)s MODEL_DIR PROMPT [PROMPT ...] [--SETTING VALUE ...]"
    ns = vars(parser.parse_args(argv))
    model_dir, prompts = ns.pop("model_dir"), ns.pop("prompt")
    s = GenerateSettings(**{k: v for k, v in ns.items() if v is not None})
    tok, model = load_causal_lm(model_dir, s.trust_remote_code, gguf_file=s.gguf_file, verify=s.verify)
    templated = bool(getattr(tok, "chat_template", None))
    if s.chat == "true" and not templated:
        raise SettingsError(f"--chat true: the tokenizer of {model_dir} has no chat template; use --chat false")
    chat = s.chat == "true" or (s.chat == "auto" and templated)
    if chat and s.chat == "auto":
        print("note: prompts go in the tokenizer's chat template as user turns (--chat false continues the raw text)",
              file=sys.stderr)
    if torch.cuda.is_available():
        model = model.to("cuda", dtype=torch.bfloat16)
    for text in continue_texts(model, tok, prompts, s.max_new_tokens, s.temperature, s.top_k, s.top_p, s.seed,
                               do_sample=not s.greedy, chat=chat):
        print(text)
        print("-" * 40)
    return 0


def load_causal_lm(model_dir: str, trust_remote_code: bool = False, dtype: torch.dtype | None = None,
                   gguf_file: str = "", verify: str = "auto"):
    """(tokenizer, model) of a causal LM folder, a LoRA/QLoRA run's adapter folder (its base + the adapter, through
    peft), a GGUF checkpoint (a .gguf file, or a folder/Hub id with ``gguf_file``: its de-quantised copy, as
    ``finetune.resolve_base`` makes for fine-tuning) or a Hub id; what is not one ends in a one-line ``UserError``.
    A folder hf_cgpu wrote passes its manifest first, an adapter's base its record (``verify``)."""
    require_model(model_dir)
    check_saved(model_dir, verify)
    if gguf_location(model_dir, gguf_file) is not None:
        if not Path(model_dir).expanduser().exists():
            check_hub_model(model_dir, filename=gguf_file)
        model_dir, _ = resolve_base(model_dir, gguf_file)
    path = Path(model_dir).expanduser()
    base = None
    own_tokenizer = path.is_dir() and any((path / n).is_file() for n in TOKENIZER_FILES)
    if path.is_dir():
        if (path / "model_index.json").is_file():
            raise SettingsError(f"{model_dir} is a FlowMatchPipeline (model_index.json), not a language model; "
                                f"use `hf-cgpu sample {model_dir}`")
        if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
            base = adapter_base(path, verify)
        elif not (path / "config.json").is_file():
            raise MissingPathError(f"{model_dir} holds no config.json; pass a trained run's output_dir (or its "
                                   "best/ or merged/ folder)")
        if base is None and not own_tokenizer:
            raise MissingPathError(f"{model_dir} has no tokenizer files; save the tokenizer beside the weights "
                                   "(tokenizer.save_pretrained(dir))")
    else:
        check_hub_model(model_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    cgpt.register()  # the cgpt model type in the Auto classes, whatever was imported first

    try:
        if base is None:
            tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
        else:
            # the run saves the tokenizer it trained with beside the adapter; else the base's
            tok = AutoTokenizer.from_pretrained(str(path) if own_tokenizer else base,
                                                trust_remote_code=trust_remote_code)
            model = load_adapter(
                AutoModelForCausalLM.from_pretrained(base, dtype=dtype, trust_remote_code=trust_remote_code), path)
            if (path / "generation_config.json").is_file():  # the run's: its end-of-turn token stops generation
                model.generation_config = GenerationConfig.from_pretrained(path)
    except (OSError, ValueError) as e:  # a Hub id that does not resolve, offline, a gated repo, a foreign config
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UserError(f"cannot load {model_dir!r} as a causal LM ({first[:160]}); pass a trained run's output_dir "
                        "or a causal LM Hub id (network needed)") from e

    check_vocab(tok, model.config.vocab_size)
    return tok, model


def adapter_base(path: Path, verify: str = "auto") -> str:
    """The base model of an adapter folder: ``adapter_config.json``'s ``base_model_name_or_path``, checked to exist
    (a local folder) or to answer (a Hub id). A GGUF base whose de-quantised copy was deleted from the cache is
    de-quantised again from the GGUF file the run recorded (``base_model.json``). The adapter is applied to the
    unquantised base, also for a QLoRA run (trained against its 4-bit copy), as ``PeftModel.from_pretrained`` does.
    A local base must be the one the adapter was trained on (``finetune.check_base_digest``, by ``verify``: under
    auto its files are hashed whatever their size, since same-shaped weights written over it keep every size) and
    pass its own manifest where it is a folder hf_cgpu wrote."""
    import json

    try:
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SettingsError(f"{path / 'adapter_config.json'} is not valid JSON: re-save the adapter") from None
    recorded = path / BASE_RECORD
    if base and not Path(base).exists() and recorded.is_file():
        gguf = json.loads(recorded.read_text()).get("gguf_file") or ""
        if gguf and Path(gguf).is_file():
            base, _ = resolve_base(gguf)
    if not base:
        raise SettingsError(f"{path / 'adapter_config.json'} names no base model (base_model_name_or_path): set it "
                            "to the base's folder or Hub id")
    if not Path(base).expanduser().exists():
        if base.startswith(("/", ".", "~")):
            raise MissingPathError(f"the adapter's base model {base} is gone: restore it or set "
                                   f"base_model_name_or_path in {path / 'adapter_config.json'}")
        check_hub_model(base, "base model")
    check_saved(base, verify, "the adapter's base")
    check_base_digest(path, base, verify)
    return base
