"""Text data: corpus loading, byte-level BPE tokenizer, and the packed token cache."""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from functools import lru_cache
from pathlib import Path

import datasets
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_cgpu.data.corpus import load_text_dataset
from hf_cgpu.data.packing import pack_dataset
from hf_cgpu.data.tokenizer import EOS_TOKEN, check_vocab, train_tokenizer

ZH_POETRY = Path(__file__).resolve().parents[2] / "shared" / "data" / "zh-poetry"
needs_zh = pytest.mark.skipif(
    not (ZH_POETRY / "train.parquet").is_file(), reason=f"zh-poetry data not found at {ZH_POETRY} (../shared/data)"
)


@lru_cache(maxsize=None)
def byte_tokenizer():
    """Vocab 257 = 256 bytes + EOS, no merges: an ASCII document of length L is exactly L tokens."""
    return train_tokenizer(["abc"], vocab_size=257, show_progress=False)


@lru_cache(maxsize=None)
def english_tokenizer():
    from pydoc_data.topics import topics

    return train_tokenizer(list(topics.values()), vocab_size=1000, show_progress=False)


@lru_cache(maxsize=None)
def chinese_tokenizer():
    """Vocab 2000 trained on 3000 poems (a few seconds on 2 cores)."""
    import pyarrow.parquet as pq

    texts = pq.read_table(ZH_POETRY / "train.parquet", columns=["text"]).column("text").to_pylist()[:3000]
    return train_tokenizer(texts, vocab_size=2000, show_progress=False)


def zh_validation(n: int) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(ZH_POETRY / "validation.parquet", columns=["text"]).column("text").to_pylist()[:n]


def letter_docs(lengths: list[int]) -> list[str]:
    """Document i is ``lengths[i]`` copies of one letter, so every token in a block can be traced to its document."""
    return [chr(ord("a") + i % 26) * n for i, n in enumerate(lengths)]


def reference_blocks(docs: list[str], tokenizer, seq_len: int) -> np.ndarray:
    """Pure-python packing: each document's ids, then EOS; concatenate; whole blocks of seq_len + 1 only."""
    stream: list[int] = []
    for doc in docs:
        stream += tokenizer.encode(doc, add_special_tokens=False) + [tokenizer.eos_token_id]
    n_blocks = len(stream) // (seq_len + 1)
    return np.array(stream[: n_blocks * (seq_len + 1)], dtype=np.int64).reshape(n_blocks, seq_len + 1)


def packed_array(packed) -> np.ndarray:
    if len(packed) == 0:
        return np.zeros((0, packed.seq_len + 1), dtype=np.int64)
    return np.stack([packed[i]["input_ids"].numpy() for i in range(len(packed))])


# ---------------------------------------------------------------------------------------------------- loading


def test_builtin_corpus_loads_with_both_splits():
    ds = load_text_dataset(None)
    chars = sum(len(t) for split in ("train", "validation") for t in ds[split]["text"])
    assert chars > 400_000
    assert ds["train"].column_names == ["text"] and len(ds["validation"]) >= 1
    # the validation floor of 20k characters gives a few eval blocks even on this 79-document corpus
    assert sum(len(t) for t in ds["validation"]["text"]) >= 20_000
    again = load_text_dataset("builtin")
    assert list(again["validation"]["text"]) == list(ds["validation"]["text"])  # fixed seed


@needs_zh
def test_directory_with_train_and_validation_files():
    ds = load_text_dataset(str(ZH_POETRY))
    assert (len(ds["train"]), len(ds["validation"])) == (161_940, 853)
    assert ds["validation"].column_names == ["text"]


@needs_zh
def test_missing_column_is_one_line_error_naming_columns_and_setting():
    with pytest.raises(ValueError) as e:
        load_text_dataset(str(ZH_POETRY), text_column="content")
    msg = str(e.value)
    assert "\n" not in msg and "'content'" in msg and "text, source" in msg and "--text_column" in msg


def test_text_files_split_by_paragraph_drop_empty_and_carve_validation(tmp_path):
    docs = [f"document {i}\nsecond line of {i}" for i in range(40)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs) + "\n\n\n\n   \n\n", encoding="utf-8")
    notes = []
    ds = load_text_dataset(str(tmp_path / "corpus.txt"), validation_fraction=0.1, seed=3, log=notes.append)
    got = sorted([*ds["train"]["text"], *ds["validation"]["text"]])
    assert got == sorted(docs)  # whitespace-only paragraph dropped
    assert len(ds["validation"]) >= 4
    held = f"{len(ds['validation'])} of its 40 documents are held out"
    assert [n for n in notes if "no validation split" in n] == [next(n for n in notes if held in n)]  # said, counted
    assert not set(ds["train"]["text"]) & set(ds["validation"]["text"])


