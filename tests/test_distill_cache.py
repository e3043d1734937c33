"""Distillation from a cached top-K of the teacher's predictions (``--teacher DIR --teacher_top_k K``): the cache is
the teacher's own top-K over the stream's windows, the sparse KL at K = vocab is the full KL (zero for the teacher
itself), the cached loss and gradients at K = vocab are the on-the-fly ones, the cache is reused for its key and
rebuilt for other weights, a cached run resumes bit for bit (reading the cache back from disk) and leaves the cache
out of the model's seal and push, and bad values are refused in one line."""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import small_text_corpus
from safetensors.torch import load_file

from hf_cgpu.cli import main as cli_main
from hf_cgpu.data.corpus import builtin_corpus
from hf_cgpu.data.tokenizer import load_tokenizer
from hf_cgpu.data.windows import document_position_ids, eval_windows
from hf_cgpu.errors import SettingsError
from hf_cgpu.hub.push import folder_files
from hf_cgpu.integrity import read_manifest
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.models.cgpt.modeling_cgpt import chunked_cross_entropy
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tasks import teachers as teachers_module
from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings
from hf_cgpu.tasks.teacher_cache import CACHE_DIR, chunked_ce_sparse_kl, top_k_of_stream
from hf_cgpu.tasks.teachers import Distiller, chunked_kl
from hf_cgpu.train import fit

DOCS = builtin_corpus()


def test_the_cache_is_the_teacher_s_top_k_over_the_stream_s_windows():
    """Every position of a stream whose length is no multiple of the window (the last window overlaps), with the
    positions restarting after each EOS: the teacher's logits on the same windows, log-softmaxed, then torch.topk."""
    torch.manual_seed(0)
    teacher = CgptForCausalLM(CgptConfig(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                         document_masking=True, eos_token_id=0, logit_softcap=15.0)).eval()
    tokens = np.random.default_rng(0).integers(0, 50, 100).astype(np.uint16)
    ids, values = top_k_of_stream(teacher, tokens, 16, 5, batch_size=3, device=torch.device("cpu"), eos=0,
                                  chunk_size=7)
    assert ids.shape == values.shape == (99, 5) and ids.dtype == torch.int16 and values.dtype == torch.float32
    want_ids, want_values = torch.full((99, 5), -1), torch.zeros(99, 5)
    with torch.no_grad():
        for start, skip in eval_windows(100, 16):
            x = torch.from_numpy(tokens[start : start + 16].astype(np.int64))[None]
            logp = teacher(input_ids=x, position_ids=document_position_ids(x, 0)).logits[0].log_softmax(-1)
            v, i = logp.topk(5, dim=-1)
            want_ids[start + skip : start + 16], want_values[start + skip : start + 16] = i[skip:], v[skip:]
    assert (want_ids >= 0).all()  # every position predicted
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-6)


def test_the_sparse_kl_at_k_vocab_is_the_full_kl_and_zero_for_the_teacher_itself():
    """At K = vocab the sparse KL is ``chunked_kl``'s, the cross-entropy the model's own; at K < vocab it is the KL
    of the teacher's K entries renormalised against the student's full softmax read at them."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2, logit_softcap=20.0)
    student, teacher = (CgptForCausalLM(CgptConfig(**cfg)).eval() for _ in range(2))
    x, targets = torch.randint(0, 50, (3, 16)), torch.randint(0, 50, (48,))
    with torch.no_grad():
        h = [m(input_ids=x, output_hidden_states=True).hidden_states[-1].reshape(-1, 32) for m in (student, teacher)]
        w = [m.lm_head.weight for m in (student, teacher)]
        logp = [m(input_ids=x).logits.reshape(-1, 50).log_softmax(-1) for m in (student, teacher)]
        values, ids = logp[1].topk(50, dim=-1)
        ce, kl = chunked_ce_sparse_kl(h[0], w[0], targets, ids, values, chunk_size=7, temperature=2.0, cap=20.0)
        full = chunked_kl(h[0], w[0], [h[1]], [w[1]], chunk_size=7, temperature=2.0, cap=20.0, caps=[20.0])
        own = chunked_cross_entropy(h[0], w[0], targets, 7, softcap=20.0)
        s_values, s_ids = logp[0].topk(50, dim=-1)
        _, same = chunked_ce_sparse_kl(h[0], w[0], targets, s_ids, s_values, chunk_size=7, temperature=2.0, cap=20.0)
        values5, ids5 = values[:, :5], ids[:, :5]
        _, kl5 = chunked_ce_sparse_kl(h[0], w[0], targets, ids5, values5, chunk_size=0, temperature=2.0, cap=20.0)
        nowhere = torch.full_like(ids, 10**6)  # not read without the KL (--distill_anneal's weight 0)
        ce_alone, none = chunked_ce_sparse_kl(h[0], w[0], targets, nowhere, values, chunk_size=7, cap=20.0, kl=False)
    torch.testing.assert_close(kl, full, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ce, own, rtol=1e-6, atol=1e-7)
    assert torch.equal(ce_alone, ce) and none.item() == 0
    assert kl > 1e-3 and same.abs().item() < 1e-6
    p = F.softmax(values5 / 2.0, dim=-1)
    log_q = (logp[0] / 2.0).log_softmax(-1).gather(1, ids5)  # log-softmax at T of the log-softmax: that of the logits
    torch.testing.assert_close(kl5, (p * (p.log() - log_q)).sum(-1).mean(), rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return small_text_corpus(tmp_path_factory.mktemp("kdcache"), DOCS)


GPT = dict(n_layer=1, n_embd=32, n_head=2, seq_len=32, loss_chunk_size=8, max_new_tokens=1, prompts="a")
TRAIN = dict(max_steps=4, micro_batch_size=2, warmup_steps=1, eval_steps=0, eval_batches=0, checkpointing_steps=2,
             progress=False, mixed_precision="no")


def run(root, out, train=None, **gpt):
    cfg = GPTSettings(**GPT, dataset=str(root / "data"), tokenizer=str(root / "tok"), **gpt)
    return fit(CausalLMTask(cfg), TrainSettings(**{**TRAIN, **(train or {})}, output_dir=str(out)))


@pytest.fixture(scope="module")
def teacher(inputs):
    run(inputs, inputs / "teacher", train={"max_steps": 2})
    return inputs / "teacher"


def _stream(n: int = 200):
    """A token stream as the cache reads one: tokens, the run's seq_len and a content hash."""
    tokens = np.random.default_rng(1).integers(0, 300, n).astype(np.uint16)
    return SimpleNamespace(tokens=tokens, seq_len=32, content_hash=f"stream of {n}")


