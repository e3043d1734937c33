"""The GPT's levers for many epochs of a small corpus, each off by default: input token replacement
(``--input_noise``: inputs replaced, targets kept, never in evaluation), weight averaging (``--swa_start``: the exact
mean of the weights from its step, evaluated and saved), distillation (``--teacher``: a teacher equal to the student
adds no KL, the chunked KL is the full-logits one, another tokenizer is refused), the weight-decay schedule
(``--weight_decay_end``: held, then moved linearly, from the optimizer's own values). A run with all of them on
resumes bit for bit and records them; a resume that changes one is refused naming it."""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext

import pytest
import torch
from conftest import small_text_corpus
from safetensors.torch import load_file

from hf_cgpu.data.corpus import builtin_corpus
from hf_cgpu.data.tokenizer import load_tokenizer, train_tokenizer
from hf_cgpu.data.windows import replace_tokens
from hf_cgpu.errors import CheckpointError, IntegrityError, SettingsError
from hf_cgpu.evaluation.text import evaluate_language_model
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings
from hf_cgpu.tasks.teachers import Distiller, chunked_kl
from hf_cgpu.train import fit
from hf_cgpu.train.ema import SWA
from hf_cgpu.train.schedule import set_lr, weight_decay_factor

DOCS = builtin_corpus()


def test_replaced_tokens_are_uniform_draws_at_the_rate_and_repeat_with_the_seed():
    ids = torch.zeros(64, 512, dtype=torch.long)
    a = replace_tokens(ids, 0.1, 1000, torch.Generator().manual_seed(3))
    b = replace_tokens(ids, 0.1, 1000, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.dtype == ids.dtype
    hit = a != 0  # a draw of token 0 is counted as kept: 1/1000 of the draws
    assert 0.095 < hit.float().mean().item() < 0.105
    assert a.max().item() < 1000 and len(a[hit].unique()) > 900
    assert torch.equal(replace_tokens(ids, 0.0, 1000, torch.Generator().manual_seed(3)), ids)


def _task(vocab: int = 64, **cfg) -> tuple[CausalLMTask, CgptForCausalLM]:
    """A task of a tiny GPT (the tokenizer of the builtin corpus, ``vocab`` ids) and the model it trains."""
    tok = train_tokenizer(DOCS[:20], vocab_size=300, show_progress=False)
    task = CausalLMTask(GPTSettings(n_layer=1, n_embd=32, n_head=2, seq_len=16, loss_chunk_size=0, **cfg))
    task.tokenizer = tok
    torch.manual_seed(0)
    model = CgptForCausalLM(CgptConfig(vocab_size=len(tok), n_positions=16, n_embd=32, n_layer=1, n_head=2)).train()
    return task, model


def test_input_noise_replaces_the_inputs_and_keeps_the_targets():
    """The loss with --input_noise is the model's loss on the replaced inputs against the TRUE next tokens (the same
    draws from the micro-batch's generator); off, the plain loss bit for bit."""
    task, model = _task(input_noise=0.3)
    block = torch.randint(0, len(task.tokenizer), (4, 17), generator=torch.Generator().manual_seed(1))
    noisy = task.loss(model, {"input_ids": block}, torch.Generator().manual_seed(7))
    inputs = replace_tokens(block[:, :-1], 0.3, len(task.tokenizer), torch.Generator().manual_seed(7))
    assert not torch.equal(inputs, block[:, :-1])
    expected = model(input_ids=inputs, shift_labels=block[:, 1:], use_cache=False).loss
    assert torch.equal(noisy, expected)
    plain_task, _ = _task()
    plain = plain_task.loss(model, {"input_ids": block}, torch.Generator().manual_seed(7))
    assert torch.equal(plain, model(input_ids=block[:, :-1], shift_labels=block[:, 1:], use_cache=False).loss)
    assert not torch.equal(plain, noisy)


def test_swa_is_the_exact_mean_of_the_weights_from_its_start():
    layer = torch.nn.Linear(3, 2)
    swa = SWA(layer, 0.5, lambda: 8)  # the average starts at step 4 of 8
    seen = []
    for step in range(8):
        with torch.no_grad():
            layer.weight.fill_(float(step * step))
            layer.bias.fill_(-float(step))
        swa.update(step, apply=torch.tensor(True) if step % 2 else None)  # both update paths
        seen.append(step)
        if step < 4:  # before it: the live weights
            assert torch.equal(swa.shadow["weight"], layer.weight.detach())
    mean = sum(s * s for s in range(4, 8)) / 4
    torch.testing.assert_close(swa.shadow["weight"], torch.full((2, 3), mean), rtol=1e-6, atol=0)
    torch.testing.assert_close(swa.shadow["bias"], torch.full((2,), -5.5), rtol=1e-6, atol=0)


def test_swa_and_ema_together_and_bad_values_are_refused():
    with pytest.raises(SettingsError, match="--ema_decay 0"):
        TrainSettings(swa_start=0.7, ema_decay=0.999)
    with pytest.raises(SettingsError, match="swa_start"):
        TrainSettings(swa_start=1.0)
    with pytest.raises(SettingsError, match="input_noise"):
        GPTSettings(input_noise=1.0)
    with pytest.raises(SettingsError, match="distill_weight"):
        GPTSettings(distill_weight=0.0)


def test_weight_decay_is_held_then_moved_linearly_from_the_optimizer_s_own_values():
    s = TrainSettings(max_steps=100, weight_decay_end=0.0, weight_decay_hold=0.5)
    assert [weight_decay_factor(k, s) for k in (0, 50, 75, 100, 120)] == [1.0, 1.0, 0.5, 0.0, 0.0]
    assert weight_decay_factor(75, s, total=60) == 0.0 and weight_decay_factor(70, TrainSettings()) == 1.0
    w = torch.nn.Parameter(torch.ones(4, 4))
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.5}, {"params": [], "weight_decay": 0.0}], lr=0.1)
    for factor in (0.5, 0.5, 2.0):  # each time from the value the optimizer was built with, never compounded
        set_lr(opt, 0.1, factor)
    assert [g["weight_decay"] for g in opt.param_groups] == [1.0, 0.0]
    w.grad = torch.zeros_like(w)  # Adam's own update is 0: the step is the decay alone
    set_lr(opt, 0.1, 0.0)
    opt.step()
    assert torch.equal(w.detach(), torch.ones(4, 4))
    set_lr(opt, 0.1, 1.0)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((4, 4), 1 - 0.1 * 0.5))


