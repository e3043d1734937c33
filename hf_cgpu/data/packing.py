"""A tokenized split as one memory-mapped token stream (documents joined by EOS), cached by tokenizer, data and sequence
length so a second run on the same inputs starts training at once.

The cache may be shared by runs at the same time: each run tokenizes and writes under names of its own, publishes an
entry by ``os.replace`` (the tokens first, the meta last, both fsynced), and a run that finds the entry published
meanwhile uses it. An entry is used only when its tokens hash to the SHA-256 its meta records: the full hash (under
1 s per GB), not a cheaper fingerprint, because the resume fingerprint needs that hash of the tokens read anyway
(``PackedTokens.content_hash`` returns it without a second read).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from ..errors import DataError
from ..integrity import fsync_dir, fsync_file
from ..paths import packed_cache
from .tokenizer import no_eos_message, tokenizer_hash

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PACK_FORMAT_VERSION = 2  # 2: the whole token stream is kept (windows at any offset), characters counted
STALE_SECONDS = 24 * 3600
"""A run's temporaries untouched this long are a killed run's leftovers, removed by the next run packing that entry."""
_HASH_CHUNK = 8 << 20


class PackedTokens(torch.utils.data.Dataset):
    """A tokenized split as one memory-mapped token stream (documents joined by EOS).

    Two views: ``blocks`` / ``__getitem__``, the fixed ``seq_len + 1`` blocks that tile the stream from offset 0
    (the trailing partial block left out), and ``windows(starts, length)``, windows cut at any offset, which is how
    training draws its samples (``WindowOrder``) and how evaluation covers the whole split (``eval_windows``).
    The memmap is reopened lazily after pickling, so DataLoader workers share the page cache.
    """

    def __init__(self, path: str | os.PathLike, meta: dict[str, Any], sha256: str | None = None):
        self.path = Path(path)
        self.meta = meta
        self.seq_len: int = meta["seq_len"]
        self.num_blocks: int = meta["num_blocks"]
        self.n_tokens: int = meta["n_tokens_total"]
        self.n_chars: int | None = meta.get("n_chars")
        self.vocab_size: int = meta["vocab_size"]
        self.dtype = np.dtype(meta["dtype"])
        self._tokens: np.memmap | None = None
        self._sha256 = sha256  # of the stream as this process wrote or read it, never taken from the meta

    @property
    def tokens(self) -> np.memmap:
        """The whole token stream, ``(n_tokens,)``, read-only."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        return self._tokens

    @property
    def blocks(self) -> np.ndarray:
        """The stream's first ``num_blocks * (seq_len + 1)`` tokens as ``(num_blocks, seq_len + 1)``."""
        block = self.seq_len + 1
        return self.tokens[: self.num_blocks * block].reshape(self.num_blocks, block)

    def windows(self, starts: np.ndarray | torch.Tensor, length: int) -> torch.Tensor:
        """``(len(starts), length)`` int64 tensor of the tokens ``[start, start + length)`` for each start."""
        starts = np.asarray(starts, dtype=np.int64)
        if starts.size and (starts.min() < 0 or starts.max() + length > self.n_tokens):
            raise IndexError(f"window of {length} tokens out of range of a {self.n_tokens}-token stream")
        index = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
        return torch.from_numpy(self.tokens[index].astype(np.int64))

    @property
    def content_hash(self) -> str:
        """SHA-256 of the token stream (what training reads: the data's content through the tokenizer, whatever
        path it came from), of the bytes this process wrote or read: hashed while packing, when a cache entry is
        checked, or else from the memory map on first use; never the meta's record, which a changed file would
        not change."""
        if self._sha256 is None:
            self._sha256 = stream_sha256(self.tokens)
        return self._sha256

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)  # numpy and 0-d torch indices from samplers
        if not -self.num_blocks <= index < self.num_blocks:
            raise IndexError(f"block {index} out of range for {self.num_blocks} blocks")
        return {"input_ids": torch.from_numpy(self.blocks[index].astype(np.int64))}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state

    def __repr__(self) -> str:
        return f"PackedTokens(num_blocks={self.num_blocks}, seq_len={self.seq_len}, n_tokens={self.n_tokens})"


def source_fingerprint(ds: datasets.Dataset, text_column: str) -> str:
    """The dataset's own fingerprint (deterministic across runs for files and for ``from_dict`` data, and
    updated by every map/filter/select); a content hash when a dataset lacks one."""
    fingerprint = getattr(ds, "_fingerprint", None)
    if fingerprint:
        return f"{fingerprint}-{len(ds)}"
    digest = hashlib.sha256()
    for batch in ds.iter(batch_size=10_000):
        for text in batch[text_column]:
            digest.update(text.encode("utf-8") + b"\0")
    return digest.hexdigest()[:16]



