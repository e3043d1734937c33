"""The shared packed-token cache: runs packing one corpus at once both succeed, an entry is used only when its tokens
hash to the SHA-256 its meta records, and the resume fingerprint's data hash is that of the tokens read."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import datasets
import numpy as np
import pytest

from hf_cgpu.data import packing
from hf_cgpu.data.packing import STALE_SECONDS, PackedTokens, pack_dataset
from hf_cgpu.data.tokenizer import train_tokenizer


def byte_tokenizer():
    return train_tokenizer(["abc"], vocab_size=257, show_progress=False)  # one token per ASCII character


def corpus(n: int = 3000) -> datasets.Dataset:
    """Enough documents that tokenizing takes a few seconds on one core: two runs started together overlap."""
    return datasets.Dataset.from_dict({"text": [chr(97 + i % 26) * (200 + i) for i in range(n)]})


def _pack_in_another_process(cache: str, barrier, results) -> None:
    tok = byte_tokenizer()
    ds = corpus()
    barrier.wait()  # both processes look at the cache at the same moment: neither finds an entry
    try:
        packed = pack_dataset(ds, tok, 16, cache, log=lambda line: None)
        results.put(("ok", packed.content_hash, packed.n_tokens))
    except BaseException as err:  # noqa: BLE001 - reported to the test, which names it
        results.put(("failed", f"{type(err).__name__}: {err}", 0))


@pytest.mark.slow
def test_two_processes_packing_one_corpus_into_one_cache_both_succeed(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_pack_in_another_process, args=(str(tmp_path), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [o[0] for o in outcomes] == ["ok", "ok"], outcomes
    assert outcomes[0][1:] == outcomes[1][1:]  # the same tokens
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and names[0].endswith(".bin") and names[1].endswith(".json"), names  # no temporaries
    meta = json.loads((tmp_path / names[1]).read_text())
    assert meta["sha256"] == outcomes[0][1] == hashlib.sha256((tmp_path / names[0]).read_bytes()).hexdigest()


def test_an_entry_published_while_this_run_tokenized_is_used(tmp_path, monkeypatch):
    tok, ds = byte_tokenizer(), corpus(200)
    first = pack_dataset(ds, tok, 16, tmp_path / "other")
    tokenize = packing._tokenize_batch

    def tokenize_while_another_run_publishes(batch, **kwargs):
        for f in (first.path, first.path.with_suffix(".json")):
            shutil.copy(f, tmp_path / "shared" / f.name)
        return tokenize(batch, **kwargs)

    def no_writing(*args, **kwargs):
        raise AssertionError("the entry published meanwhile must be used, not written again")

    (tmp_path / "shared").mkdir()
    monkeypatch.setattr(packing, "_tokenize_batch", tokenize_while_another_run_publishes)
    monkeypatch.setattr(packing, "_write_stream", no_writing)
    packed = pack_dataset(ds, tok, 16, tmp_path / "shared")
    assert packed.path == tmp_path / "shared" / first.path.name
    np.testing.assert_array_equal(packed.tokens, first.tokens)
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == sorted([first.path.name,
                                                                              first.path.with_suffix(".json").name])


def test_a_cached_stream_overwritten_with_other_tokens_of_its_size_is_packed_again(tmp_path):
    tok, ds = byte_tokenizer(), corpus(100)
    first = pack_dataset(ds, tok, 16, tmp_path)
    right = np.array(first.tokens)
    wrong = right[::-1].copy()  # the same size, other tokens
    first.path.write_bytes(wrong.tobytes())
    lines = []
    again = pack_dataset(ds, tok, 16, tmp_path, log=lines.append)
    assert len(lines) == 1 and lines[0].startswith("warning: ") and str(first.path) in lines[0]
    assert "SHA-256" in lines[0] and "packing the data again" in lines[0]
    np.testing.assert_array_equal(np.fromfile(again.path, dtype=right.dtype), right)  # rebuilt in place
    np.testing.assert_array_equal(again.tokens, right)
    lines.clear()
    pack_dataset(ds, tok, 16, tmp_path, log=lines.append)
    assert lines == []  # the rebuilt entry checks out


@pytest.mark.parametrize("damage, why", [
    (lambda bin_path, meta_path: bin_path.write_bytes(bin_path.read_bytes()[:-2]), "bytes, its meta says"),
    (lambda bin_path, meta_path: bin_path.unlink(), "is missing"),
    (lambda bin_path, meta_path: meta_path.write_text("{"), "is unreadable"),
    (lambda bin_path, meta_path: meta_path.write_text(json.dumps(
        {k: v for k, v in json.loads(meta_path.read_text()).items() if k != "sha256"})), "records no SHA-256"),
])
def test_a_damaged_entry_is_packed_again_with_one_warning_line(tmp_path, damage, why):
    tok, ds = byte_tokenizer(), corpus(50)
    first = pack_dataset(ds, tok, 16, tmp_path)
    right = np.array(first.tokens)
    damage(first.path, first.path.with_suffix(".json"))
    lines = []
    again = pack_dataset(ds, tok, 16, tmp_path, log=lines.append)
    assert len(lines) == 1 and why in lines[0], lines
    np.testing.assert_array_equal(again.tokens, right)
    assert json.loads(again.path.with_suffix(".json").read_text())["sha256"] == again.content_hash


def test_content_hash_is_of_the_tokens_read_not_the_meta_record(tmp_path):
    """The resume fingerprint's data hash (``task.data_fingerprint()`` -> ``content_hash``) follows the data."""
    tok, ds = byte_tokenizer(), corpus(100)
    packed = pack_dataset(ds, tok, 16, tmp_path)
    meta = json.loads(packed.path.with_suffix(".json").read_text())
    assert packed.content_hash == meta["sha256"] == hashlib.sha256(packed.path.read_bytes()).hexdigest()
    wrong = np.array(packed.tokens)[::-1].copy()
    packed.path.write_bytes(wrong.tobytes())
    reopened = PackedTokens(packed.path, meta)  # the meta still records the old hash
    assert reopened.content_hash == hashlib.sha256(wrong.tobytes()).hexdigest() != meta["sha256"]


