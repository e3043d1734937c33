"""Data files checked before ``datasets`` reads them, so that a bad file ends in one line naming it (and the row).

``datasets`` reports a 0-byte parquet shard as "An error occurred while generating the dataset", a 0-byte jsonl as a
bare ``StopIteration``, a bad jsonl line as a generation error whose cause is three exceptions down, and a 0-row split
as 'Instruction "validation" corresponds to no data!'. ``check_files`` finds those before the load (parquet footers
are read, not the data); ``explain_load_error`` turns what still fails into a ``DataError`` with the file and line.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

from ..errors import DataError


def parquet_rows(path: Path) -> int:
    """Rows of a parquet file from its footer; a file that has none is refused, naming it."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(str(path)).metadata.num_rows
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ...
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"{path} is not a readable parquet file ({first[:160]}); re-download or remove it") from None


def check_files(files: Sequence[str | Path], split: str | None = None) -> int:
    """Every file non-empty and (parquet) readable; returns the parquet rows (0 for other types). A split whose
    parquet files hold no row at all is refused, naming them."""
    rows, parquet = 0, []
    for f in map(Path, files):
        if not f.is_file():
            raise DataError(f"{f} is not a file; check --dataset")
        if f.stat().st_size == 0:
            raise DataError(f"{f} is empty (0 bytes); remove it or write it again")
        if f.suffix.lower() == ".parquet":
            parquet.append(f)
            rows += parquet_rows(f)
    if parquet and len(parquet) == len(files) and rows == 0:
        name = f"the {split} split" if split else "the data"
        raise DataError(f"{name} has 0 rows ({', '.join(map(str, parquet))}); remove the file(s) or fill them")
    return rows


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """An object's fields (``json.loads``' ``object_pairs_hook``), refusing a key given twice as pyarrow does."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice in one object; keep one")
        seen.add(key)
    return dict(pairs)


def bad_json_line(path: Path) -> str | None:
    """'<file> line N: ...' for the first line of a JSON-lines file that does not parse as ``datasets`` (pyarrow)
    reads it: no valid JSON, a key twice in one object, a string with an unpaired UTF-16 surrogate escape
    (``"\\ud800"``). None: every line parses; a file holding one JSON document is checked as a whole."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
            return None
        except json.JSONDecodeError as err:
            return f"{path} line {err.lineno}: not valid JSON ({err.msg})"
    rows = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as err:
            return f"{path} line {n}: not valid JSON ({err.msg}); fix or remove that line"
        except ValueError as err:
            return f"{path} line {n}: {err}"
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return (f"{path} line {n}: a string holds an unpaired UTF-16 surrogate escape (\\ud800 to \\udfff), "
                    "which is no text; fix or remove that line")
        if not isinstance(obj, dict):
            return f"{path} line {n}: a JSON {type(obj).__name__}, not an object with named fields; fix that line"
        rows += 1
    if rows == 0:
        return f"{path} holds no JSON row (only blank lines); remove it or fill it"
    return None


def json_kind(value) -> str:
    """What a JSON value is, for a message about a field that should hold text: "a number (5)", "a list"."""
    if value is None:
        return "null (or missing)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def file_rows(path: Path) -> int:
    """Rows ``datasets`` reads from one file: a parquet footer's count, a JSON array's items, or the non-blank lines
    of a JSON-lines file."""
    if path.suffix.lower() == ".parquet":
        return parquet_rows(path)
    with open(path, encoding="utf-8", errors="replace") as fh:
        head = fh.read(4096).lstrip()
        fh.seek(0)
        if head.startswith("["):
            return len(json.load(fh))
        return sum(1 for line in fh if line.strip())


def locate_row(files: Sequence[str | Path], index: int) -> str | None:
    """'row R of <file>, line L' for row ``index`` of a split read from ``files`` in order (None: the files hold
    fewer rows). R counts from 0 within the file, as ``datasets`` does; L is the file's line for JSON lines."""
    for f in map(Path, files):
        n = file_rows(f)
        if index >= n:
            index -= n
            continue
        where = f"row {index} of {f}"
        if f.suffix.lower() in (".json", ".jsonl"):
            with open(f, encoding="utf-8", errors="replace") as fh:
                if not fh.read(4096).lstrip().startswith("["):
                    fh.seek(0)
                    numbers = (number for number, line in enumerate(fh, 1) if line.strip())
                    where += f", line {next(itertools.islice(numbers, index, None))}"
        return where
    return None


def explain_load_error(err: BaseException, files: Sequence[str | Path]) -> DataError:
    """A one-line DataError for a ``datasets.load_dataset`` failure on local ``files``."""
    for f in map(Path, files):
        if f.suffix.lower() in (".json", ".jsonl"):
            bad = bad_json_line(f)
            if bad:
                return DataError(bad)
    cause = err
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    if "corresponds to no data" in first:
        return DataError(f"a split of {', '.join(map(str, files))} is empty ({first}); remove or fill its files")
    return DataError(f"cannot read {', '.join(map(str, files))[:300]} ({type(cause).__name__}: {first[:200]}); "
                     "check or re-create these files")


__all__ = ["bad_json_line", "check_files", "explain_load_error", "file_rows", "json_kind", "locate_row",
           "parquet_rows"]