def _distiller(inputs, folder, top_k):
    tok = load_tokenizer(inputs / "tok")
    return Distiller([str(folder)], tok, len(tok), torch.device("cpu"), 0.4, 1.5, nullcontext, top_k=top_k)


def test_the_cached_loss_and_gradients_at_k_vocab_are_the_on_the_fly_ones(inputs, teacher, tmp_path):
    """Windows at the teacher's own window starts (the same context): the cached path's loss and every gradient
    are the on-the-fly path's, read from the cache rows of those windows' offsets."""
    stream = _stream()
    cached, fly = _distiller(inputs, teacher, 300), _distiller(inputs, teacher, 0)
    cached.cache_over(stream, tmp_path, batch_size=2, eos=None, device=torch.device("cpu"))
    starts = torch.tensor([64, 0, 128])
    x = torch.from_numpy(stream.tokens[(starts[:, None] + torch.arange(33)).numpy()].astype(np.int64))
    student = CgptForCausalLM.from_pretrained(str(teacher)).train()
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    losses, grads = [], []
    for distiller in (cached, fly):
        student.zero_grad()
        loss = distiller.loss(student, x[:, :-1], None, x[:, 1:], starts)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in student.named_parameters()})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)
    plain = student(input_ids=x[:, :-1], shift_labels=x[:, 1:], use_cache=False).loss
    assert abs(losses[0] - 0.6 * plain) > 1e-3  # the KL is there
    for distiller in (cached, fly):  # --distill_anneal's weight 0: the plain cross-entropy, on both paths
        distiller.weight_now = 0.0
        torch.testing.assert_close(distiller.loss(student, x[:, :-1], None, x[:, 1:], starts), plain, rtol=1e-6,
                                   atol=1e-6)


