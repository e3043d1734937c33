"""Instruction data for fine-tuning: rows -> chat messages -> token rows whose loss covers the responses only.

Accepted rows: chat ``messages`` (a list of ``{"role", "content"}``), Alpaca-style ``instruction``/``input``/
``output``, or ``prompt``/``response``. With a chat template (the base tokenizer's), each row is rendered by it and
the targets are the characters of every assistant turn, its end-of-turn marker included (found by rendering the
conversation up to and after each assistant turn), mapped to tokens through the tokenizer's offsets. Without one,
``### Instruction / ### Response`` prompts are used and the response plus EOS is the target. Each example becomes
one fixed-length row (``seq_len + 1`` tokens, padded, longer ones cut and counted): the loss never reads a
prompt token, padding, or another example's text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch

from ..errors import DataError
from ..registry import Registry
from .corpus import load_splits

IGNORE = -100


def _messages(row: dict[str, Any]) -> list[dict[str, str]]:
    msgs = row["messages"]
    if not msgs or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in msgs):
        raise DataError(f"a 'messages' row must be a non-empty list of {{role, content}} dicts, got {msgs!r:.80}")
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in msgs]


def _instruction(row: dict[str, Any]) -> list[dict[str, str]]:
    extra = str(row.get("input") or "").strip()
    user = str(row["instruction"]).strip() + (f"\n\n{extra}" if extra else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": str(row["output"]).strip()}]


def _prompt(row: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": str(row["prompt"]).strip()},
            {"role": "assistant", "content": str(row["response"]).strip()}]


@dataclass(frozen=True)
class InstructionFormat:
    """One layout of instruction rows: the columns that identify it and how a row becomes a chat."""

    name: str
    """What ``--data_format`` detection calls it (recorded as the run's format)."""
    columns: frozenset[str]
    """A dataset whose columns include these holds this format."""
    to_messages: Callable[[dict[str, Any]], list[dict[str, str]]]
    """A row as ``[{"role", "content"}, ...]`` (user turns and the assistant's answers)."""


INSTRUCTION_FORMATS: Registry[InstructionFormat] = Registry("instruction format", DataError)
"""Every instruction layout, by name, in the order ``detect_format`` tries them."""
for _fmt in (InstructionFormat("messages", frozenset({"messages"}), _messages),
             InstructionFormat("instruction", frozenset({"instruction", "output"}), _instruction),
             InstructionFormat("prompt", frozenset({"prompt", "response"}), _prompt)):
    INSTRUCTION_FORMATS.add(_fmt.name, _fmt)


def detect_format(columns: list[str]) -> str | None:
    """The first registered format whose columns the dataset has; None = plain text."""
    cols = set(columns)
    return next((f.name for f in INSTRUCTION_FORMATS.values() if f.columns <= cols), None)


def to_messages(row: dict[str, Any], fmt: str) -> list[dict[str, str]]:
    """One row as a chat: a user turn (instruction + input, or prompt) and the assistant's answer."""
    return INSTRUCTION_FORMATS[fmt].to_messages(row)


PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
"""How a user turn is written for a base without a chat template."""
PROMPT_WITH_INPUT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


def render(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans the loss covers (the assistant turns)."""
    if getattr(tokenizer, "chat_template", None):
        def text(msgs, gen):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        full, spans = text(messages, False), []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, upto = text(messages[:i], True) if i else "", text(messages[: i + 1], False)
            if not (full.startswith(upto) and upto.startswith(before)):
                raise DataError("the chat template does not render a conversation as a prefix of its continuation; "
                                 "pass plain text (--text_column) or a tokenizer with another template")
            spans.append((len(before), len(upto)))
        return full, spans
    prompt = "".join(PROMPT_TEMPLATE.format(instruction=m["content"]) for m in messages if m["role"] != "assistant")
    answer = "\n\n".join(m["content"] for m in messages if m["role"] == "assistant")
    eos = tokenizer.eos_token or ""
    return prompt + answer + eos, [(len(prompt), len(prompt) + len(answer) + len(eos))]


def encode(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[bool], int]:
    """Token ids, a target flag per token (its characters start inside an assistant span), and the characters of
    the answers (their content; end-of-turn markers are scored but not counted as characters)."""
    full, spans = render(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    flags = [any(a <= start < b for a, b in spans) and end > start for start, end in enc["offset_mapping"]]
    return enc["input_ids"], flags, sum(len(m["content"]) for m in messages if m["role"] == "assistant")


@dataclass
class InstructionRows:
    """Fixed-length examples: ``ids`` (N, seq_len + 1) and ``targets`` (same shape, IGNORE off the responses)."""

    ids: torch.Tensor
    targets: torch.Tensor
    n_chars: int  # characters of the responses (bits per character of what the loss scores)
    n_truncated: int
    seq_len: int

    def __len__(self) -> int:
        return self.ids.shape[0]


def build_rows(ds: datasets.Dataset, tokenizer, seq_len: int, fmt: str) -> InstructionRows:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = seq_len + 1
    ids = np.full((len(ds), width), pad, dtype=np.int64)
    targets = np.full((len(ds), width), IGNORE, dtype=np.int64)
    chars, truncated = 0.0, 0
    for i, row in enumerate(ds):
        tok, flags, n_chars = encode(tokenizer, to_messages(row, fmt))
        n_targets = max(1, sum(flags))
        if len(tok) > width:  # cut: the characters scored are taken in proportion to the target tokens kept
            truncated += 1
            tok, flags = tok[:width], flags[:width]
        ids[i, : len(tok)] = tok
        kept = np.asarray(flags, dtype=bool)
        targets[i, : len(tok)][kept] = np.asarray(tok)[kept]
        chars += n_chars * sum(flags[1:]) / n_targets  # position 0 is never predicted
    if not (targets[:, 1:] != IGNORE).any():
        raise DataError("no response token is left to train on; raise --seq_len or check the data's columns")
    return InstructionRows(torch.from_numpy(ids), torch.from_numpy(targets), round(chars), truncated, seq_len)


def instruction_splits(source: str | None, data_format: str = "auto", text_column: str = "text",
                       validation_fraction: float = 0.05, seed: int = 0) -> tuple[dict, str] | None:
    """``({"train": ds, "validation": ds}, format)`` of ``source`` when its columns hold instructions
    (``detect_format``) under ``--data_format`` auto or instruct, loaded once; ``None`` for plain text (``builtin``
    is text, and so is anything under ``text``). A validation split is carved from train when it has none:
    ``validation_fraction`` of the rows, at least 1. ``instruct`` on columns that hold none is a one-line error."""
    if data_format not in ("auto", "instruct", "text"):
        raise DataError(f"--data_format {data_format!r}: choose auto, instruct or text")
    if data_format == "text" or source is None or source == "builtin":
        return None
    splits = load_splits(source, text_column)
    fmt = detect_format(splits["train"].column_names)
    if fmt is None:
        if data_format == "auto":
            return None
        raise DataError(
            f"{source!r} has columns {', '.join(splits['train'].column_names)}: no messages, instruction/output or "
            "prompt/response; use --data_format text for plain text"
        )
    if "validation" not in splits:
        n = len(splits["train"])
        if n < 2:
            raise DataError(f"{source!r} has {n} example(s); need at least 2 to carve a validation split")
        cut = splits["train"].train_test_split(test_size=max(1, round(validation_fraction * n)), seed=seed)
        splits = {"train": cut["train"], "validation": cut["test"]}
    return splits, fmt


def load_instruction_splits(source: str, validation_fraction: float = 0.05, seed: int = 0) -> tuple[dict, str]:
    """``instruction_splits`` of a source that must hold instructions."""
    return instruction_splits(source, "instruct", validation_fraction=validation_fraction, seed=seed)


def format_instruction_example(example: dict[str, Any]) -> dict[str, str]:
    """Turn one instruction row into {"prompt", "response", "text"} (text = prompt + response).

    Accepts Alpaca-style columns instruction/input/output (input may be empty or absent) or
    prompt/response. The prompt is returned separately so the recipe can set its label tokens to
    -100 and train on the response only; the tokenizer's EOS is appended by the recipe.
    """
    if "instruction" in example and "output" in example:
        extra = (example.get("input") or "").strip()
        template = PROMPT_WITH_INPUT_TEMPLATE if extra else PROMPT_TEMPLATE
        prompt = template.format(instruction=str(example["instruction"]).strip(), input=extra)
        response = str(example["output"]).strip()
    elif "prompt" in example and "response" in example:
        prompt = PROMPT_TEMPLATE.format(instruction=str(example["prompt"]).strip())
        response = str(example["response"]).strip()
    else:
        raise ValueError(
            f"instruction example needs columns instruction/output (+input) or prompt/response, got {sorted(example)}"
        )
    return {"prompt": prompt, "response": response, "text": prompt + response}