def stream_sha256(tokens: np.ndarray) -> str:
    """SHA-256 of a token array's bytes (a memory map is read in chunks, never copied whole)."""
    digest = hashlib.sha256()
    step = max(1, _HASH_CHUNK // max(1, tokens.itemsize))
    for start in range(0, len(tokens), step):
        digest.update(np.ascontiguousarray(tokens[start : start + step]))
    return digest.hexdigest()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def pack_dataset(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    text_column: str = "text",
    split: str = "",
    log: Callable[[str], None] | None = None,
) -> PackedTokens:
    """Tokenize ``ds``, append EOS after every document and concatenate into one token stream.

    The whole stream is kept; ``PackedTokens.blocks`` views it as fixed ``seq_len + 1`` blocks (the trailing partial
    block left out) and ``windows`` cuts it anywhere, so every batch has the same shape (no recompiles, no
    padding). The meta also records the documents' characters (``n_chars``, for bits per character) and the
    stream's SHA-256. Tokens go to ``<cache_dir>/<key>.bin`` (uint16 when the vocabulary fits, halving disk and page
    cache) with ``<key>.json`` beside it; the key hashes the tokenizer, the source fingerprint, ``seq_len`` and the
    column, so a repeat call returns at once and any change re-tokenizes. An entry whose tokens no longer hash to its
    recorded SHA-256 (or whose size or meta is off) is packed again, with a warning line to ``log`` (default:
    stderr). ``split`` names the data in errors ("the validation split has only 12 tokens"). ``num_proc`` None
    means ``min(4, cpus)``, and 1 for small sets where worker start-up costs more than it saves. ``cache_dir`` None
    means ``paths.packed_cache()``.
    """
    eos = _check_inputs(ds, tokenizer, seq_len, text_column)
    log = log or _stderr
    vocab_size = len(tokenizer)
    dtype = np.uint16 if vocab_size <= 65535 else np.uint32
    key_fields = {
        "format": PACK_FORMAT_VERSION,
        "tokenizer": tokenizer_hash(tokenizer),
        "source": source_fingerprint(ds, text_column),
        "seq_len": seq_len,
        "text_column": text_column,
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir) if cache_dir else packed_cache()
    bin_path, meta_path = cache_dir / f"tokens-{key}.bin", cache_dir / f"tokens-{key}.json"
    found = _published(bin_path, meta_path, log)
    if found is not None:
        return found
    seen = _stamp(meta_path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale(cache_dir, key)

    if num_proc is None:
        num_proc = 1 if len(ds) < 10_000 else min(4, os.cpu_count() or 1)
    num_proc = max(1, min(num_proc, len(ds)))
    run = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # this run's temporaries: another packing the same key has others
    work_dir = cache_dir / f"tmp-{key}-{run}"
    tmp_bin, tmp_meta = cache_dir / f".tokens-{key}.bin.tmp-{run}", cache_dir / f".tokens-{key}.json.tmp-{run}"
    work_dir.mkdir()
    try:
        tokenized = _tokenize(ds, tokenizer, text_column, eos, num_proc, work_dir / "tokenized.arrow")
        if _stamp(meta_path) != seen:  # another run published the entry while this one tokenized: use it
            found = _published(bin_path, meta_path, log)
            if found is not None:
                return found
        meta = _write_stream(tokenized, tmp_bin, seq_len, dtype, split)
        del tokenized
        meta.update(key_fields, vocab_size=vocab_size, eos_token_id=eos, n_documents=len(ds), key=key)
        tmp_meta.write_text(json.dumps(meta, indent=2))
        fsync_file(tmp_meta)
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_meta, meta_path)  # meta last: no reader takes an entry before its tokens are in place
        fsync_dir(cache_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
        tmp_bin.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)
    return PackedTokens(bin_path, meta, sha256=meta["sha256"])


def _check_inputs(ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, seq_len: int, text_column: str) -> int:
    """The tokenizer's EOS id, after the one-line refusals of what cannot be packed."""
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len} must be >= 1")
    if text_column not in ds.column_names:
        raise DataError(
            f"dataset has no column {text_column!r} (columns: {', '.join(ds.column_names)}); set --text_column"
        )
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(no_eos_message(tokenizer))
    return eos


def _tokenize(ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, text_column: str, eos: int, num_proc: int,
              cache_file: Path) -> datasets.Dataset:
    """Each document's ids with EOS appended and its characters, in ``num_proc`` processes, into ``cache_file``."""
    return ds.map(
        _tokenize_batch,
        batched=True,
        batch_size=1000,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=ds.column_names,
        fn_kwargs={"tokenizer": tokenizer, "text_column": text_column, "eos": eos},
        features=datasets.Features(
            {"input_ids": datasets.List(datasets.Value("int32")), "n_chars": datasets.Value("int64")}
        ),
        cache_file_name=str(cache_file),
        load_from_cache_file=False,
        desc=f"tokenizing ({num_proc} proc)",
    )