def test_chunked_kl_is_the_kl_of_the_full_logits_and_zero_for_the_same_model():
    """Over chunks that do not divide the rows, from the hidden states the model returns: the full logits' KL (an
    ensemble: the mean of the teachers' probabilities), zero where the teacher is the student."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    student, t1, t2 = (CgptForCausalLM(CgptConfig(**cfg)).eval() for _ in range(3))
    x = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        h = [m(input_ids=x, output_hidden_states=True).hidden_states[-1].reshape(-1, 32) for m in (student, t1, t2)]
        logits = [m(input_ids=x).logits.reshape(-1, 50) / 2.0 for m in (student, t1, t2)]
        p = (logits[1].softmax(-1) + logits[2].softmax(-1)) / 2
        full = (p * (p.log() - logits[0].log_softmax(-1))).sum(-1).mean()
        heads = [m.lm_head.weight for m in (student, t1, t2)]
        got = chunked_kl(h[0], heads[0], h[1:], heads[1:], chunk_size=7, temperature=2.0)
        same = chunked_kl(h[0], heads[0], [h[0]], [heads[0]], chunk_size=7, temperature=2.0)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-7)
    assert got > 1e-4 and same.abs().item() < 1e-7


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A small parquet corpus, a tokenizer of it and another one of the same size."""
    return small_text_corpus(tmp_path_factory.mktemp("levers"), DOCS, ("tok", "other_tok"))


GPT = dict(n_layer=1, n_embd=32, n_head=2, seq_len=32, loss_chunk_size=8, max_new_tokens=1, prompts="a")
TRAIN = dict(max_steps=4, micro_batch_size=2, warmup_steps=1, eval_steps=0, eval_batches=0, checkpointing_steps=2,
             progress=False, mixed_precision="no")


def run(root, out, tokenizer="tok", train=None, **gpt):
    cfg = GPTSettings(**GPT, dataset=str(root / "data"), tokenizer=str(root / tokenizer), **gpt)
    return fit(CausalLMTask(cfg), TrainSettings(**{**TRAIN, **(train or {})}, output_dir=str(out)))


@pytest.fixture(scope="module")
def teacher(inputs):
    run(inputs, inputs / "teacher", train={"max_steps": 2})
    return inputs / "teacher"


def test_a_teacher_equal_to_the_student_adds_no_kl(inputs, teacher):
    """The teacher's own weights as the student: the loss is (1 - a) x its cross-entropy exactly (KL 0)."""
    tok = load_tokenizer(inputs / "tok")
    student = CgptForCausalLM.from_pretrained(str(teacher)).train()
    distiller = Distiller([str(teacher)], tok, student.config.vocab_size, torch.device("cpu"), 0.3, 2.0, nullcontext)
    x = torch.randint(0, len(tok), (2, 33), generator=torch.Generator().manual_seed(0))
    loss = distiller.loss(student, x[:, :-1], None, x[:, 1:])
    ce = student(input_ids=x[:, :-1], shift_labels=x[:, 1:], use_cache=False).loss
    torch.testing.assert_close(loss, 0.7 * ce, rtol=1e-6, atol=1e-7)
    loss.backward()
    assert student.lm_head.weight.grad is not None