def test_jsonl_files_named_by_split_and_custom_column(tmp_path):
    rows = lambda n, tag: "\n".join(json.dumps({"body": f"{tag} {i}", "id": i}) for i in range(n))  # noqa: E731
    (tmp_path / "train.jsonl").write_text(rows(10, "t") + "\n" + json.dumps({"body": "", "id": -1}), encoding="utf-8")
    (tmp_path / "validation.jsonl").write_text(rows(3, "v"), encoding="utf-8")
    ds = load_text_dataset(str(tmp_path), text_column="body")
    assert len(ds["train"]) == 10 and list(ds["validation"]["body"]) == ["v 0", "v 1", "v 2"]
    assert ds["train"].column_names == ["body"]


def test_explicit_comma_separated_files_named_by_split(tmp_path):
    (tmp_path / "train.txt").write_text("one\n\ntwo\n\nthree", encoding="utf-8")
    (tmp_path / "dev.txt").write_text("held out", encoding="utf-8")
    ds = load_text_dataset(f"{tmp_path / 'train.txt'},{tmp_path / 'dev.txt'}")
    assert sorted(ds["train"]["text"]) == ["one", "three", "two"] and list(ds["validation"]["text"]) == ["held out"]


def test_a_file_named_alone_is_trained_on_whatever_its_name_and_a_folder_still_needs_a_train_file(tmp_path):
    """--dataset data/validation.jsonl: named to be trained on; its validation split is carved (said in one line).
    Beside a train* file it is the validation split; in a folder it is no training data."""
    rows = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(40))
    (tmp_path / "validation.jsonl").write_text(rows, encoding="utf-8")
    notes = []
    ds = load_text_dataset(str(tmp_path / "validation.jsonl"), log=notes.append)
    assert sorted([*ds["train"]["text"], *ds["validation"]["text"]]) == sorted(f"document {i}" for i in range(40))
    assert len(ds["train"]) and len(ds["validation"])
    assert len(notes) == 1 and "trained on as the train split" in notes[0] and "carved" in notes[0]
    (tmp_path / "train.jsonl").write_text('{"text": "one"}\n', encoding="utf-8")
    ds = load_text_dataset(f"{tmp_path / 'train.jsonl'},{tmp_path / 'validation.jsonl'}", log=notes.append)
    assert list(ds["train"]["text"]) == ["one"] and len(ds["validation"]) == 40 and len(notes) == 1
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(ValueError, match="no training files among"):
        load_text_dataset(str(tmp_path))


def test_text_column_on_text_without_columns_is_refused(tmp_path):
    (tmp_path / "corpus.txt").write_text("one\n\ntwo", encoding="utf-8")
    with pytest.raises(ValueError, match=r"--text_column body: \.txt files .* have no columns"):
        load_text_dataset(str(tmp_path / "corpus.txt"), text_column="body")
    with pytest.raises(ValueError, match="the builtin corpus .* has no columns; pass --dataset"):
        load_text_dataset(None, text_column="body")


def test_non_utf8_text_file_is_refused_naming_the_file(tmp_path):
    bad = tmp_path / "gbk.txt"
    bad.write_bytes("床前明月光\n\n疑是地上霜".encode("gbk"))
    with pytest.raises(ValueError) as e:
        load_text_dataset(str(bad))
    assert "gbk.txt" in str(e.value) and "UTF-8" in str(e.value) and "\n" not in str(e.value)


def test_missing_path_is_one_line_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_text_dataset(str(tmp_path / "nope.parquet"))


# ---------------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_specials_and_exact_round_trip():
    tok = english_tokenizer()
    assert tok.eos_token == tok.bos_token == tok.pad_token == tok.unk_token == EOS_TOKEN
    assert tok.eos_token_id == 0 and len(tok) == 1000
    text = "def f(x):\r\n\treturn  x ** 2  # ünïcödé 🤗 \x00 <|endoftext|> end "
    assert tok.decode(tok.encode(text)) == text


@given(st.text(max_size=200))
@settings(max_examples=150, deadline=None)
def test_tokenizer_round_trips_arbitrary_unicode(text):
    tok = english_tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_save_load_keeps_ids(tmp_path):
    from transformers import AutoTokenizer

    tok = english_tokenizer()
    tok.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "The quick brown fox 跳过 the lazy dog."
    assert loaded.encode(text) == tok.encode(text) and loaded.eos_token_id == 0