def _published(bin_path: Path, meta_path: Path, log: Callable[[str], None]) -> PackedTokens | None:
    """The cache entry when it is complete and its tokens hash to the SHA-256 its meta records; None when there is
    none yet, or (with a warning line) when it is unreadable, cut short or changed since it was packed."""
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log(f"warning: packed-token cache {meta_path} is unreadable ({' '.join(str(err).split())[:120]}); "
            "packing the data again")
        return None

    def refuse(why: str) -> None:
        log(f"warning: packed-token cache {bin_path} {why}; packing the data again")

    try:
        packed = PackedTokens(bin_path, meta)
        expected = packed.n_tokens * packed.dtype.itemsize
        recorded = meta.get("sha256")
    except (KeyError, TypeError, ValueError):
        return refuse(f"has a meta without its fields ({meta_path.name})")
    try:
        size = bin_path.stat().st_size
    except FileNotFoundError:
        return refuse("is missing (its meta is there)")
    if size != expected:
        return refuse(f"holds {size:,} bytes, its meta says {expected:,}")
    if not recorded:
        return refuse("records no SHA-256 (packed by an older hf_cgpu), so its tokens cannot be checked")
    digest = stream_sha256(packed.tokens)
    if digest != recorded:
        return refuse(f"does not hash to the SHA-256 its meta records ({digest[:12]}... vs {recorded[:12]}...): "
                     "its tokens changed since they were packed")
    packed._sha256 = digest
    return packed


def _stamp(path: Path) -> tuple[int, int] | None:
    """Which file is at ``path`` now (inode and modification time; None: none)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _remove_stale(cache_dir: Path, key: str) -> None:
    """Remove the temporaries of runs that packed ``key`` and were killed (untouched for ``STALE_SECONDS``)."""
    now = time.time()
    for path in [*cache_dir.glob(f"tmp-{key}-*"), *cache_dir.glob(f".tokens-{key}.*.tmp-*")]:
        try:
            inner = [p.stat().st_mtime for p in path.rglob("*")] if path.is_dir() else []
            if now - max([path.stat().st_mtime, *inner]) < STALE_SECONDS:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        except OSError:  # removed meanwhile by another run
            pass


def _tokenize_batch(
    batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, text_column: str, eos: int
) -> dict[str, list]:
    ids = tokenizer(
        batch[text_column],
        add_special_tokens=False,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,
    )["input_ids"]
    return {"input_ids": [doc + [eos] for doc in ids], "n_chars": [len(t) for t in batch[text_column]]}


def _write_stream(tokenized: datasets.Dataset, path: Path, seq_len: int, dtype: type, split: str) -> dict[str, Any]:
    """Stream the token lists into a memmap at ``path`` (fsynced): the whole stream (windows may start anywhere);
    ``num_blocks`` counts the whole ``seq_len + 1`` blocks it tiles from offset 0."""
    column = tokenized.data.column("input_ids")
    n_total = int(sum(int(pc.sum(pc.list_value_length(chunk)).as_py() or 0) for chunk in column.chunks))
    block = seq_len + 1
    num_blocks = n_total // block
    if num_blocks == 0:
        what = f"the {split} split" if split else "the data"
        lower = f" to {n_total - 1} or less" if n_total > 1 else ""
        raise DataError(f"{what} has only {n_total} tokens, fewer than the {block} (seq_len + 1) of one window; "
                        f"add text to it or lower --seq_len{lower}")
    out = np.memmap(path, dtype=dtype, mode="w+", shape=(n_total,))
    pos = 0
    digest = hashlib.sha256()  # the stream's content hash, while writing it (the resume fingerprint's data part)
    for chunk in tqdm(column.chunks, desc="packing tokens", unit="chunk", leave=False):
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        out[pos : pos + len(values)] = values
        digest.update(out[pos : pos + len(values)].tobytes())
        pos += len(values)
    out.flush()
    del out
    fsync_file(path)
    n_chars = int(pc.sum(tokenized.data.column("n_chars")).as_py() or 0)
    return {
        "seq_len": seq_len,
        "num_blocks": num_blocks,
        "n_tokens": num_blocks * block,
        "n_tokens_total": n_total,
        "n_chars": n_chars,
        "dtype": np.dtype(dtype).name,
        "sha256": digest.hexdigest(),
    }


__all__ = ["PACK_FORMAT_VERSION", "STALE_SECONDS", "PackedTokens", "pack_dataset", "source_fingerprint",
           "stream_sha256"]
