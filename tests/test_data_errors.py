"""Bad data ends in one line naming the file, row, split or setting to fix: a non-string text row, a missing image
split, an image file that does not decode, a too-short validation split, a file in another encoding, null rows, a
lost tokenizer_config.json. (Instruction rows whose fields are not text: tests/test_instruct.py.)"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from hf_cgpu.cli import main as cli_main
from hf_cgpu.data.corpus import builtin_corpus, load_text_dataset
from hf_cgpu.data.images import load_image_dataset
from hf_cgpu.data.tokenizer import cached_tokenizer, train_tokenizer
from hf_cgpu.errors import CheckpointError, DataError

DOCS = builtin_corpus()[:40]


def error_line(argv: list[str], capsys, monkeypatch) -> str:
    """The one ``error:`` line (exit code 2) of ``hf-cgpu ARGV``; progress bars before it are ignored."""
    monkeypatch.delenv("HF_CGPU_DEBUG", raising=False)
    assert cli_main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def write_jsonl(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---------------------------------------------------------------------------------------------------- text corpora
def test_a_non_string_text_row_is_named_by_file_row_and_line(tmp_path, capsys, monkeypatch):
    write_jsonl(tmp_path / "data" / "train.jsonl", [{"text": 5 if i == 12 else t} for i, t in enumerate(DOCS)])
    line = error_line(["train", "gpt", "--preset", "tiny", "--dataset", str(tmp_path / "data"), "--max_steps", "1",
                       "--vocab_size", "300", "--seq_len", "32", "--output_dir", str(tmp_path / "out")],
                      capsys, monkeypatch)
    assert f"row 12 of {tmp_path / 'data' / 'train.jsonl'}, line 13" in line
    assert "'text' is a number (5), not a string" in line


@pytest.mark.parametrize("bad, why", [
    ('"text": "one", "text": "two"', "key 'text' appears twice in one object; keep one"),
    ('"text": "half a pair \\ud800 here"', "a string holds an unpaired UTF-16 surrogate escape"),
    ('"text": "x", "meta": {"k\\udc00": 1}', "a string holds an unpaired UTF-16 surrogate escape"),
], ids=["duplicate-key", "lone-surrogate", "surrogate-in-a-nested-key"])
@pytest.mark.parametrize("instruct", [False, True], ids=["text", "instructions"])
def test_a_jsonl_line_pyarrow_refuses_is_named_by_its_line(bad, why, instruct, tmp_path):
    """pyarrow refuses a key given twice and an unpaired surrogate escape, which Python's json reads: the error names
    that line (5), for a text corpus and for instruction rows (text + output); a surrogate pair is text and loads."""
    from hf_cgpu.data.instruct import instruction_splits

    column, extra = ("instruction", ', "output": "ok"') if instruct else ("text", "")
    lines = ["{" + json.dumps({column: d})[1:-1] + extra + "}" for d in DOCS[:8]]
    path = tmp_path / "data" / "train.jsonl"
    path.parent.mkdir()

    def load(line: str):
        line = "{" + line.replace('"text"', f'"{column}"') + extra + "}"
        path.write_text("\n".join([*lines[:4], line, *lines[5:]]) + "\n")
        return instruction_splits(str(path.parent), "instruct") if instruct else load_text_dataset(str(path.parent))

    with pytest.raises(DataError) as err:
        load(bad)
    assert str(err.value).startswith(f"{path} line 5: {why.replace('text', column)}"), str(err.value)
    load('"text": "a pair \\ud83d\\ude00 is text"')


def test_a_too_short_validation_split_is_named_with_its_tokens(tmp_path, capsys, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text("\n\n".join(DOCS))
    (tmp_path / "data" / "validation.txt").write_text("short text here")
    line = error_line(["train", "gpt", "--preset", "tiny", "--dataset", str(tmp_path / "data"), "--max_steps", "1",
                       "--vocab_size", "300", "--seq_len", "32", "--output_dir", str(tmp_path / "out")],
                      capsys, monkeypatch)
    assert "the validation split has only" in line and "fewer than the 33 (seq_len + 1)" in line
    tokens = int(line.split("has only ")[1].split()[0])
    assert 0 < tokens < 33 and f"--seq_len to {tokens - 1} or less" in line


def test_null_text_rows_are_counted_per_split_in_one_line(tmp_path):
    pq.write_table(pa.table({"text": [None if i % 10 == 3 else t for i, t in enumerate(DOCS)]}),
                   tmp_path / "train.parquet")
    pq.write_table(pa.table({"text": [*DOCS[:10], None, "  "]}), tmp_path / "validation.parquet")
    lines = []
    ds = load_text_dataset(str(tmp_path), log=lines.append)
    assert len(ds["train"]) == 36 and len(ds["validation"]) == 10
    assert lines == [(f"note: dataset {str(tmp_path)!r}: dropped 4 null rows of train, 1 null and 1 blank rows of "
                      "validation")]
    lines.clear()
    ds = load_text_dataset("builtin", log=lines.append)
    n = len(ds["train"]) + len(ds["validation"])
    assert lines == [f"note: dataset 'builtin' has no validation split: {len(ds['validation'])} of its {n} documents "
                     "are held out as one (the same documents in every run and in hf-cgpu eval)"]  # nothing dropped


@pytest.mark.parametrize("name, data, advice, not_advised", [
    ("latin1.txt", ("Café crème à la française, naïve façade. " * 40).encode("latin-1"),
     "iconv -f CP1252 -t UTF-8 latin1.txt", "GB18030"),
    ("gbk.txt", ("床前明月光，疑是地上霜。举头望明月，低头思故乡。\n\n" * 40).encode("gbk"),
     "iconv -f GB18030 -t UTF-8 gbk.txt", "CP1252"),
    ("sjis.txt", ("日本語のテキストです。これはテストです。\n\n" * 40).encode("shift_jis"),
     "iconv -f SHIFT_JIS -t UTF-8 sjis.txt", "GB18030"),
    ("euckr.txt", ("한국어 텍스트입니다. 이것은 시험입니다.\n\n" * 40).encode("euc-kr"),
     "GB18030 (Chinese) or EUC-KR (Korean)", "CP1252"),  # both decode: both named, neither chosen
    ("noise.txt", bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)),
     "iconv -f <its encoding> -t UTF-8 noise.txt", "CP1252"),
    ("damaged.txt", ("床前明月光，疑是地上霜。\n\n" * 40).encode() + b"\xff" + ("举头望明月\n\n" * 40).encode(),
     "the text around it is UTF-8", "iconv"),
])
def test_a_file_in_another_encoding_is_advised_by_what_its_bytes_look_like(tmp_path, name, data, advice,
                                                                            not_advised):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(DataError) as e:
        load_text_dataset(str(tmp_path / name))
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / name} is not UTF-8 (byte ") and "\n" not in msg
    assert advice in msg and not_advised not in msg


# ---------------------------------------------------------------------------------------------------- tokenizer files
@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(DOCS[:10], vocab_size=300, show_progress=False).save_pretrained(folder)
    return folder


def test_a_deleted_tokenizer_config_is_named_not_blamed_on_the_eos_token(saved_tokenizer, tmp_path, capsys,
                                                                         monkeypatch):
    folder = tmp_path / "tok"
    shutil.copytree(saved_tokenizer, folder)
    (folder / "tokenizer_config.json").unlink()
    line = error_line(["train", "gpt", "--preset", "tiny", "--dataset", "builtin", "--tokenizer", str(folder),
                       "--max_steps", "1", "--seq_len", "32", "--output_dir", str(tmp_path / "out")],
                      capsys, monkeypatch)
    assert f"{folder / 'tokenizer_config.json'} is missing" in line and "copy that file back" in line
    (folder / "tokenizer_config.json").write_text("{not json")
    line = error_line(["train", "gpt", "--preset", "tiny", "--dataset", "builtin", "--tokenizer", str(folder),
                       "--max_steps", "1", "--seq_len", "32", "--output_dir", str(tmp_path / "out")],
                      capsys, monkeypatch)
    assert f"{folder / 'tokenizer_config.json'} is unreadable" in line


def test_a_resumed_run_whose_tokenizer_lost_its_config_names_the_file(saved_tokenizer, tmp_path):
    from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings

    shutil.copytree(saved_tokenizer, tmp_path / "tokenizer")
    (tmp_path / "tokenizer" / "tokenizer_config.json").unlink()
    task = CausalLMTask(GPTSettings(vocab_size=300, cache_dir=str(tmp_path / "cache")))
    with pytest.raises(CheckpointError) as e:
        task._tokenizer(load_text_dataset("builtin"), tmp_path, resume=True, log=lambda line: None)
    assert f"{tmp_path / 'tokenizer' / 'tokenizer_config.json'} is missing" in str(e.value)


def test_a_cached_tokenizer_that_lost_its_config_is_trained_again(tmp_path):
    def train():
        return train_tokenizer(DOCS[:10], vocab_size=300, show_progress=False)

    key = {"vocab_size": 300, "source": "x"}
    cached_tokenizer(key, tmp_path, train)
    (folder,) = (tmp_path / "tokenizers").iterdir()
    (folder / "tokenizer_config.json").unlink()
    calls = []
    tok, came_from = cached_tokenizer(key, tmp_path, lambda: calls.append(1) or train())
    assert came_from is None and calls == [1] and tok.eos_token_id is not None
    tok, came_from = cached_tokenizer(key, tmp_path, lambda: pytest.fail("the replaced entry must load"))
    assert came_from == folder and tok.eos_token_id is not None


# ---------------------------------------------------------------------------------------------------- images
def test_a_missing_test_split_is_named_not_blamed_on_train(synthetic_data, tmp_path):
    shutil.copy(synthetic_data / "train.parquet", tmp_path / "train.parquet")
    with pytest.raises(DataError) as e:
        load_image_dataset(str(tmp_path), split="test", use_cache=False)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path} has no test split") and "(splits found: train)" in msg
    assert str(tmp_path / "test.parquet") in msg and "train.parquet" not in msg and "\n" not in msg


def test_a_corrupt_png_in_an_image_folder_is_named_by_its_path(tmp_path):
    rng = np.random.default_rng(0)
    for k in range(2):
        (tmp_path / "train" / f"c{k}").mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "train" / f"c{k}" /
                                                                                    f"{i}.png")
    bad = tmp_path / "train" / "c1" / "4.png"
    data = bad.read_bytes()
    bad.write_bytes(data[:60] + b"\0" * 40 + data[100:])
    with pytest.raises(DataError) as e:
        load_image_dataset(str(tmp_path), split="train", image_column="image", use_cache=False)
    msg = str(e.value)
    assert msg.startswith(f"{bad} (") and "does not decode" in msg and "remove or replace that file" in msg
