"""Text data for the GPT recipe: load a corpus, train a byte-level BPE tokenizer, pack tokens into one stream.

The pipeline is ``load_text_dataset -> train_tokenizer -> pack_dataset``. Packing writes a memory-mapped token
stream plus a JSON meta (token and character counts) into a cache directory keyed by (tokenizer, source
fingerprint, seq_len), so a second run on the same inputs starts training at once instead of re-tokenizing.
Training cuts windows from the stream (``WindowOrder``), evaluation scores every token once (``eval_windows``).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from ..errors import DataError, MissingPathError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
BUILTIN = "builtin"
PACK_FORMAT_VERSION = 2  # 2: the whole token stream is kept (windows at any offset), characters counted

# Extension -> datasets packaged builder. Text files are read by paragraph (blank-line separated documents).
_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text"}
_SPLIT_NAMES = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test",),
}

# Pre-tokenizer. GPT-2's regex (the ByteLevel default) already keeps a run of Han characters together, but it
# cuts the CJK punctuation and the newline that end every line of Chinese verse into separate pieces, so merges
# can never join "光" with "，\n". Measured on zh-poetry (full train set, vocab 32000): 1.27 characters per token
# with GPT-2's regex, 1.52 with this one (a CJK run may carry its trailing CJK punctuation and one newline);
# isolating every Han character gives 0.96 and cannot even fill a 32000 vocab. Non-CJK text is split exactly as
# GPT-2 splits it.
_HAN = (
    "\u2e80-\u2fdf"  # radicals
    "\u3005-\u3007\u3021-\u3029"  # 々 〆 〇, Hangzhou numerals
    "\u3040-\u30ff\u3100-\u312f\u3190-\u31ff"  # kana, bopomofo, kanbun
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # ext A, unified, compatibility ideographs
    "\U00020000-\U0003ffff"  # ext B..H
)
_CJK_PUNCT = (
    "\u3000-\u3004\u3008-\u3020\u3030-\u303f"  # ideographic space, 、。〈〉《》「」『』【】〔〕 ...
    "\uff01-\uff0f\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65"  # fullwidth ！（），：；？ ...
    "\u00b7\u2014\u2018\u2019\u201c\u201d\u2026"  # · — ‘ ’ “ ” …
)
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PRETOKENIZE_PATTERN = f"[{_HAN}]+[{_CJK_PUNCT}]*\\n?|" + _GPT2_PATTERN


# ----------------------------------------------------------------------------------------------------------------
# Loading


def load_text_dataset(
    source: str | None,
    text_column: str = "text",
    validation_fraction: float = 0.005,
    seed: int = 0,
    limit: int | None = None,
) -> datasets.DatasetDict:
    """Load a text corpus as ``DatasetDict(train=..., validation=...)`` holding only ``text_column``.

    ``source``: None or ``"builtin"`` (Python's own ``pydoc_data`` reference prose, one document per topic, so a
    fresh install with no network still has a corpus); a directory of parquet/json/jsonl/txt files (files named
    ``train*`` / ``validation*`` (or ``valid``, ``val``, ``dev``) give the splits, ``test*`` files are ignored,
    otherwise every file is training data); a file path or comma-separated file paths; or a Hub dataset id
    (needs network). Text files are UTF-8, one document per blank-line separated paragraph; a file that is not
    UTF-8 is refused naming the file rather than decoded with replacement characters, which would silently
    teach the model mojibake.

    A missing validation split is carved from train with ``seed`` (``carve_validation``: the fraction, but at
    least 20k characters so a small corpus still gives a few evaluation blocks). Empty and
    whitespace-only documents are dropped. ``limit`` keeps the first ``limit`` documents of each split, for quick
    runs and tests, before the validation split is carved.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise DataError(f"validation_fraction={validation_fraction} must be in (0, 1); e.g. 0.005")
    splits = _load_splits(source, text_column)
    name = source or BUILTIN
    for split, ds in splits.items():
        if text_column not in ds.column_names:
            raise DataError(
                f"dataset {name!r} ({split}) has no column {text_column!r} (columns: "
                f"{', '.join(ds.column_names)}); set --text_column to the column holding the text"
            )
        dtype = ds.features[text_column]
        if not (isinstance(dtype, datasets.Value) and dtype.dtype in ("string", "large_string")):
            raise DataError(
                f"column {text_column!r} of dataset {name!r} holds {dtype}, not text; set --text_column to a "
                f"string column (columns: {', '.join(ds.column_names)})"
            )
    splits = {k: v.select_columns([text_column]) for k, v in splits.items()}
    if limit is not None:
        splits = {k: v.select(range(min(limit, len(v)))) for k, v in splits.items()}
    splits = {k: _drop_empty(v, text_column) for k, v in splits.items()}
    train = splits["train"]
    if "validation" in splits:
        validation = splits["validation"]
    else:
        train, validation = carve_validation(train, text_column, validation_fraction, seed, name)
    if len(train) == 0 or len(validation) == 0:
        empty = "train" if len(train) == 0 else "validation"
        raise DataError(f"dataset {name!r}: its {empty} split holds no non-empty document (rows: "
                        f"{len(splits.get(empty, train))}); fill it, or remove its files (a validation split is then "
                        "carved from train)")
    return datasets.DatasetDict(train=train, validation=validation)


