"""A tokenized split as one memory-mapped token stream (documents joined by EOS), cached by tokenizer, data and sequence
length so a second run on the same inputs starts training at once."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from ..errors import DataError
from ..integrity import atomic_write_json, sha256_file
from ..paths import packed_cache
from .tokenizer import tokenizer_hash

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PACK_FORMAT_VERSION = 2  # 2: the whole token stream is kept (windows at any offset), characters counted


class PackedTokens(torch.utils.data.Dataset):
    """A tokenized split as one memory-mapped token stream (documents joined by EOS).

    Two views: ``blocks`` / ``__getitem__``, the fixed ``seq_len + 1`` blocks that tile the stream from offset 0
    (the trailing partial block left out), and ``windows(starts, length)``, windows cut at any offset, which is how
    training draws its samples (``WindowOrder``) and how evaluation covers the whole split (``eval_windows``).
    The memmap is reopened lazily after pickling, so DataLoader workers share the page cache.
    """

    def __init__(self, path: str | os.PathLike, meta: dict[str, Any]):
        self.path = Path(path)
        self.meta = meta
        self.seq_len: int = meta["seq_len"]
        self.num_blocks: int = meta["num_blocks"]
        self.n_tokens: int = meta["n_tokens_total"]
        self.n_chars: int | None = meta.get("n_chars")
        self.vocab_size: int = meta["vocab_size"]
        self.dtype = np.dtype(meta["dtype"])
        self._tokens: np.memmap | None = None

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
        path it came from). Computed while packing; hashed from the file once for caches packed before."""
        digest = self.meta.get("sha256")
        if not digest:
            digest = self.meta["sha256"] = sha256_file(self.path)
            meta_path = self.path.with_suffix(".json")
            if meta_path.is_file():
                try:
                    atomic_write_json(meta_path, self.meta)
                except OSError:  # a read-only cache still trains
                    pass
        return digest

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



def pack_dataset(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    text_column: str = "text",
) -> PackedTokens:
    """Tokenize ``ds``, append EOS after every document and concatenate into one token stream.

    The whole stream is kept; ``PackedTokens.blocks`` views it as fixed ``seq_len + 1`` blocks (the trailing partial
    block left out) and ``windows`` cuts it anywhere, so every batch has the same shape (no recompiles, no
    padding). The meta also records the documents' characters (``n_chars``, for bits per character). Tokens
    go to ``<cache_dir>/<key>.bin`` (uint16 when the vocabulary fits, halving disk and page cache) with
    ``<key>.json`` beside it; the key hashes the tokenizer, the source fingerprint, ``seq_len`` and the column,
    so a repeat call returns at once and any change re-tokenizes. ``num_proc`` None means ``min(4, cpus)``,
    and 1 for small sets where worker start-up costs more than it saves. ``cache_dir`` None means
    ``paths.packed_cache()``.
    """
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len} must be >= 1")
    if text_column not in ds.column_names:
        raise DataError(
            f"dataset has no column {text_column!r} (columns: {', '.join(ds.column_names)}); set --text_column"
        )
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("tokenizer has no eos_token; set one (tokenizer.eos_token = '<|endoftext|>') before packing")
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
    if meta_path.exists() and bin_path.exists():
        meta = json.loads(meta_path.read_text())
        expected = meta["n_tokens_total"] * np.dtype(meta["dtype"]).itemsize
        if bin_path.stat().st_size == expected:
            return PackedTokens(bin_path, meta)
    cache_dir.mkdir(parents=True, exist_ok=True)

    if num_proc is None:
        num_proc = 1 if len(ds) < 10_000 else min(4, os.cpu_count() or 1)
    num_proc = max(1, min(num_proc, len(ds)))
    work_dir = cache_dir / f"tmp-{key}"
    work_dir.mkdir(exist_ok=True)
    try:
        tokenized = ds.map(
            _tokenize_batch,
            batched=True,
            batch_size=1000,
            num_proc=num_proc if num_proc > 1 else None,
            remove_columns=ds.column_names,
            fn_kwargs={"tokenizer": tokenizer, "text_column": text_column, "eos": eos},
            features=datasets.Features(
            {"input_ids": datasets.List(datasets.Value("int32")), "n_chars": datasets.Value("int64")}
        ),
            cache_file_name=str(work_dir / "tokenized.arrow"),
            load_from_cache_file=False,
            desc=f"tokenizing ({num_proc} proc)",
        )
        meta = _write_blocks(tokenized, bin_path, seq_len, dtype)
        del tokenized
    finally:
        for f in work_dir.glob("*"):
            f.unlink()
        work_dir.rmdir()
    meta.update(key_fields, vocab_size=vocab_size, eos_token_id=eos, n_documents=len(ds), key=key)
    atomic_write_json(meta_path, meta)  # meta last: a crash mid-write never leaves a cache entry that looks complete
    return PackedTokens(bin_path, meta)


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


def _write_blocks(tokenized: datasets.Dataset, bin_path: Path, seq_len: int, dtype: type) -> dict[str, Any]:
    """Stream the token lists into the memmap: the whole stream (windows may start anywhere); ``num_blocks`` counts
    the whole ``seq_len + 1`` blocks it tiles from offset 0."""
    column = tokenized.data.column("input_ids")
    n_total = int(sum(int(pc.sum(pc.list_value_length(chunk)).as_py() or 0) for chunk in column.chunks))
    block = seq_len + 1
    num_blocks = n_total // block
    if num_blocks == 0:
        raise DataError(
            f"only {n_total} tokens, fewer than seq_len + 1 = {block}; lower --seq_len or add data"
        )
    tmp_path = bin_path.with_suffix(".bin.tmp")
    out = np.memmap(tmp_path, dtype=dtype, mode="w+", shape=(n_total,))
    pos = 0
    digest = hashlib.sha256()  # the stream's content hash, while writing it (the resume fingerprint's data part)
    for chunk in tqdm(column.chunks, desc="packing tokens", unit="chunk", leave=False):
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        out[pos : pos + len(values)] = values
        digest.update(out[pos : pos + len(values)].tobytes())
        pos += len(values)
    out.flush()
    del out
    with open(tmp_path, "rb") as fh:
        os.fsync(fh.fileno())
    tmp_path.replace(bin_path)
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


__all__ = ["PACK_FORMAT_VERSION", "PackedTokens", "pack_dataset", "source_fingerprint"]