def test_a_killed_runs_temporaries_are_removed_by_the_next_run_of_that_entry(tmp_path):
    tok, ds = byte_tokenizer(), corpus(50)
    key = pack_dataset(ds, tok, 16, tmp_path / "first").meta["key"]
    cache = tmp_path / "cache"
    old_dir, old_bin, fresh = cache / f"tmp-{key}-1-dead", cache / f".tokens-{key}.bin.tmp-1-dead", \
        cache / f"tmp-{key}-2-alive"
    for d in (old_dir, fresh):
        d.mkdir(parents=True)
        (d / "tokenized.arrow").write_bytes(b"x")
    old_bin.write_bytes(b"x")
    past = time.time() - STALE_SECONDS - 60
    for p in (old_dir / "tokenized.arrow", old_dir, old_bin):
        os.utime(p, (past, past))
    pack_dataset(ds, tok, 16, cache)
    assert not old_dir.exists() and not old_bin.exists() and fresh.exists()
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith("tokens-")) == [f"tokens-{key}.bin",
                                                                                        f"tokens-{key}.json"]


def test_a_too_short_split_is_named_with_its_tokens_and_the_need(tmp_path):
    with pytest.raises(ValueError) as e:
        pack_dataset(datasets.Dataset.from_dict({"text": ["short text"]}), byte_tokenizer(), 32, tmp_path,
                     split="validation")
    msg = str(e.value)
    assert "the validation split has only 11 tokens" in msg and "33 (seq_len + 1)" in msg
    assert "--seq_len to 10 or less" in msg and "\n" not in msg
    assert not list(Path(tmp_path).glob("*tmp*"))  # nothing left behind