@needs_zh
def test_chinese_characters_become_tokens_and_compress():
    tok = chinese_tokenizer()
    assert all(len(tok.encode(c)) == 1 for c in "月山風人花春")  # a character is one token, not 3 bytes
    texts = zh_validation(300)
    assert all(tok.decode(tok.encode(t)) == t for t in texts[:50])
    n_tokens = sum(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])
    chars_per_token = sum(map(len, texts)) / n_tokens
    # measured 0.95 (vocab 2000, 3000 poems); bytes per CJK char would give ~0.35, two tokens per char ~0.5
    assert chars_per_token > 0.8


def test_check_vocab():
    tok = english_tokenizer()
    check_vocab(tok, 1000)
    check_vocab(tok, 1024)  # padded embedding table is fine
    with pytest.raises(ValueError) as e:
        check_vocab(tok, 512)
    assert "--vocab_size 1000" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------- packing


def test_packer_closed_form(tmp_path):
    tok = byte_tokenizer()
    lengths, seq_len = [5, 0, 17, 3, 40, 1, 9], 7
    docs = letter_docs(lengths)
    packed = pack_dataset(datasets.Dataset.from_dict({"text": docs}), tok, seq_len, tmp_path)
    n_blocks = (sum(lengths) + len(lengths)) // (seq_len + 1)
    assert packed.num_blocks == len(packed) == n_blocks == 10
    assert packed.n_tokens == sum(lengths) + len(lengths)  # the whole stream is kept
    assert packed.n_chars == sum(lengths)
    eos = tok.eos_token_id
    stream = []
    for doc in docs:
        stream += [tok.convert_tokens_to_ids(c) for c in doc] + [eos]
    blocks = packed_array(packed)
    for k in range(n_blocks):  # block k is the stream slice [k (S+1), (k+1)(S+1))
        assert blocks[k].tolist() == stream[k * (seq_len + 1) : (k + 1) * (seq_len + 1)]
    flat = blocks.reshape(-1)
    ends = np.cumsum(np.array(lengths) + 1) - 1  # EOS exactly after each document
    assert (np.flatnonzero(flat == eos) == ends[ends < len(flat)]).all()
    assert packed[0]["input_ids"].dtype.is_floating_point is False and packed[0]["input_ids"].shape == (8,)
    meta = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert meta["dtype"] == "uint16" and meta["seq_len"] == seq_len and meta["n_tokens_total"] == packed.n_tokens
    assert meta["n_tokens"] == n_blocks * (seq_len + 1)
    assert {"tokenizer", "source", "n_tokens", "n_chars"} <= meta.keys()
    assert packed.tokens.tolist() == stream
    assert os.path.getsize(packed.path) == packed.n_tokens * 2


@given(
    lengths=st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=30),
    seq_len=st.integers(min_value=1, max_value=48),
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_packer_matches_reference(lengths, seq_len):
    tok = byte_tokenizer()
    docs = letter_docs(lengths)
    expected = reference_blocks(docs, tok, seq_len)
    with tempfile.TemporaryDirectory() as cache:
        ds = datasets.Dataset.from_dict({"text": docs})
        if len(expected) == 0:
            with pytest.raises(ValueError, match="lower --seq_len"):
                pack_dataset(ds, tok, seq_len, cache)
            return
        packed = pack_dataset(ds, tok, seq_len, cache)
        np.testing.assert_array_equal(packed_array(packed), expected)


def test_packer_on_real_tokenizer_and_multiprocess(tmp_path):
    tok = english_tokenizer()
    docs = load_text_dataset(None)["validation"]
    ref = reference_blocks(docs["text"], tok, 64)
    np.testing.assert_array_equal(packed_array(pack_dataset(docs, tok, 64, tmp_path / "a", num_proc=2)), ref)


def test_cache_reuse_skips_tokenization_and_key_changes(tmp_path, monkeypatch):
    tok = english_tokenizer()
    ds = datasets.Dataset.from_dict({"text": letter_docs([30] * 50)})
    first = pack_dataset(ds, tok, 16, tmp_path)
    mtime = os.path.getmtime(first.path)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenizer called although the packed cache exists")

    with monkeypatch.context() as m:
        m.setattr(type(tok), "__call__", no_tokenizing)
        again = pack_dataset(datasets.Dataset.from_dict({"text": letter_docs([30] * 50)}), tok, 16, tmp_path)
    assert again.path == first.path and os.path.getmtime(again.path) == mtime
    np.testing.assert_array_equal(packed_array(again), packed_array(first))

    other_len = pack_dataset(ds, tok, 32, tmp_path)
    other_tok = pack_dataset(ds, byte_tokenizer(), 16, tmp_path)
    other_data = pack_dataset(ds.select(range(40)), tok, 16, tmp_path)
    assert len({first.path, other_len.path, other_tok.path, other_data.path}) == 4
    assert len(list(tmp_path.glob("*.bin"))) == 4 and not list(tmp_path.glob("tmp-*"))