def test_the_distillation_weight_anneals_to_the_plain_loss_without_the_teacher(inputs, teacher, monkeypatch):
    """--distill_anneal: the weight falls linearly from --distill_weight at step 0 to 0 at that share of the schedule;
    the loss mixes the KL at the weight of its step, and at 0 it is the plain cross-entropy with no teacher call."""
    tok = load_tokenizer(inputs / "tok")
    student = CgptForCausalLM(CgptConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok), n_positions=32)).train()
    task = CausalLMTask(GPTSettings(**GPT, teacher=str(teacher), distill_weight=0.6, distill_anneal=0.5))
    task.distiller = Distiller([str(teacher)], tok, len(tok), torch.device("cpu"), 0.6, 1.0, nullcontext)
    weights = []
    for step in (0, 10, 20, 30, 39):
        task.at_step(step, 40)
        weights.append(task.distiller.weight_now)
    assert weights == pytest.approx([0.6, 0.3, 0.0, 0.0, 0.0])
    x = torch.randint(0, len(tok), (2, 33), generator=torch.Generator().manual_seed(1))
    ce = student(input_ids=x[:, :-1], shift_labels=x[:, 1:], use_cache=False).loss
    task.at_step(10, 40)
    half = task.distiller.loss(student, x[:, :-1], None, x[:, 1:])
    task.distiller.weight_now = 1.0  # the KL alone
    kl = task.distiller.loss(student, x[:, :-1], None, x[:, 1:])
    torch.testing.assert_close(half, 0.7 * ce + 0.3 * kl, rtol=1e-5, atol=1e-6)
    assert kl > 0.01  # an untrained student is far from the teacher
    task.at_step(20, 40)
    monkeypatch.setattr(task.distiller.teachers[0], "transformer", None)  # called at weight 0: a TypeError
    torch.testing.assert_close(task.distiller.loss(student, x[:, :-1], None, x[:, 1:]), ce, rtol=0, atol=0)
    held = CausalLMTask(GPTSettings(**GPT, teacher=str(teacher), distill_weight=0.6))
    held.distiller = task.distiller
    held.distiller.weight_now = 0.6
    held.at_step(39, 40)
    assert held.distiller.weight_now == 0.6  # --distill_anneal 0: the weight held all run
    for bad in ({"distill_anneal": 1.5, "teacher": str(teacher)}, {"distill_anneal": 0.5}):
        with pytest.raises(SettingsError, match=r"^--distill_anneal .*--teacher DIR"):
            GPTSettings(**GPT, **bad)


def test_a_teacher_of_another_tokenizer_is_refused_in_one_line(inputs, teacher, tmp_path):
    with pytest.raises(SettingsError, match=r"^--teacher .* has another tokenizer than this run .*--tokenizer"):
        run(inputs, tmp_path / "run", tokenizer="other_tok", teacher=str(teacher))
    assert not (tmp_path / "run").exists()


def test_a_damaged_teacher_folder_is_refused_by_its_manifest(inputs, teacher, tmp_path):
    damaged = tmp_path / "teacher"
    shutil.copytree(teacher, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(IntegrityError, match=r"^--teacher .*model\.safetensors"):
        run(inputs, tmp_path / "run", teacher=str(damaged))


@pytest.fixture(scope="module")
def full(inputs, teacher):
    """All three levers on, four steps, a checkpoint every two."""
    levers = dict(input_noise=0.1, teacher=f"{teacher},{teacher}", distill_weight=0.6, distill_anneal=0.75)
    results = run(inputs, inputs / "full", train=SCHEDULE, **levers)
    return levers, results


SCHEDULE = {"swa_start": 0.5, "weight_decay": 0.5, "weight_decay_end": 0.0, "weight_decay_hold": 0.25}


def test_levers_are_recorded_and_the_saved_average_is_what_was_evaluated(inputs, full):
    levers, results = full
    out = inputs / "full"
    saved = json.loads((out / "all_results.json").read_text())["settings"]
    assert {k: saved[k] for k in (*levers, *SCHEDULE)} == {**levers, **SCHEDULE}
    card = (out / "README.md").read_text()
    assert "`input_noise` | 0.1" in card and "`swa_start` | 0.5" in card
    scored = evaluate_language_model(str(out), str(inputs / "data"), seq_len=32, batch_size=2, device="cpu",
                                     progress=False)
    assert scored["loss"] == pytest.approx(results["val_loss"], rel=1e-6)  # no noise in evaluation, the SWA saved


def test_a_run_with_the_levers_resumes_bit_identical_and_a_changed_lever_is_refused(inputs, full):
    levers, _ = full
    cut = inputs / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(inputs / "full" / "checkpoints" / "step_0000002", cut / "checkpoints" / "step_0000002")
    resume = {**SCHEDULE, "resume_from_checkpoint": "latest"}
    run(inputs, cut, train=resume, **levers)
    a, b = load_file(inputs / "full" / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name, changed, train in (("input_noise", {**levers, "input_noise": 0.2}, resume),
                                 ("swa_start", levers, {**resume, "swa_start": 0.6}),
                                 ("distill_weight", {**levers, "distill_weight": 0.5}, resume),
                                 ("distill_anneal", {**levers, "distill_anneal": 0.5}, resume),
                                 ("weight_decay_end", levers, {**resume, "weight_decay_end": 0.5})):
        with pytest.raises(CheckpointError, match=rf"{{'{name}': "):
            run(inputs, cut, train={**train, "max_steps": 5}, **changed)

