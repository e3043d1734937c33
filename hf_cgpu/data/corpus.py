"""Text corpora: a folder or files of parquet/json/jsonl/txt, a Hub dataset, or the corpus every CPython carries, as
``DatasetDict(train=..., validation=...)`` of one text column (a validation split carved from train when there is
none)."""

from __future__ import annotations

import codecs
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc

from ..errors import DataError, MissingPathError
from .files import check_files, explain_load_error, json_kind, locate_row

BUILTIN = "builtin"

TEXT_FILE_FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text"}
"""File extension -> the ``datasets`` builder that reads it: the text file formats a corpus folder may hold. Text files
are read by paragraph (blank-line separated documents)."""
_SPLIT_NAMES = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test",),
}


def load_text_dataset(
    source: str | None,
    text_column: str = "text",
    validation_fraction: float = 0.005,
    seed: int = 0,
    limit: int | None = None,
    log: Callable[[str], None] | None = None,
    carve: bool = True,
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
    least 20k characters so a small corpus still gives a few evaluation blocks). Null, empty and whitespace-only
    documents are dropped, counted per split in one line to ``log`` (default: stderr). ``limit`` keeps the first
    ``limit`` documents of each split, for quick runs and tests, before the validation split is carved.
    ``carve`` False (evaluating files named one by one): a source without a validation split is its own validation
    split, whole.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise DataError(f"validation_fraction={validation_fraction} must be in (0, 1); e.g. 0.005")
    splits = load_splits(source, text_column)
    named = named_as_train(source) if carve else ""
    if named:
        (log or _stderr)(named)
    name = source or BUILTIN
    for split, ds in splits.items():
        if text_column not in ds.column_names:
            raise DataError(
                f"dataset {name!r} ({split}) has no column {text_column!r} (columns: "
                f"{', '.join(ds.column_names)}); set --text_column to the column holding the text"
            )
        dtype = ds.features[text_column]
        if not (isinstance(dtype, datasets.Value) and dtype.dtype in ("string", "large_string")):
            _refuse_non_text(ds, text_column, dtype, split, source, name)
    splits = {k: v.select_columns([text_column]) for k, v in splits.items()}
    if limit is not None:
        splits = {k: v.select(range(min(limit, len(v)))) for k, v in splits.items()}
    kept = {k: _drop_empty(v, text_column) for k, v in splits.items()}
    dropped = [_dropped(splits[k], kept[k], text_column, k) for k in splits]
    if any(dropped):
        (log or _stderr)(f"note: dataset {name!r}: dropped {', '.join(d for d in dropped if d)}")
    splits = kept
    train = splits["train"]
    if "validation" in splits:
        validation = splits["validation"]
    elif carve:
        train, validation = carve_validation(train, text_column, validation_fraction, seed, name)
        if not named:  # that note already says so
            (log or _stderr)(f"note: dataset {name!r} has no validation split: {len(validation):,} of its "
                             f"{len(splits['train']):,} documents are held out as one (the same documents in every "
                             "run and in hf-cgpu eval)")
    else:
        validation = train
    if len(train) == 0 or len(validation) == 0:
        empty = "train" if len(train) == 0 else "validation"
        raise DataError(f"dataset {name!r}: its {empty} split holds no non-empty document (rows: "
                        f"{len(splits.get(empty, train))}); fill it, or remove its files (a validation split is then "
                        "carved from train)")
    return datasets.DatasetDict(train=train, validation=validation)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _refuse_non_text(ds: datasets.Dataset, text_column: str, dtype: Any, split: str, source: str | None,
                     name: str) -> None:
    """A text column that is not all strings: the first row holding something else (a JSON file mixing strings
    with numbers or lists), or the column's type (a column of another type), naming the file."""
    files = split_files(source).get(split, [])
    if isinstance(dtype, datasets.Json):
        values = ds[text_column]
        row = next((i for i, v in enumerate(values) if not (v is None or isinstance(v, str))), None)
        if row is not None:
            where = locate_row(files, row) or f"row {row} of the {split} split of {name!r}"
            raise DataError(f"{where}: {text_column!r} is {json_kind(values[row])}, not a string; make it text or "
                            "remove that row")
    where = ", ".join(map(str, files)) or f"dataset {name!r} ({split})"
    raise DataError(f"column {text_column!r} of {where} holds {dtype}, not text; set --text_column to a string "
                    f"column (columns: {', '.join(ds.column_names)})")


