"""Preference data for DPO: pairs of a prompt and two answers (chosen, rejected) -> token rows, loss on the answers.

Rows in TRL's formats: ``prompt`` / ``chosen`` / ``rejected`` as plain strings (the prompt a user turn, each answer
an assistant turn), or conversational: each a list of ``{"role", "content"}`` messages (the prompt the conversation
so far, each answer the turns that follow it). Each answer is rendered after the prompt in the chat template as
instruction fine-tuning renders an example (``instruct.encode``), and only its assistant turns are targets: the
prompt's own assistant turns are context.

Rows hold whole pairs. Padded (``packing`` off): a pair is two rows of ``seq_len + 1`` tokens, the chosen sequence
and the rejected one. Packed: rows of ``2 (seq_len + 1)`` tokens hold several whole pairs each (best-fit
decreasing), the positions restarting at each sequence, so attention and the loss stay within it. Every target slot
carries its sequence's number within its unit (``2 k`` the chosen and ``2 k + 1`` the rejected answer of the unit's
``k``-th pair), which is how a batch sums each sequence's log-probability.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch

from ..errors import DataError
from .bins import best_fit_decreasing
from .corpus import load_splits, named_as_train
from .instruct import IGNORE, RowError, _messages, answers, checked_splits, encode, no_answer, text_field

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One preference row as chats: the prompt's messages and each answer's."""

    prompt: list[dict[str, str]]
    chosen: list[dict[str, str]]
    rejected: list[dict[str, str]]


def _part(row: dict[str, Any], key: str, role: str) -> list[dict[str, str]]:
    """``row[key]``: a string (one turn of ``role``) or a list of messages."""
    value = row.get(key) if isinstance(row, dict) else None
    if isinstance(value, list):
        return _messages(row, key)
    return [{"role": role, "content": text_field(row, key)}]


def to_pair(row: dict[str, Any], tokenizer=None) -> Pair:
    """A preference row as a ``Pair``; a ``RowError`` naming the field for a row that is no pair: a missing or
    non-text field, an answer without an assistant turn, or the same answer twice (nothing to prefer)."""
    pair = Pair(_part(row, "prompt", "user"), _part(row, "chosen", "assistant"), _part(row, "rejected", "assistant"))
    for key in ("chosen", "rejected"):
        if no_answer(tokenizer, getattr(pair, key)):
            raise RowError(key, "has no assistant turn: an answer is the assistant turns that follow the prompt",
                           "whose answer has no assistant turn")
    if pair.chosen == pair.rejected:
        raise RowError("rejected", "is the same as 'chosen': a pair trains on the difference of two answers",
                       "whose two answers are the same")
    return pair


@dataclass
class _Encoded:
    chosen: tuple[list[int], list[bool]]
    rejected: tuple[list[int], list[bool]]


def encode_pair(pair: Pair, tokenizer, append_eos: bool = False) -> _Encoded:
    """Each answer after the prompt: (token ids, target flags); the prompt's assistant turns are not targets."""
    skip = sum(answers(tokenizer, m["role"]) for m in pair.prompt)

    def one(answer):
        ids, flags, _ = encode(tokenizer, pair.prompt + answer, append_eos, skip_answers=skip)
        return ids, flags

    return _Encoded(one(pair.chosen), one(pair.rejected))


def preference_splits(source: str, tokenizer, seq_len: int, append_eos: bool = False, skip_bad_rows: bool = False,
                      log: Callable[[str], None] | None = None, validation_fraction: float = 0.05,
                      seed: int = 0) -> dict[str, datasets.Dataset]:
    """``{"train": ds, "validation": ds}`` of the preference rows of ``source`` (``instruct.checked_splits``: a
    validation split carved where there is none). A row that is no pair (``to_pair``) or whose prompt leaves no
    answer token inside a row of ``seq_len + 1`` tokens is refused in one line naming its file, row and field (or
    left out and counted with ``skip_bad_rows``)."""
    splits = load_splits(source, "text")
    columns = splits["train"].column_names
    missing = [c for c in PREFERENCE_COLUMNS if c not in columns]
    if missing:
        raise DataError(f"{source!r} has columns {', '.join(columns)}: preference rows need prompt, chosen and "
                        f"rejected (missing: {', '.join(missing)}), as plain strings or lists of {{role, content}} "
                        "messages")
    if named_as_train(source) and log is not None:
        log(named_as_train(source))
    width = seq_len + 1

    def check(row):
        encoded = encode_pair(to_pair(row, tokenizer), tokenizer, append_eos)
        for ids, flags in (encoded.chosen, encoded.rejected):
            if not any(flags[1:width]):
                raise RowError("prompt", f"fills the {width} tokens of a row (--seq_len {seq_len}) before the answer "
                               f"starts (token {flags.index(True) if True in flags else len(ids)}): raise --seq_len "
                               "or shorten the prompt", "whose prompt is longer than a row")

    return checked_splits(splits, source, check, skip_bad_rows, log, validation_fraction, seed)


