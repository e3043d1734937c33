"""Best-fit decreasing: whole examples into fixed-size rows with little room left over.

TRL (``pack_dataset(strategy="bfd")``) and transformers (``DataCollatorWithFlattening``) pack too; ours keeps every
row the same width (``seq_len + 1``), so the compiled step and CUDA graphs see one shape, and the bins are computed
once, deterministically, so they are part of the data fingerprint that resume checks.
"""

from __future__ import annotations

from bisect import bisect_left, insort


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``: longest first, each into the open bin it fills
    most tightly (a new one when none has room). Lengths above ``capacity`` are taken as ``capacity`` (the caller
    cuts those examples). Ties keep the input order, so the same lengths always give the same bins."""
    order = sorted(range(len(lengths)), key=lambda i: (-min(lengths[i], capacity), i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (space left, bin index), sorted: the tightest bin that fits is a bisect away
    for i in order:
        size = min(lengths[i], capacity)
        at = bisect_left(room, (size, -1))
        if at < len(room):
            left, b = room.pop(at)
        else:
            left, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if left - size > 0:
            insort(room, (left - size, b))
    return bins


def waste(lengths: list[int], bins: list[list[int]], capacity: int) -> float:
    """Share of the rows' slots left empty (padding)."""
    used = sum(min(lengths[i], capacity) for b in bins for i in b)
    return 1 - used / (len(bins) * capacity) if bins else 0.0
