"""Chat template and end-of-turn checks before instruction fine-tuning, so that generation after training stops.

A base with no chat template gets one, said in one line and saved with the tokenizer: ChatML where the vocabulary
has its tokens (SmolLM2, Qwen bases), else ``### Instruction / ### Response`` with answers closed by the EOS (adding
ChatML's tokens would need new embedding rows, which LoRA does not train). The token that closes an assistant turn is found by rendering one;
a template that closes it with no special token gets the EOS appended to every response, said in one line. The ids
that end a turn are saved in the run's generation_config.json, which ``generate`` stops at.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .instruct import render

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML, the layout SmolLM2-Instruct and Qwen use."""

_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]


INSTRUCTION = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ message['content'] }}EOS"
               "{% elif message['role'] == 'system' %}{{ message['content'] }}\n\n"
               "{% else %}### Instruction:\n{{ message['content'] }}\n\n### Response:\n{% endif %}{% endfor %}")
"""The ``### Instruction / ### Response`` layout (``instruct.PROMPT_TEMPLATE``) as a chat template, each answer closed
by the EOS (put in for ``EOS``): for a vocabulary without ChatML's tokens, where ChatML's markers would be spelled
out in many tokens per turn."""


def ensure_chat_template(tokenizer, name: str, log: Callable[[str], None]) -> None:
    """Give ``tokenizer`` a chat template when it has none: ChatML where its vocabulary has ChatML's tokens, else
    ``INSTRUCTION``; one line says which."""
    if getattr(tokenizer, "chat_template", None):
        return
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        tokenizer.chat_template = CHATML
        log(f"{name} has no chat template: using ChatML (<|im_start|>role ... <|im_end|>), saved with the tokenizer")
        return
    tokenizer.chat_template = INSTRUCTION.replace("EOS", tokenizer.eos_token)
    log(f"{name} has no chat template nor ChatML tokens: using ### Instruction / ### Response with each answer "
        f"closed by its EOS {tokenizer.eos_token}, saved with the tokenizer")


def end_of_turn(tokenizer) -> int | None:
    """The special token the chat template closes an assistant turn with (the first after its content), or None."""
    full, spans = render(tokenizer, _PROBE)
    start, end = spans[-1]
    turn = full[start:end]
    after = turn[turn.rindex(_PROBE[-1]["content"]) + len(_PROBE[-1]["content"]):]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return next((i for i in tokenizer(after, add_special_tokens=False).input_ids if i in special), None)


def prepare_chat(tokenizer, name: str, log: Callable[[str], None]) -> tuple[int, bool]:
    """(the id that ends an assistant turn, whether the EOS must be appended to each response) of ``tokenizer``,
    after ``ensure_chat_template``."""
    ensure_chat_template(tokenizer, name, log)
    found = end_of_turn(tokenizer)
    if found is not None:
        return found, False
    log(f"the chat template of {name} closes an assistant turn with no special token: its EOS "
        f"{tokenizer.eos_token} is appended to every response, so that generation learns to stop")
    return tokenizer.eos_token_id, True


def save_generation_config(folder: str | Path, base: str, stop_ids: list[int], pad_id: int | None) -> None:
    """The base's generation config (a default one where it has none) with ``stop_ids`` added to its EOS ids."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(base)
    except OSError:
        config = GenerationConfig()
    eos = config.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    ids += [i for i in stop_ids if i is not None and i not in ids]
    config.eos_token_id = ids[0] if len(ids) == 1 else ids
    if config.pad_token_id is None:
        config.pad_token_id = pad_id
    config.save_pretrained(str(folder))