def test_packed_tokens_pickle_without_copying_the_array(tmp_path):
    tok = byte_tokenizer()
    packed = pack_dataset(datasets.Dataset.from_dict({"text": letter_docs([500] * 20)}), tok, 99, tmp_path)
    _ = packed[0]  # opens the memmap
    blob = pickle.dumps(packed)
    assert len(blob) < 2000
    clone = pickle.loads(blob)
    assert clone[len(clone) - 1]["input_ids"].tolist() == packed[-1]["input_ids"].tolist()
    with pytest.raises(IndexError):
        packed[len(packed)]


# ---- the tokenizer cache ---------------------------------------------------------------------------------------------


def test_a_tokenizer_trained_once_is_reused_for_the_same_data_and_settings(tmp_path):
    from hf_cgpu.data.tokenizer import cached_tokenizer, tokenizer_hash

    texts = ["床前明月光，疑是地上霜。", "春眠不覺曉，處處聞啼鳥。"] * 20
    calls = []

    def train(vocab=300):
        calls.append(vocab)
        return train_tokenizer(texts, vocab_size=vocab, show_progress=False)

    key = {"vocab_size": 300, "source": "abc-40"}
    first, came_from = cached_tokenizer(key, tmp_path, train)
    assert came_from is None and calls == [300]
    again, came_from = cached_tokenizer(key, tmp_path, lambda: pytest.fail("must not train again"))
    assert came_from is not None and came_from.parent == tmp_path / "tokenizers"
    assert tokenizer_hash(again) == tokenizer_hash(first)  # the same ids: packed caches and checkpoints agree
    assert again(texts[0])["input_ids"] == first(texts[0])["input_ids"]
    _, came_from = cached_tokenizer({**key, "vocab_size": 320}, tmp_path, lambda: train(320))
    assert came_from is None and calls == [300, 320]  # other settings: its own entry
    _, came_from = cached_tokenizer({**key, "source": "other-40"}, tmp_path, train)
    assert came_from is None and len(calls) == 3  # other data: trained


def test_a_damaged_cached_tokenizer_is_trained_again_and_replaced(tmp_path):
    from hf_cgpu.data.tokenizer import cached_tokenizer

    def train():
        return train_tokenizer(["abcabc abd"] * 10, vocab_size=260, show_progress=False)

    key = {"vocab_size": 260, "source": "x"}
    cached_tokenizer(key, tmp_path, train)
    (folder,) = (tmp_path / "tokenizers").iterdir()
    (folder / "tokenizer.json").write_text("{not json")
    calls = []
    tok, came_from = cached_tokenizer(key, tmp_path, lambda: calls.append(1) or train())
    assert came_from is None and calls == [1] and len(tok) == 260
    _, came_from = cached_tokenizer(key, tmp_path, lambda: pytest.fail("replaced entry must load"))
    assert came_from == folder


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_still_trains(tmp_path):
    from hf_cgpu.data.tokenizer import cached_tokenizer

    tmp_path.chmod(0o500)
    try:
        tok, came_from = cached_tokenizer({"vocab_size": 257}, tmp_path,
                                          lambda: train_tokenizer(["abc"], vocab_size=257, show_progress=False))
        assert came_from is None and len(tok) == 257
    finally:
        tmp_path.chmod(0o700)


def test_a_fresh_output_folder_reuses_the_tokenizer_an_earlier_run_trained(tmp_path, monkeypatch):
    from hf_cgpu.tasks import causal_lm
    from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings

    task = CausalLMTask(GPTSettings(vocab_size=300, tokenizer_train_docs=20, cache_dir=str(tmp_path / "cache")))
    ds = load_text_dataset("builtin")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    trained = []
    first = task._tokenizer(ds, tmp_path / "a", resume=False, log=trained.append)
    assert [line for line in trained if line.startswith("tokenizer: training a byte-level BPE of 300 tokens on 20 ")]
    monkeypatch.setattr(causal_lm, "train_tokenizer", lambda *a, **k: pytest.fail("trained again"))
    logs = []
    second = task._tokenizer(ds, tmp_path / "b", resume=False, log=logs.append)
    assert second.get_vocab() == first.get_vocab() and (tmp_path / "b" / "tokenizer" / "tokenizer.json").is_file()
    assert any("reused from" in line for line in logs) and not any("training a" in line for line in logs)