@pytest.mark.slow  # inductor's compile on the CPU: about 13 s
def test_the_compiled_chunk_gives_the_eager_losses_and_gradients():
    """A compiled run's loss chunk (``compiled=True``, torch.compile of the same function) against eager: the
    cross-entropy, the sparse KL and both gradients, soft-capped at T = 2 over two chunks."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(24, 16, requires_grad=True), (0.3 * torch.randn(40, 16)).requires_grad_()
    targets, ids = torch.randint(0, 40, (24,)), torch.randint(0, 40, (24, 6))
    values = torch.randn(24, 6).log_softmax(-1)
    out = []
    for compiled in (False, True):
        ce, kl = chunked_ce_sparse_kl(hidden, weight, targets, ids, values, 12, 2.0, 20.0, compiled=compiled)
        (ce + 3 * kl).backward()
        out.append((ce.detach(), kl.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    for eager, compiled in zip(*out, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert out[0][1] > 1e-3


def test_a_compiled_run_s_cached_loss_goes_through_the_compiled_chunk(inputs, teacher, tmp_path, monkeypatch):
    """``Distiller(compile=True)`` computes its cached loss through ``_compiled_chunk()`` and eager runs do not."""
    from hf_cgpu.tasks import teacher_cache

    calls = []

    def counted():
        def chunk(*args):
            calls.append(args[0].shape[0])
            return teacher_cache._chunk_ce_sparse_kl(*args)
        return chunk

    monkeypatch.setattr(teacher_cache, "_compiled_chunk", counted)
    stream = _stream()
    x = torch.from_numpy(stream.tokens[:33].astype(np.int64))[None]
    student = CgptForCausalLM.from_pretrained(str(teacher)).train()
    losses = []
    for compile in (False, True):
        tok = load_tokenizer(inputs / "tok")
        distiller = Distiller([str(teacher)], tok, len(tok), torch.device("cpu"), 0.4, 1.5, nullcontext,
                              compile=compile, top_k=8)
        distiller.cache_over(stream, tmp_path / str(compile), batch_size=2, eos=None, device=torch.device("cpu"))
        losses.append(distiller.loss(student, x[:, :-1], None, x[:, 1:], torch.tensor([0])))
        assert sum(calls) == 32 * compile  # every position's chunk, and none in the eager run
    torch.testing.assert_close(losses[0], losses[1])


def test_the_cache_is_reused_for_its_key_and_rebuilt_for_other_weights(inputs, teacher, tmp_path, monkeypatch):
    builds = []

    def counted(*args, **kwargs):
        builds.append(args[0])
        return top_k_of_stream(*args, **kwargs)

    monkeypatch.setattr(teachers_module, "top_k_of_stream", counted)
    stream, cpu = _stream(), torch.device("cpu")
    first = _distiller(inputs, teacher, 8)
    first.cache_over(stream, tmp_path, 2, None, cpu)
    second = _distiller(inputs, teacher, 8)
    second.cache_over(stream, tmp_path, 2, None, cpu)
    assert len(builds) == 1 and torch.equal(first.cache.values, second.cache.values)
    other = inputs / "teacher_other"
    run(inputs, other, train={"max_steps": 1})  # the same shape and tokenizer, other weights
    third = _distiller(inputs, other, 8)
    third.cache_over(stream, tmp_path, 2, None, cpu)
    assert len(builds) == 2 and not torch.equal(first.cache.values, third.cache.values)
    assert len(list((tmp_path / CACHE_DIR).iterdir())) == 1  # the stale one is gone


@pytest.fixture(scope="module")
def cached_run(inputs, teacher):
    """A cached-KD run with document masking, four steps, a checkpoint every two."""
    levers = dict(teacher=str(teacher), teacher_top_k=8, distill_weight=0.6, document_masking=True)
    results = run(inputs, inputs / "cached", **levers)
    return levers, results


def test_a_cached_run_records_the_cache_and_keeps_it_out_of_the_seal_and_the_push(inputs, cached_run):
    levers, results = cached_run
    out = inputs / "cached"
    saved = json.loads((out / "all_results.json").read_text())
    assert {k: saved["settings"][k] for k in levers} == levers
    assert saved["teacher_cache_seconds"] == results["teacher_cache_seconds"] > 0
    assert [p.suffix for p in (out / CACHE_DIR).iterdir()] == [".safetensors"]
    # neither sealed with the model nor a candidate of a push (sealed or not), nor named in its "left out" note
    assert not any(f.startswith(CACHE_DIR) for f in [*read_manifest(out).files, *folder_files(out)])


def test_a_cached_run_resumes_bit_identical_reading_its_cache_back(inputs, cached_run, capsys):
    levers, _ = cached_run
    cut = inputs / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(inputs / "cached" / "checkpoints" / "step_0000002", cut / "checkpoints" / "step_0000002")
    shutil.copytree(inputs / "cached" / CACHE_DIR, cut / CACHE_DIR)
    capsys.readouterr()
    run(inputs, cut, train={"resume_from_checkpoint": "latest"}, **levers)
    assert "reused" in capsys.readouterr().out
    a, b = load_file(inputs / "cached" / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_values_are_refused_in_one_line(inputs, teacher, tmp_path, capsys, monkeypatch):
    with pytest.raises(SettingsError, match=r"^--teacher_top_k 8 caches the predictions of one --teacher DIR"):
        GPTSettings(teacher_top_k=8)
    with pytest.raises(SettingsError, match=r"^--teacher_top_k 8 .* this run has 2"):
        GPTSettings(teacher="a,b", teacher_top_k=8)
    with pytest.raises(SettingsError, match=r"^--teacher_top_k -1; use 1 \.\. --vocab_size 32,000"):
        GPTSettings(teacher="a", teacher_top_k=-1)
    with pytest.raises(SettingsError, match=r"^--teacher_top_k 301: this run's vocabulary has 300 tokens"):
        run(inputs, tmp_path / "run", teacher=str(teacher), teacher_top_k=301)
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    capsys.readouterr()
    assert cli_main(["train", "gpt", "--teacher_top_k", "4", "--output_dir", str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --teacher_top_k 4 caches the predictions of one --teacher")