@dataclass
class PairRows:
    """Token rows of whole pairs. ``ids``, ``targets`` (IGNORE off the answers) and ``segments`` (-1 off the targets,
    else the sequence's number within its unit: ``2 k`` chosen, ``2 k + 1`` rejected) are (R, W); a unit is
    ``rows_per_unit`` consecutive rows (2 padded: the chosen row, then the rejected one; 1 packed) and holds
    ``pairs[u]`` pairs, numbered ``first[u], first[u] + 1, ...`` over the whole set. ``position_ids`` restart at each
    sequence of a packed row (None: one sequence per row, positions 0, 1, ...)."""

    ids: torch.Tensor
    targets: torch.Tensor
    segments: torch.Tensor
    pairs: torch.Tensor
    rows_per_unit: int
    seq_len: int
    position_ids: torch.Tensor | None = None
    n_truncated: int = 0  # sequences longer than seq_len + 1 tokens, cut
    n_tokens: int = 0  # slots holding a sequence's token (the rest is padding)

    def __len__(self) -> int:
        """Units (what the sample order draws)."""
        return len(self.pairs)

    @property
    def n_pairs(self) -> int:
        return int(self.pairs.sum())

    @property
    def first(self) -> torch.Tensor:
        """(U,) the number of each unit's first pair."""
        return torch.cumsum(self.pairs, 0) - self.pairs

    def batch(self, units: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows of ``units`` (1-D): ``input_ids``, ``targets``, ``segments`` numbered over the batch (``2 j``,
        ``2 j + 1`` for its ``j``-th pair; -1 off the targets), ``position_ids`` if packed, and ``pair_index``: the
        number of each of its pairs over the whole set (their reference log-probabilities)."""
        k = self.rows_per_unit
        rows = (units[:, None] * k + torch.arange(k)).reshape(-1)
        counts = self.pairs[units]
        offset = (2 * (torch.cumsum(counts, 0) - counts)).repeat_interleave(k)  # per row: its unit's first sequence
        segments = self.segments[rows]
        out = {"input_ids": self.ids[rows], "targets": self.targets[rows],
               "segments": torch.where(segments >= 0, segments + offset[:, None], -1),
               "pair_index": torch.cat([torch.arange(f, f + n) for f, n in zip(self.first[units].tolist(),
                                                                              counts.tolist())])}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids[rows]
        return out


def build_pair_rows(ds: datasets.Dataset, tokenizer, seq_len: int, append_eos: bool = False,
                    packing: bool = False) -> PairRows:
    """The pairs of ``ds`` (checked by ``preference_splits``) as ``PairRows``: padded, two rows of ``seq_len + 1``
    tokens a pair, or packed into rows of ``2 (seq_len + 1)``. A sequence longer than ``seq_len + 1`` tokens is cut
    (counted); the first token of each is never a target (nothing before it predicts it)."""
    if len(ds) == 0:
        raise DataError("a split holds no preference pair; add rows to it")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = seq_len + 1
    encoded = [encode_pair(to_pair(row, tokenizer), tokenizer, append_eos) for row in ds]
    cut = [[(ids[:width], flags[:width]) for ids, flags in (e.chosen, e.rejected)] for e in encoded]
    truncated = sum(len(ids) > width for e in encoded for ids, _ in (e.chosen, e.rejected))
    if packing:
        row_width, per_unit = 2 * width, 1
        units = best_fit_decreasing([len(c[0]) + len(r[0]) for (c, r) in cut], row_width)
    else:
        row_width, per_unit = width, 2
        units = [[i] for i in range(len(cut))]
    n_rows = len(units) * per_unit
    ids = np.full((n_rows, row_width), pad, dtype=np.int64)
    targets = np.full((n_rows, row_width), IGNORE, dtype=np.int64)
    segments = np.full((n_rows, row_width), -1, dtype=np.int64)
    positions = np.zeros((n_rows, row_width), dtype=np.int64)
    filled = 0
    for u, members in enumerate(units):
        row, at = u * per_unit, 0
        for k, i in enumerate(members):
            for side, (tok, flags) in enumerate(cut[i]):
                if not packing:
                    row, at = u * per_unit + side, 0
                flags = np.asarray(flags, dtype=bool)
                flags[:1] = False
                span = slice(at, at + len(tok))
                ids[row, span] = tok
                targets[row, span][flags] = np.asarray(tok)[flags]
                segments[row, span][flags] = 2 * k + side
                positions[row, span] = np.arange(len(tok))
                at += len(tok)
                filled += len(tok)
        if packing:
            positions[row, at:] = np.arange(row_width - at) % width  # the padding: sequences of its own
    return PairRows(torch.from_numpy(ids), torch.from_numpy(targets), torch.from_numpy(segments),
                    torch.tensor([len(m) for m in units]), per_unit, seq_len,
                    torch.from_numpy(positions) if packing else None, truncated, filled)
