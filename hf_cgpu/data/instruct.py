"""Instruction data for fine-tuning: rows -> chat messages -> token rows whose loss covers the responses only.

Accepted rows: chat ``messages`` (a list of ``{"role", "content"}``), Alpaca-style ``instruction``/``input``/
``output``, or ``prompt``/``response``. With a chat template (the base tokenizer's), each row is rendered by it and
the targets are the characters of every assistant turn, its end-of-turn marker included (found by rendering the
conversation up to and after each assistant turn), mapped to tokens through the tokenizer's offsets. Without one,
``### Instruction / ### Response`` prompts are used and the response plus EOS is the target. Examples go into
fixed-length rows (``seq_len + 1`` tokens; longer ones cut and counted): one per row, padded, or packed several to a
row with positions restarting at each example, so attention (transformers' padding-free path) and the loss never
read a prompt token, padding, or another example's text.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch

from ..errors import DataError
from ..registry import Registry
from .bins import best_fit_decreasing
from .corpus import load_splits, named_as_train, split_files
from .files import json_kind, locate_row

IGNORE = -100
_MISSING = object()
_INDEX = re.compile(r"\[\d+\]")  # messages[3].content -> messages[].content


class RowError(DataError):
    """A row a format cannot turn into a chat; ``field`` names what is wrong (``output``, ``messages[1].content``)."""

    def __init__(self, field: str, problem: str, kind: str | None = None):
        super().__init__(f"{field!r} {problem}")
        self.field = field
        self.kind = kind or f"without a string {_INDEX.sub('[]', field)!r}"  # how skipped rows are counted


def text_field(row: dict[str, Any], field: str, optional: bool = False, name: str | None = None) -> str:
    """``row[field]`` when it is a string ('' for an absent or null ``optional`` field); a ``RowError`` naming the
    field otherwise (null, missing, a number, a list): never the text "None" or "5" trained on as an answer."""
    value = row.get(field, _MISSING) if isinstance(row, dict) else _MISSING
    if isinstance(value, str):
        return value
    if optional and (value is None or value is _MISSING):
        return ""
    name = name or field
    if value is _MISSING:
        raise RowError(name, "is missing")
    raise RowError(name, f"is {json_kind(value)}, not a string")


def _messages(row: dict[str, Any], key: str = "messages") -> list[dict[str, str]]:
    """``row[key]`` as a list of ``{role, content}`` messages; a ``RowError`` naming ``key[i].field`` otherwise."""
    msgs = row.get(key)
    chats = f"whose {key!r} is no list of {{role, content}} objects"
    if not isinstance(msgs, list) or not msgs:
        raise RowError(key, f"must be a non-empty list of {{role, content}} objects, not {json_kind(msgs)}", chats)
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RowError(f"{key}[{i}]", f"must be a {{role, content}} object, not {json_kind(m)}", chats)
        for field in ("role", "content"):
            if field not in m:
                raise RowError(f"{key}[{i}].{field}", "is missing (a message is a {role, content} object)")
        out.append({"role": text_field(m, "role", name=f"{key}[{i}].role"),
                    "content": text_field(m, "content", name=f"{key}[{i}].content")})
    return out


def _instruction(row: dict[str, Any]) -> list[dict[str, str]]:
    extra = text_field(row, "input", optional=True).strip()
    user = text_field(row, "instruction").strip() + (f"\n\n{extra}" if extra else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": text_field(row, "output").strip()}]


def _prompt(row: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": text_field(row, "prompt").strip()},
            {"role": "assistant", "content": text_field(row, "response").strip()}]


@dataclass(frozen=True)
class InstructionFormat:
    """One layout of instruction rows: the columns that identify it and how a row becomes a chat."""

    name: str
    """What ``--data_format`` detection calls it (recorded as the run's format)."""
    columns: frozenset[str]
    """A dataset whose columns include these holds this format."""
    to_messages: Callable[[dict[str, Any]], list[dict[str, str]]]
    """A row as ``[{"role", "content"}, ...]`` (user turns and the assistant's answers); a row it cannot turn into
    text raises ``RowError`` naming the field (``text_field`` does), which the loader reports with the row's file."""


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


ANSWER_ROLE = "assistant"
"""The role of the turns the loss covers (the answers a fine-tuned model learns to give)."""
_AS_ANSWER: dict[tuple[str, str], bool] = {}


def answers(tokenizer, role: str) -> bool:
    """Whether the loss covers a turn of ``role``: ``assistant``, or a role the tokenizer's chat template renders
    exactly as an assistant turn (Gemma's templates write the assistant's turns as ``model``, so there ``model`` is
    the same turn). Other roles (user, system, a ``model`` that ChatML would print as such) are prompts."""
    if role == ANSWER_ROLE:
        return True
    template = getattr(tokenizer, "chat_template", None)
    if role in ("user", "system") or not isinstance(template, str):
        return False
    key = (template, role)
    if key not in _AS_ANSWER:
        from jinja2 import TemplateError

        def text(who):
            return tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": who, "content": "Yes"}],
                                                 tokenize=False)

        try:
            _AS_ANSWER[key] = text(role) == text(ANSWER_ROLE)
        except TemplateError:  # a template that refuses the role (its raise_exception) renders no answer with it
            _AS_ANSWER[key] = False
    return _AS_ANSWER[key]