def _dropped(before: datasets.Dataset, after: datasets.Dataset, text_column: str, split: str) -> str:
    """'3 null and 2 blank rows of train' ('' when none was dropped)."""
    nulls = before.with_format("arrow")[text_column].null_count
    blank = len(before) - len(after) - nulls
    parts = [f"{nulls} null" if nulls else "", f"{blank} blank" if blank else ""]
    if not nulls and not blank:
        return ""
    return f"{' and '.join(p for p in parts if p)} row{'s' if nulls + blank > 1 else ''} of {split}"


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


def load_splits(source: str | None, text_column: str) -> dict[str, datasets.Dataset]:
    """Return the splits the source has (``train`` always, ``validation`` when present)."""
    if not source or source == BUILTIN:
        _no_columns(text_column, "the builtin corpus (no --dataset given) has", "pass --dataset with your data")
        return {"train": datasets.Dataset.from_dict({"text": builtin_corpus()})}
    local = _local_files(source)
    if local is None:
        return _load_hub(source)
    return _load_files(*local, text_column)


def _no_columns(text_column: str, what: str, fix: str) -> None:
    """Text without columns (the builtin corpus, .txt files) is read into the column ``text``; another
    ``--text_column`` would be ignored, so it is refused."""
    if text_column != "text":
        raise DataError(f"--text_column {text_column}: {what} no columns; {fix}, or leave --text_column out")


def named_as_train(source: str | None) -> str:
    """The note for files named on the command line of which none is training data by its name, which are all
    trained on (``_by_split``); '' otherwise."""
    local = _local_files(source) if source and source != BUILTIN else None
    if local is None or local[1] is not None or any(_split_of(f) in (None, "train") for f in local[0]):
        return ""
    return (f"note: {source} is trained on as the train split, as named on the command line; a validation split is "
            "carved from it (pass it after a train* file, comma-separated, to validate on it instead)")


def split_files(source: str | None) -> dict[str, list[Path]]:
    """The local files each split is read from, in the order ``load_splits`` reads them ({} for builtin or a Hub
    id): row ``i`` of a split is row ``i`` of these files laid end to end."""
    if not source or source == BUILTIN:
        return {}
    local = _local_files(source)
    return _by_split(*local) if local is not None else {}


def _local_files(source: str) -> tuple[list[Path], Path | None] | None:
    """The text files of a local source and the folder they were found in (None: a Hub id)."""
    paths = [Path(p.strip()).expanduser() for p in source.split(",") if p.strip()]
    if len(paths) == 1 and paths[0].is_dir():
        files = sorted(p for p in paths[0].rglob("*") if p.is_file() and p.suffix.lower() in TEXT_FILE_FORMATS)
        files = [f for f in files if not any(part.startswith(".") for part in f.relative_to(paths[0]).parts)]
        if not files:
            raise MissingPathError(
                f"no {'/'.join(sorted(TEXT_FILE_FORMATS))} files in directory {paths[0]}; point --dataset at a directory "
                f"or files with text"
            )
        return files, paths[0]
    if paths and all(p.is_file() for p in paths):
        return paths, None
    missing = [str(p) for p in paths if not p.exists()]
    if len(paths) > 1 and not missing:
        raise DataError(f"{source!r} mixes directories and files; pass one directory, or files separated by commas")
    if len(paths) > 1 or source.startswith((".", "/", "~")) or Path(source).suffix.lower() in TEXT_FILE_FORMATS:
        raise MissingPathError(f"dataset path(s) not found: {', '.join(missing)}; check --dataset")
    return None


