"""Which tokens of a packed stream each step trains on (``WindowOrder``), which windows evaluation scores
(``eval_windows``), and the positions that keep a window's attention within each document (``document_position_ids``)."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import DataError
from ..options import DATA_ORDERS


class WindowOrder:
    """Start offsets of the training windows of optimizer step ``k``: a function of ``(seed, k)`` alone.

    ``shifted`` (default): every epoch cuts the stream at a new random offset into windows of ``window`` tokens and
    visits them in a new random order, so each token is seen once per epoch but never twice in the same context.
    ``random``: nanoGPT's ``get_batch``, every start drawn uniformly and independently. ``fixed``: the same blocks
    every epoch (offset 0), in a new order; on a small corpus seen for many epochs this memorises the blocks
    (benchmarks/RESULTS.md).
    """

    def __init__(self, n_tokens: int, window: int, seed: int, mode: str = "shifted"):
        if mode not in DATA_ORDERS:
            raise DataError(f"data_order={mode!r}; choose one of {', '.join(DATA_ORDERS)}")
        if n_tokens < window:
            raise DataError(f"the training stream has {n_tokens} tokens, fewer than one window of {window}; "
                             "lower --seq_len or add data")
        self.n, self.window, self.seed, self.mode = n_tokens, window, seed, mode
        self.max_offset = 0 if mode == "fixed" else min(window - 1, n_tokens - window)
        self.per_epoch = (n_tokens - self.max_offset) // window  # windows that fit at every offset
        self._epoch, self._perm, self._offset = -1, np.empty(0, dtype=np.int64), 0

    def _epoch_plan(self, epoch: int) -> tuple[np.ndarray, int]:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 7_777 + epoch)
            perm = torch.randperm(self.per_epoch, generator=g).numpy()
            offset = int(torch.randint(0, self.max_offset + 1, (1,), generator=g)) if self.max_offset else 0
            self._epoch, self._perm, self._offset = epoch, perm, offset
        return self._perm, self._offset

    def indices(self, step: int, batch: int) -> torch.Tensor:
        """``batch`` window starts (token offsets) of optimizer step ``step``."""
        if self.mode == "random":
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + step * 7919 + 29) % (2**62))
            return torch.randint(0, self.n - self.window + 1, (batch,), generator=g)
        out: list[int] = []
        pos = step * batch
        while len(out) < batch:
            epoch, at = divmod(pos, self.per_epoch)
            perm, offset = self._epoch_plan(epoch)
            take = min(batch - len(out), self.per_epoch - at)
            out.extend((offset + perm[at : at + take] * self.window).tolist())
            pos += take
        return torch.tensor(out, dtype=torch.long)

    def epoch_of(self, step: int, batch: int) -> float:
        """Epochs of the stream consumed before ``step`` (tokens seen / tokens in the stream)."""
        return step * batch * self.window / self.n


def eval_windows(n_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """``(start, skip)`` pairs of ``seq_len + 1``-token windows whose targets cover tokens ``1 .. n_tokens - 1``
    of a stream exactly once: stride ``seq_len`` (each window overlaps the last one by its first token, which is
    context only), and a last window aligned to the stream's end whose first ``skip`` targets were already scored.
    """
    window = seq_len + 1
    if n_tokens < 2:
        return []
    if n_tokens <= window:
        return [(0, 0)] if n_tokens == window else []
    out = [(s, 0) for s in range(0, n_tokens - window + 1, seq_len)]
    covered = out[-1][0] + window  # tokens [0, covered) are scored (token 0 as context only)
    if covered < n_tokens:
        start = n_tokens - window
        out.append((start, covered - 1 - start))  # targets are tokens start+1 .. ; those < covered already scored
    return out


def document_position_ids(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """Positions of the windows ``ids`` (B, T) counted from each document's start: they restart after every ``eos``
    (an EOS ends its document and keeps its position), so the mask transformers builds from restarting positions keeps
    attention within each document. The GPT's own rule (it applies it by itself when given no positions). Fixed
    shapes and no host sync: a compiled model sees one input signature."""
    from ..models.cgpt.modeling_cgpt import document_position_ids as positions  # imports transformers: on first use

    return positions(ids == eos)


def replace_tokens(ids: torch.Tensor, probability: float, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """``ids`` with each token replaced, with ``probability``, by one drawn uniformly from ``range(vocab_size)`` (a
    new tensor; the draws from ``generator``, on ``ids``' device)."""
    hit = torch.rand(ids.shape, device=ids.device, generator=generator) < probability
    noise = torch.randint(0, vocab_size, ids.shape, device=ids.device, generator=generator, dtype=ids.dtype)
    return torch.where(hit, noise, ids)


__all__ = ["WindowOrder", "document_position_ids", "eval_windows", "replace_tokens"]