def no_answer(tokenizer, messages: list[dict[str, str]]) -> RowError | None:
    """The ``RowError`` of a conversation without a turn the loss covers (``answers``): it would train on nothing."""
    if any(answers(tokenizer, m["role"]) for m in messages):
        return None
    roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
    return RowError("messages", f"has no assistant turn (roles: {roles}), so nothing of it would be trained on: the "
                    "loss covers the turns whose role is assistant; give the answers that role",
                    "without an assistant turn")


def render(tokenizer, messages: list[dict[str, str]], append_eos: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans the loss covers (the assistant turns); ``append_eos``: the
    EOS follows each assistant turn, inside its span (for a template that ends a turn with no special token)."""
    if append_eos:
        full, spans = render(tokenizer, messages)
        eos, cuts = tokenizer.eos_token, [0] + [end for _, end in spans] + [None]
        text = eos.join(full[a:b] for a, b in zip(cuts, cuts[1:]))
        return text, [(a + k * len(eos), b + (k + 1) * len(eos)) for k, (a, b) in enumerate(spans)]
    if getattr(tokenizer, "chat_template", None):
        def text(msgs, gen):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        full, spans = text(messages, False), []
        for i, m in enumerate(messages):
            if not answers(tokenizer, m["role"]):
                continue
            before, upto = text(messages[:i], True) if i else "", text(messages[: i + 1], False)
            if not (full.startswith(upto) and upto.startswith(before)):
                raise DataError("the chat template does not render a conversation as a prefix of its continuation; "
                                 "pass plain text (--text_column) or a tokenizer with another template")
            spans.append((len(before), len(upto)))
        return full, spans
    prompt = "".join(PROMPT_TEMPLATE.format(instruction=m["content"]) for m in messages
                     if not answers(tokenizer, m["role"]))
    answer = "\n\n".join(m["content"] for m in messages if answers(tokenizer, m["role"]))
    eos = tokenizer.eos_token or ""
    return prompt + answer + eos, [(len(prompt), len(prompt) + len(answer) + len(eos))]


def encode(tokenizer, messages: list[dict[str, str]], append_eos: bool = False,
           skip_answers: int = 0) -> tuple[list[int], list[bool], int]:
    """Token ids, a target flag per token (its characters start inside an assistant span), and the characters of
    the answers (their content; end-of-turn markers are scored but not counted as characters). ``skip_answers``: the
    first so many assistant turns are context (a preference pair's prompt), not targets."""
    full, spans = render(tokenizer, messages, append_eos)
    spans = spans[skip_answers:]
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    flags = [any(a <= start < b for a, b in spans) and end > start for start, end in enc["offset_mapping"]]
    answered = [m for m in messages if answers(tokenizer, m["role"])][skip_answers:]
    return enc["input_ids"], flags, sum(len(m["content"]) for m in answered)


@dataclass
class InstructionRows:
    """Fixed-length rows: ``ids`` (N, seq_len + 1) and ``targets`` (same shape, IGNORE off the responses). Packed rows
    hold several examples each and their ``position_ids`` (same shape) restart at 0 where an example starts, which is
    what keeps attention within each example; ``None`` = one example per row, positions 0, 1, ..."""

    ids: torch.Tensor
    targets: torch.Tensor
    n_chars: int  # characters of the responses (bits per character of what the loss scores)
    n_truncated: int
    seq_len: int
    position_ids: torch.Tensor | None = None
    n_examples: int = 0
    n_tokens: int = 0  # slots holding an example's token (the rest is padding)
    n_cut_to_prompt: int = 0  # examples cut before their first response token: left out (nothing to train on)
    row_tokens: torch.Tensor | None = None  # (N,) slots of each row holding an example's token (the rest is padding)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def lengths(self) -> torch.Tensor:
        """(N,) tokens of each example up to and including its last target (at least 2): a causal model's loss does
        not see the padding after it."""
        scored = (self.targets != IGNORE).flip(1).int()
        return (self.targets.shape[1] - scored.argmax(1)).where(scored.any(1), 0).clamp(min=2)


@dataclass
class _Example:
    tokens: list[int]
    flags: list[bool]
    n_chars: int


def _encode_all(ds: datasets.Dataset, tokenizer, fmt: str, where: str, append_eos: bool) -> list[_Example]:
    out = []
    for i, row in enumerate(ds):
        try:
            messages = to_messages(row, fmt)
            if err := no_answer(tokenizer, messages):
                raise err
        except RowError as err:
            raise DataError(f"row {i} of {where}: {err}; fix or remove that row") from None
        out.append(_Example(*encode(tokenizer, messages, append_eos)))
    return out


def build_rows(ds: datasets.Dataset, tokenizer, seq_len: int, fmt: str, where: str = "the data",
               append_eos: bool = False, packing: bool = False) -> InstructionRows:
    """The rows of ``ds`` (``fmt``) as fixed-length rows of ``seq_len + 1`` tokens: one example each, padded, or with
    ``packing`` several whole examples each (``best_fit_decreasing``). An example longer than a row is cut (counted in
    ``n_truncated``), never continued in another row; one cut before its first response token would train on nothing
    and is left out (counted in ``n_cut_to_prompt``). A row that is no chat, or has no assistant turn, is refused
    naming its index in ``where`` (``instruction_splits`` has refused or skipped those already, naming their files).
    ``append_eos``: see ``render`` (``data.chat.prepare_chat`` decides)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = seq_len + 1
    encoded = _encode_all(ds, tokenizer, fmt, where, append_eos)
    # an example's first token is never predicted (in a packed row: not from the one before), so a target counts from 1
    examples = [e for e in encoded if any(e.flags[1:width])]
    if not examples:
        if not encoded:
            raise DataError(f"{where} holds no example; add rows to it")
        starts = [e.flags.index(True, 1) for e in encoded if any(e.flags[1:])]
        if not starts:
            raise DataError(f"no example of {where} has a response token to predict; check its assistant turns")
        raise DataError(f"every example of {where} is cut at --seq_len {seq_len} before its first response token, "
                        f"so nothing is left to train on; raise --seq_len to {min(starts)} or more")
    lengths = [len(e.tokens) for e in examples]
    bins = best_fit_decreasing(lengths, width) if packing else [[i] for i in range(len(examples))]
    ids = np.full((len(bins), width), pad, dtype=np.int64)
    targets = np.full((len(bins), width), IGNORE, dtype=np.int64)
    positions = np.zeros((len(bins), width), dtype=np.int64)
    filled = np.zeros(len(bins), dtype=np.int64)
    chars = 0.0
    for r, members in enumerate(bins):
        at = 0
        for i in members:
            e = examples[i]
            tok, flags = e.tokens[:width], np.asarray(e.flags[:width], dtype=bool)
            flags[:1] = False
            ids[r, at : at + len(tok)] = tok
            targets[r, at : at + len(tok)][flags] = np.asarray(tok)[flags]
            positions[r, at : at + len(tok)] = np.arange(len(tok))
            chars += e.n_chars * flags.sum() / max(1, sum(e.flags))  # the characters of the target tokens kept
            at += len(tok)
        positions[r, at:] = np.arange(width - at)  # the padding is a sequence of its own
        filled[r] = at
    return InstructionRows(torch.from_numpy(ids), torch.from_numpy(targets), round(chars),
                           sum(len(e.tokens) > width for e in encoded), seq_len,
                           torch.from_numpy(positions) if packing else None, len(examples), int(filled.sum()),
                           len(encoded) - len(examples), torch.from_numpy(filled))


MIN_HELD_OUT = 8
"""Examples a carved validation split holds at least (a quarter of a smaller set, at least one): one or two held-out
examples make a validation loss that says which examples they were, not how the fine-tune does."""


def instruction_splits(source: str | None, data_format: str = "auto", text_column: str = "text",
                       validation_fraction: float = 0.05, seed: int = 0, skip_bad_rows: bool = False,
                       log: Callable[[str], None] | None = None, tokenizer=None) -> tuple[dict, str] | None:
    """``({"train": ds, "validation": ds}, format)`` of ``source`` when its columns hold instructions
    (``detect_format``) under ``--data_format`` auto or instruct, loaded once; ``None`` for plain text (``builtin``
    is text, and so is anything under ``text``). A validation split is carved from train when it has none:
    ``validation_fraction`` of the rows, at least ``MIN_HELD_OUT`` (a quarter of a smaller set). ``instruct`` on
    columns that hold none is a one-line error.

    Every row is checked before any is used: a row whose fields are not text (a null or missing ``output``, a message
    without ``content``) or that has no assistant turn (``answers``: by the chat template of ``tokenizer``, where
    given) is refused in one line naming its file, row and field; with ``skip_bad_rows`` such rows are left out
    instead and counted in one line per split to ``log`` (default: stderr)."""
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
    if named_as_train(source):
        (log or _stderr)(named_as_train(source))
    convert = INSTRUCTION_FORMATS[fmt].to_messages

    def check(row):
        if err := no_answer(tokenizer, convert(row)):
            raise err

    return checked_splits(splits, source, check, skip_bad_rows, log, validation_fraction, seed), fmt


def checked_splits(splits: dict[str, datasets.Dataset], source: str, check: Callable[[dict[str, Any]], Any],
                   skip_bad_rows: bool = False, log: Callable[[str], None] | None = None,
                   validation_fraction: float = 0.05, seed: int = 0) -> dict[str, datasets.Dataset]:
    """``splits`` of ``source`` with every row passed through ``check`` (which raises ``RowError`` for a row it
    refuses: one line naming file, row and field, or with ``skip_bad_rows`` left out and counted), and a validation
    split carved from train where there is none (``validation_fraction`` of the rows, at least ``MIN_HELD_OUT``: a
    quarter of a smaller set)."""
    log = log or _stderr
    files = split_files(source)
    splits = {split: _usable_rows(ds, check, split, files.get(split, []), source, skip_bad_rows, log)
              for split, ds in splits.items()}
    if "validation" not in splits:
        n = len(splits["train"])
        if n < 2:
            raise DataError(f"{source!r} has {n} example(s); need at least 2 to carve a validation split")
        held = max(1, round(validation_fraction * n), min(MIN_HELD_OUT, n // 4))
        cut = splits["train"].train_test_split(test_size=held, seed=seed)
        splits = {"train": cut["train"], "validation": cut["test"]}
        log(f"note: {source!r} has no validation split: {len(cut['test']):,} of its {n:,} examples are held out as "
            "one (the same examples in every run and in hf-cgpu eval)")
    return splits


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _usable_rows(ds: datasets.Dataset, check: Callable[[dict[str, Any]], Any], split: str, files: list, source: str,
                 skip: bool, log: Callable[[str], None]) -> datasets.Dataset:
    """``ds`` without the rows ``check`` refuses (a ``RowError``): refused, naming the first, unless ``skip``."""

    def where(i: int) -> str:
        return locate_row(files, i) or f"row {i} of the {split} split of {source}"

    bad: dict[int, RowError] = {}
    for i, row in enumerate(ds):
        try:
            check(row)
        except RowError as err:
            if not skip:
                raise DataError(f"{where(i)}: {err}; fix or remove that row, or pass --skip_bad_rows true to leave "
                                "such rows out") from None
            bad[i] = err
    if not bad:
        return ds
    kinds = Counter(err.kind for err in bad.values())
    rows = f"{len(bad)} row{'s' if len(bad) > 1 else ''}"
    what = f"{rows} {next(iter(kinds))}" if len(kinds) == 1 else f"{rows}: " + ", ".join(
        f"{n} {kind}" for kind, n in kinds.items())
    log(f"skipped {what} (first: {where(next(iter(bad)))})")
    return ds.select([i for i in range(len(ds)) if i not in bad])


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
        extra = text_field(example, "input", optional=True).strip()
        template = PROMPT_WITH_INPUT_TEMPLATE if extra else PROMPT_TEMPLATE
        prompt = template.format(instruction=text_field(example, "instruction").strip(), input=extra)
        response = text_field(example, "output").strip()
    elif "prompt" in example and "response" in example:
        prompt = PROMPT_TEMPLATE.format(instruction=text_field(example, "prompt").strip())
        response = text_field(example, "response").strip()
    else:
        raise ValueError(
            f"instruction example needs columns instruction/output (+input) or prompt/response, got {sorted(example)}"
        )
    return {"prompt": prompt, "response": response, "text": prompt + response}