def _by_split(files: Sequence[Path], root: Path | None = None) -> dict[str, list[Path]]:
    """Files by the split their names give (unnamed ones are training data); test files are left out. Files named
    one by one (no ``root``) of which none is training data by its name are all training data: they were named to
    be trained on (``--dataset data/validation.parquet``)."""
    by_split: dict[str, list[Path]] = {}
    for f in files:
        by_split.setdefault(_split_of(f, root) or "train", []).append(f)
    by_split.pop("test", None)
    if root is None and "train" not in by_split:
        return {"train": list(files)}
    return by_split


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


def _load_files(files: Sequence[Path], root: Path | None, text_column: str) -> dict[str, datasets.Dataset]:
    builders = {TEXT_FILE_FORMATS.get(f.suffix.lower()) for f in files}
    if None in builders:
        bad = [str(f) for f in files if f.suffix.lower() not in TEXT_FILE_FORMATS]
        raise DataError(f"unsupported file type: {', '.join(bad)}; use {'/'.join(sorted(TEXT_FILE_FORMATS))} files")
    if len(builders) > 1:
        raise DataError(
            f"files of several types ({', '.join(sorted({f.suffix for f in files}))}); point --dataset at files "
            f"of one type"
        )
    builder = builders.pop()
    if builder == "text":
        _no_columns(text_column, f".txt files ({', '.join(map(str, files))[:200]}: a document per paragraph) have",
                    "pass parquet/json/jsonl data with that column")
    if builder in ("text", "json"):
        for f in files:
            _check_utf8(f)
    by_split = {split: [str(f) for f in names] for split, names in _by_split(files, root).items()}
    if "train" not in by_split:
        raise DataError(
            f"no training files among {', '.join(map(str, files))}; name them train*.{builder} or pass them "
            f"explicitly"
        )
    for split, names in by_split.items():
        check_files(names, split)  # 0-byte files, unreadable or 0-row parquet: one line naming the file
    kwargs: dict[str, Any] = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        loaded = datasets.load_dataset(builder, data_files=by_split, **kwargs)
    except (Exception, StopIteration) as err:  # datasets wraps the cause (a bad jsonl line...) in a generic error
        raise explain_load_error(err, [f for names in by_split.values() for f in names]) from err
    return dict(loaded.items())


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
    """Refuse a file that is not UTF-8, naming the file and byte offset (streamed: constant memory), with a
    conversion that fits what its bytes look like (``_encoding_advice``)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise DataError(f"{path} is not UTF-8 (byte {offset + e.start}); "
                                f"{_encoding_advice(path, offset + e.start)}") from None
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(f"{path} is not UTF-8 (truncated character at its end); convert or repair it") from None


_EAST_ASIAN = re.compile("[\u1100-\u11ff\u3000-\u30ff\u3130-\u318f\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
                         "\uf900-\ufaff\uff00-\uffef]")
"""Han, kana, Hangul, CJK punctuation and fullwidth forms."""


def _encoding_advice(path: Path, offset: int, window: int = 1 << 20) -> str:
    """How to convert a file that is not UTF-8, judged from ``window`` bytes from its first bad byte (``offset``) on:
    UTF-16 where a byte-order mark says so; a damaged UTF-8 file where nearly all its non-ASCII bytes are UTF-8;
    the East Asian encodings whose decoding of the bytes reads as runs of CJK text (several named when several do:
    EUC-KR bytes are valid GB18030 too); Windows-1252 / Latin-1 where they decode as accented letters between ASCII
    ones; otherwise the generic advice, no guess."""
    with open(path, "rb") as f:
        bom = f.read(2)
        start = max(0, offset - 4096)
        f.seek(start)
        sample = f.read(window)
    if start:  # from a line start: a newline is never part of a multi-byte GB18030 or UTF-8 character
        sample = sample[sample.find(b"\n") + 1:]
    out = f"{path.stem}.utf8{path.suffix}"

    def iconv(encoding: str) -> str:
        return f"`iconv -f {encoding} -t UTF-8 {path.name} > {out}`"

    if bom in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
        return f"it starts with a UTF-16 byte-order mark: convert it, e.g. {iconv('UTF-16')}"
    as_utf8 = [c for c in codecs.getincrementaldecoder("utf-8")("ignore").decode(sample) if ord(c) > 127]
    utf8_bytes = sum(len(c.encode("utf-8")) for c in as_utf8)
    stray = sum(b > 127 for b in sample) - utf8_bytes
    if len(as_utf8) >= 10 and stray <= max(3, utf8_bytes // 100):
        return ("the text around it is UTF-8, so the file is damaged there (or mixes encodings): repair or remove "
                "those bytes")
    east = [f"{encoding} ({language})" for encoding, language in (("GB18030", "Chinese"), ("BIG5", "Chinese"),
                                                                  ("SHIFT_JIS", "Japanese"), ("EUC-KR", "Korean"))
            if _reads_as(sample, encoding, _looks_east_asian)]
    if len(east) == 1:
        return f"its bytes read as {east[0]} text: convert it, e.g. {iconv(east[0].split()[0])}"
    if east:
        names = " or ".join(e.split()[0] for e in east)
        return (f"its bytes read as {' or '.join(east)} text: convert it from the one it is in, "
                f"`iconv -f <{names}> -t UTF-8 {path.name} > {out}`")
    for encoding, name in (("CP1252", "Windows-1252"), ("LATIN1", "Latin-1")):
        if _reads_as(sample, encoding, _looks_western):
            return f"its bytes read as {name} text: convert it, e.g. {iconv(encoding)}"
    return (f"convert it to UTF-8 from the encoding it was written in, e.g. "
            f"`iconv -f <its encoding> -t UTF-8 {path.name} > {out}`")


def _reads_as(sample: bytes, encoding: str, looks_right) -> bool:
    """``sample`` decodes strictly in ``encoding`` (a character cut at its end aside) into text ``looks_right``
    accepts; GB18030 also needs most double-byte characters in GB2312's common range (A1-FE A1-FE), which
    Shift-JIS bytes, valid GB18030 as well, almost never are."""
    try:
        text = codecs.getincrementaldecoder(encoding.lower().replace("-", "_"))().decode(sample)
    except UnicodeDecodeError:
        return False
    if not looks_right(text):
        return False
    if encoding == "GB18030":
        pairs = [c.encode("gb18030") for c in text if ord(c) > 127]
        common = sum(len(b) == 2 and min(b) >= 0xA1 for b in pairs)
        return common >= 0.5 * len(pairs)
    return True


def _runs(text: str, is_wide) -> tuple[int, int]:
    """(characters ``is_wide``, those of them next to another such character)."""
    flags = [bool(is_wide(c)) for c in text]
    together = sum(f and ((i > 0 and flags[i - 1]) or (i + 1 < len(flags) and flags[i + 1]))
                   for i, f in enumerate(flags))
    return sum(flags), together


def _looks_east_asian(text: str) -> bool:
    """Mostly CJK characters, in runs: Latin-1 bytes read as GB18030 give lone CJK characters between ASCII ones."""
    wide = [c for c in text if ord(c) > 127]
    if not wide:
        return False
    cjk, together = _runs(text, _EAST_ASIAN.match)
    return cjk >= 0.9 * len(wide) and together >= 0.7 * cjk


_WESTERN_PUNCT = "\u2018\u2019\u201c\u201d\u2013\u2014\u2026\u00b7\u00a0\u00ab\u00bb\u00b0\u20ac"


def _looks_western(text: str) -> bool:
    """Its non-ASCII characters are mostly letters (é, ß, ñ) or common punctuation (’ “ – ·), and they sit
    mostly among ASCII ones: GBK or Shift-JIS bytes read as Windows-1252 give runs of symbols and accented capitals."""
    wide = [c for c in text if ord(c) > 127]
    if not wide:
        return False
    usual = sum(c.isalpha() or c in _WESTERN_PUNCT for c in wide)
    _, together = _runs(text, lambda c: ord(c) > 127)
    return usual >= 0.9 * len(wide) and together <= 0.5 * len(wide)


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


__all__ = ["BUILTIN", "MIN_VALIDATION_CHARS", "TEXT_FILE_FORMATS", "builtin_corpus", "carve_validation", "load_splits",
           "load_text_dataset", "named_as_train", "split_files"]