MIN_VALIDATION_CHARS = 20_000


def carve_validation(
    ds: datasets.Dataset, text_column: str, validation_fraction: float, seed: int, name: str = "dataset"
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Split off a validation set of random documents (fixed ``seed``): at least ``validation_fraction`` of the
    documents and at least ``MIN_VALIDATION_CHARS`` characters, so that a small corpus (the builtin one has 79
    documents, some of 200 characters) still yields a few evaluation blocks; never more than half the corpus."""
    n = len(ds)
    if n < 2:
        raise DataError(
            f"dataset {name!r} has {n} non-empty document(s); need at least 2 to carve a validation split "
            f"(add data, raise --limit, or provide a validation file)"
        )
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(1, math.ceil(validation_fraction * n))
    window = order[: max(n_val, min(n // 2, 4096))]  # enough documents to reach the character floor
    lengths = pc.utf8_length(ds.select(window).with_format("arrow")[text_column]).to_numpy(zero_copy_only=False)
    reached = np.flatnonzero(np.cumsum(lengths) >= MIN_VALIDATION_CHARS)
    n_val = max(n_val, int(reached[0]) + 1 if len(reached) else len(window))
    n_val = min(n_val, n - 1)
    return ds.select(np.sort(order[n_val:])), ds.select(np.sort(order[:n_val]))


def builtin_corpus() -> list[str]:
    """Python's ``pydoc_data.topics.topics``: ~465k characters of English prose present in every CPython."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _load_splits(source: str | None, text_column: str) -> dict[str, datasets.Dataset]:
    """Return the splits the source has (``train`` always, ``validation`` when present)."""
    if not source or source == BUILTIN:
        return {"train": datasets.Dataset.from_dict({text_column: builtin_corpus()})}
    paths = [Path(p.strip()).expanduser() for p in source.split(",") if p.strip()]
    if len(paths) == 1 and paths[0].is_dir():
        files = sorted(p for p in paths[0].rglob("*") if p.is_file() and p.suffix.lower() in _BUILDERS)
        files = [f for f in files if not any(part.startswith(".") for part in f.relative_to(paths[0]).parts)]
        if not files:
            raise MissingPathError(
                f"no {'/'.join(sorted(_BUILDERS))} files in directory {paths[0]}; point --dataset at a directory "
                f"or files with text"
            )
        return _load_files(files, text_column, root=paths[0])
    if paths and all(p.is_file() for p in paths):
        return _load_files(paths, text_column)
    missing = [str(p) for p in paths if not p.exists()]
    if len(paths) > 1 and not missing:
        raise DataError(f"{source!r} mixes directories and files; pass one directory, or files separated by commas")
    if len(paths) > 1 or source.startswith((".", "/", "~")) or Path(source).suffix.lower() in _BUILDERS:
        raise MissingPathError(f"dataset path(s) not found: {', '.join(missing)}; check --dataset")
    return _load_hub(source)


def _split_of(path: Path, root: Path | None = None) -> str | None:
    """Split named by a file's name the way the Hub names them (``train-00000-of-00001.parquet``), or by a folder
    under the dataset directory ``root`` (``data/train/part-0.parquet``)."""
    folders = [p.lower() for p in path.relative_to(root).parent.parts] if root is not None else []
    for split, names in _SPLIT_NAMES.items():
        if any(re.match(rf"{n}([-_.\d]|$)", path.name.lower()) for n in names):
            return split
    for folder in reversed(folders):
        for split, names in _SPLIT_NAMES.items():
            if folder in names:
                return split
    return None


def _load_files(files: Sequence[Path], text_column: str, root: Path | None = None) -> dict[str, datasets.Dataset]:
    builders = {_BUILDERS.get(f.suffix.lower()) for f in files}
    if None in builders:
        bad = [str(f) for f in files if f.suffix.lower() not in _BUILDERS]
        raise DataError(f"unsupported file type: {', '.join(bad)}; use {'/'.join(sorted(_BUILDERS))} files")
    if len(builders) > 1:
        raise DataError(
            f"files of several types ({', '.join(sorted({f.suffix for f in files}))}); point --dataset at files "
            f"of one type"
        )
    builder = builders.pop()
    if builder in ("text", "json"):
        for f in files:
            _check_utf8(f)
    by_split: dict[str, list[str]] = {}
    for f in files:
        by_split.setdefault(_split_of(f, root) or "train", []).append(str(f))
    by_split.pop("test", None)
    if "train" not in by_split:
        raise DataError(
            f"no training files among {', '.join(map(str, files))}; name them train*.{builder} or pass them "
            f"explicitly"
        )
    from .files import check_files, explain_load_error

    for split, names in by_split.items():
        check_files(names, split)  # 0-byte files, unreadable or 0-row parquet: one line naming the file
    kwargs: dict[str, Any] = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        loaded = datasets.load_dataset(builder, data_files=by_split, **kwargs)
    except (Exception, StopIteration) as err:  # datasets wraps the cause (a bad jsonl line...) in a generic error
        raise explain_load_error(err, [f for names in by_split.values() for f in names]) from err
    out = dict(loaded.items())
    if builder == "text" and text_column != "text":
        out = {k: v.rename_column("text", text_column) for k, v in out.items()}
    return out


def _load_hub(repo_id: str) -> dict[str, datasets.Dataset]:
    """Load a Hub dataset (network). Its validation split may be called validation, valid or dev."""
    try:
        loaded = datasets.load_dataset(repo_id)
    except Exception as e:  # network, auth, unknown id: one line naming what to do
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(
            f"{repo_id!r} is no local path, and loading it from the Hub failed ({type(e).__name__}: {first}); "
            f"pass an existing directory or file, or --dataset builtin"
        ) from e
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    out: dict[str, datasets.Dataset] = {}
    for split, ds in loaded.items():
        canonical = next((s for s, names in _SPLIT_NAMES.items() if split.lower() in names), None)
        if canonical in ("train", "validation") and canonical not in out:
            out[canonical] = ds
    if "train" not in out:
        raise DataError(f"dataset {repo_id!r} has no train split (splits: {', '.join(loaded)}); pick another")
    return out


def _check_utf8(path: Path, chunk_bytes: int = 1 << 20) -> None:
    """Refuse a file that is not UTF-8, naming the file and byte offset (streamed: constant memory)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path} is not UTF-8 (byte {offset + e.start}); convert it, e.g. "
                    f"`iconv -f GB18030 -t UTF-8 {path.name} > {path.stem}.utf8{path.suffix}`"
                ) from None
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(f"{path} is not UTF-8 (truncated character at its end); convert or repair it") from None


def _is_nonempty(batch: dict[str, list], text_column: str) -> list[bool]:
    return [bool(t) and not t.isspace() for t in batch[text_column]]


def _drop_empty(ds: datasets.Dataset, text_column: str) -> datasets.Dataset:
    """Drop empty documents: they would only add a lone EOS to the packed stream."""
    return ds.filter(
        _is_nonempty,
        batched=True,
        batch_size=10_000,
        fn_kwargs={"text_column": text_column},
        desc="dropping empty documents",
    )


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    min_frequency: int = 2,
    show_progress: bool = True,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer; returns a ``transformers.PreTrainedTokenizerFast``.

    Byte level: the 256 byte symbols are the initial alphabet, so any Unicode string encodes without an unknown
    token and ``decode(encode(text)) == text``. ``<|endoftext|>`` is token 0 and serves as eos, bos, unk and pad
    (the GPT config's ``eos_token_id`` default). The pre-tokenizer (``PRETOKENIZE_PATTERN``) keeps CJK runs whole
    so merges form whole characters, common words and line endings. CPU time (2 cores): ~3 min for the full
    zh-poetry train split (13M characters; 1.52 characters per token at vocab 32000, 1.24 at 8000) and ~30 s
    for 30k poems (1.35 / 1.15): pass a sample of documents for quick runs.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise DataError(f"vocab_size={vocab_size} is below 257 (256 bytes + {EOS_TOKEN}); use e.g. 8000 or 32000")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    length = len(texts) if hasattr(texts, "__len__") else None
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,  # would rewrite " ," to "," and break the round trip
    )


def check_vocab(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """Refuse a model whose embedding table is smaller than the tokenizer: ids past it crash on the GPU with an
    opaque device-side assert. A larger table (padded to a multiple of 64 for speed) is fine."""
    n = len(tokenizer)
    if n > vocab_size:
        raise DataError(
            f"tokenizer has {n} tokens but the model's vocab_size is {vocab_size}; set --vocab_size {n} (or more) "
            f"or train the tokenizer with vocab_size {vocab_size}"
        )


# ----------------------------------------------------------------------------------------------------------------
# Packing


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
            from ..integrity import atomic_write_json, sha256_file

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


from ..tasks.settings import DATA_ORDERS  # noqa: E402  (one list: the settings validate it before any data loads)


class WindowOrder:
    """Start offsets of the training windows of optimizer step ``k``: a function of ``(seed, k)`` alone.

    ``shifted`` (default): every epoch cuts the stream at a new random offset into windows of ``window`` tokens and
    visits them in a new random order, so each token is seen once per epoch but never twice in the same context.
    ``random``: nanoGPT's ``get_batch``, every start drawn uniformly and independently. ``fixed``: the same blocks
    every epoch (offset 0), in a new order; on a small corpus seen for many epochs this memorises the blocks
    (measured: validation rose after 12 epochs of zh-poetry, see benchmarks/RESULTS.md).
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


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """Content hash of a tokenizer: its full serialized form when it is a fast tokenizer, else its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        content = backend.to_str()
    else:
        content = json.dumps(tokenizer.get_vocab(), sort_keys=True, ensure_ascii=False)
    content += f"|eos={tokenizer.eos_token_id}|n={len(tokenizer)}"
    return hashlib.sha256(content.encode("utf-8")).hexdigest()[:16]


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


def default_cache_dir() -> Path:
    """``$HF_CGPU_CACHE/packed``, else ``~/.cache/hf_cgpu/packed``: outside the output directory, so runs on the
    same corpus share one packed file."""
    from ..bench import cache_dir

    return cache_dir() / "packed"


TOKENIZER_KEY = "hf_cgpu_tokenizer.json"
"""Beside a tokenizer hf_cgpu trained (in an output folder or the cache): what it was trained from."""
TOKENIZER_RECIPE = {"model": "byte-level BPE", "pretokenize": PRETOKENIZE_PATTERN, "min_frequency": 2,
                    "special_tokens": [EOS_TOKEN]}
"""What ``train_tokenizer`` does beyond its inputs: part of the tokenizer cache's key, so a change here (or in the
tokenizers version) trains anew instead of reusing a tokenizer made another way."""


def tokenizer_made_from(folder: Path) -> dict[str, Any] | None:
    """The ``TOKENIZER_KEY`` that ``save_tokenizer`` wrote beside the tokenizer in ``folder`` (None: none, or
    unreadable)."""
    try:
        return json.loads((folder / TOKENIZER_KEY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path, made_from: dict[str, Any]) -> None:
    """``tokenizer`` and what it was made from, written whole (a kill never leaves a 0-byte tokenizer_config.json)."""
    from ..integrity import atomic_dir, atomic_write_json

    with atomic_dir(folder) as tmp:
        tokenizer.save_pretrained(str(tmp))
        atomic_write_json(tmp / TOKENIZER_KEY, made_from)


def cached_tokenizer(key: dict[str, Any], cache_dir: str | os.PathLike | None,
                     train: Callable[[], PreTrainedTokenizerFast]) -> tuple[PreTrainedTokenizerFast, Path | None]:
    """The tokenizer an earlier run trained from the same ``key`` (the data's fingerprint and the settings), from
    ``<cache>/tokenizers/bpe-<hash>`` (``<cache>``: ``cache_dir`` or ``$HF_CGPU_CACHE``, as the packed tokens), with
    the folder it came from; else ``train()``'s, stored there for the next run (None: trained now). Training the
    8k zh-poetry tokenizer takes ~17 s on 2 cores, every fresh ``--output_dir``; a damaged entry is trained again and
    replaced, a read-only or full cache only costs the training."""
    import tokenizers
    from transformers import AutoTokenizer

    from ..bench import cache_dir as default_root

    full = {**key, **TOKENIZER_RECIPE, "tokenizers": tokenizers.__version__}
    digest = hashlib.sha256(json.dumps(full, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]
    folder = (Path(cache_dir) if cache_dir else default_root()) / "tokenizers" / f"bpe-{digest}"
    if tokenizer_made_from(folder) == full:
        try:
            return AutoTokenizer.from_pretrained(str(folder)), folder
        except Exception:  # damaged on disk (json and tokenizers errors alike): trained again and replaced
            pass
    tok = train()
    try:
        save_tokenizer(tok, folder, full)
    except OSError:
        pass
    return tok, None


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
    ``default_cache_dir()``.
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
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
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
    from ..integrity import atomic_write_json

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


__all__ = [
    "EOS_TOKEN",
    "TOKENIZER_KEY",
    "TOKENIZER_RECIPE",
    "cached_tokenizer",
    "save_tokenizer",
    "tokenizer_made_from",
    "PRETOKENIZE_PATTERN",
    "DATA_ORDERS",
    "PackedTokens",
    "WindowOrder",
    "builtin_corpus",
    "carve_validation",
    "check_vocab",
    "default_cache_dir",
    "eval_windows",
    "load_text_dataset",
    "pack_dataset",
    "source_fingerprint",
    "tokenizer_hash",
    "train_tokenizer",
]
