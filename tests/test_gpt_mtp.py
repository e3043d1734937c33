"""Multi-token prediction heads (``--mtp_heads``), off by default: the loss is CE(next) + w x the mean CE of token
t + 1 + k through the LM head, a target in the next document or past the row is not scored, the weight anneals to 0
and the loss is then the plain one; the heads train with the model and resume exactly, and the saved model is the
plain one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import small_text_corpus
from safetensors.torch import load_file

from hf_cgpu.commands.budget import run as budget
from hf_cgpu.data.corpus import builtin_corpus
from hf_cgpu.data.tokenizer import train_tokenizer
from hf_cgpu.errors import CheckpointError, SettingsError
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings
from hf_cgpu.tasks.mtp import annealed_weight, mtp_targets
from hf_cgpu.train import TaskPlan, fit

DOCS = builtin_corpus()


def _task(**cfg) -> tuple[CausalLMTask, CgptForCausalLM]:
    """A task of a tiny GPT (a tokenizer of the builtin corpus) and the model it trains, its loss in chunks of 7."""
    tok = train_tokenizer(DOCS[:20], vocab_size=300, show_progress=False)
    task = CausalLMTask(GPTSettings(n_layer=1, n_embd=32, n_head=2, seq_len=16, **cfg))
    task.tokenizer = tok
    torch.manual_seed(0)
    config = CgptConfig(vocab_size=len(tok), n_positions=16, n_embd=32, n_layer=1, n_head=2, loss_chunk_size=7)
    model = CgptForCausalLM(config).train()
    if task.cfg.mtp_heads:
        task.mtp = task.make_heads(config, torch.device("cpu"))
        with torch.no_grad():  # heads unlike the model's own prediction
            for proj in task.mtp.projs:
                proj.weight.normal_(0, 0.2)
    return task, model


def _block(task: CausalLMTask, rows: int = 3) -> torch.Tensor:
    """(rows, 17) token ids without an EOS."""
    eos = task.tokenizer.eos_token_id
    block = torch.randint(0, len(task.tokenizer), (rows, 17), generator=torch.Generator().manual_seed(1))
    return torch.where(block == eos, (eos + 1) % len(task.tokenizer), block)


def test_the_loss_is_next_token_ce_plus_the_weighted_mean_of_the_heads_ce():
    """Computed by hand from the full logits: head k's logits at position t against token t + 1 + k."""
    task, model = _task(mtp_heads=2, mtp_weight=0.4, mtp_anneal=1.0)
    task.at_step(0, 10)
    assert task.mtp_now == 0.4
    block = _block(task)
    loss = task.loss(model, {"input_ids": block}, torch.Generator())
    inputs = block[:, :-1]
    hidden = model.transformer(input_ids=inputs).last_hidden_state
    ce = [F.cross_entropy(model.lm_head(hidden).flatten(0, 1), block[:, 1:].flatten())]
    for k, h in enumerate(task.mtp(hidden), start=1):
        logits = model.lm_head(h)[:, : 16 - k]
        ce.append(F.cross_entropy(logits.flatten(0, 1), block[:, 1 + k :].flatten()))
    expected = ce[0] + 0.4 * (ce[1] + ce[2]) / 2
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert abs(ce[1].item() - ce[2].item()) > 1e-3  # the heads differ: a target shifted by one would not match
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in task.mtp.parameters())


def test_targets_in_the_next_document_or_past_the_row_are_not_scored():
    block = torch.tensor([[5, 6, 0, 7, 8, 9]])  # EOS = 0 ends the first document (5 6 0)
    assert mtp_targets(block, 1, 0).tolist() == [[0, -100, -100, 9, -100]]
    assert mtp_targets(block, 2, 0).tolist() == [[-100] * 5]
    assert mtp_targets(torch.tensor([[5, 6, 7, 8, 9]]), 2, 0).tolist() == [[8, 9, -100, -100]]  # t + 3


def test_the_weight_anneals_to_zero_and_the_loss_is_then_the_plain_one():
    assert [annealed_weight(k, 100, 0.3, 0.5) for k in (0, 25, 50, 80)] == [0.3, 0.15, 0.0, 0.0]
    assert annealed_weight(60, 200, 0.3, 0.5) == pytest.approx(0.3 * 0.4)  # the schedule's length as fitted
    task, model = _task(mtp_heads=2)
    block = _block(task)
    plain = model(input_ids=block[:, :-1], shift_labels=block[:, 1:], use_cache=False).loss
    task.at_step(5, 10)
    assert task.mtp_now == 0.0
    assert torch.equal(task.loss(model, {"input_ids": block}, torch.Generator()), plain)
    task.at_step(4, 10)
    assert not torch.equal(task.loss(model, {"input_ids": block}, torch.Generator()), plain)


def test_off_by_default_the_loss_is_the_plain_one_and_bad_values_are_refused():
    assert GPTSettings().mtp_heads == 0
    task, model = _task()
    task.at_step(0, 10)
    block = _block(task)
    assert task.mtp is None and task.mtp_now == 0.0
    plain = model(input_ids=block[:, :-1], shift_labels=block[:, 1:], use_cache=False).loss
    assert torch.equal(task.loss(model, {"input_ids": block}, torch.Generator()), plain)
    for bad in ({"mtp_heads": -1}, {"mtp_heads": 2, "mtp_weight": 0.0}, {"mtp_heads": 2, "mtp_anneal": 1.5}):
        with pytest.raises(SettingsError, match="--mtp_heads"):
            GPTSettings(**bad)
    with pytest.raises(SettingsError, match=r"--mtp_heads and --teacher .* --mtp_heads 0"):
        GPTSettings(mtp_heads=2, teacher="runs/x")


def test_a_companion_without_its_own_optimizer_is_trained_by_the_run_s():
    """Heads with no optimizer among the companions join the run's; a discriminator with its own stays out of it."""
    heads, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    plan = TaskPlan(torch.nn.Linear(2, 2), companions=(disc, torch.optim.Adam(disc.parameters()), heads))
    assert plan.joint_modules == [heads]
    assert TaskPlan(torch.nn.Linear(2, 2)).joint_modules == []


def test_the_ledger_prices_the_heads():
    assert "multi-token heads' logits" in budget(["--preset", "tiny", "--mtp_heads", "2"])
    assert "multi-token" not in budget(["--preset", "tiny"]) and "not priced" not in budget(["--preset", "tiny"])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A small parquet corpus and a tokenizer of it."""
    return small_text_corpus(tmp_path_factory.mktemp("mtp"), DOCS)


GPT = dict(n_layer=1, n_embd=32, n_head=2, seq_len=32, loss_chunk_size=8, max_new_tokens=1, prompts="a",
           document_masking=True)
TRAIN = dict(max_steps=4, micro_batch_size=2, warmup_steps=1, eval_steps=0, eval_batches=0, checkpointing_steps=2,
             progress=False, mixed_precision="no")
MTP = dict(mtp_heads=2, mtp_weight=0.5, mtp_anneal=1.0)  # the weight above 0 at every step of the run


def run(root, out, train=None, **gpt):
    cfg = GPTSettings(**GPT, dataset=str(root / "data"), tokenizer=str(root / "tok"), **gpt)
    return fit(CausalLMTask(cfg), TrainSettings(**{**TRAIN, **(train or {})}, output_dir=str(out)))


@pytest.fixture(scope="module")
def runs(inputs):
    """A plain run and one with the heads, four steps each, a checkpoint every two."""
    run(inputs, inputs / "plain")
    run(inputs, inputs / "mtp", **MTP)
    return inputs / "plain", inputs / "mtp"


@pytest.mark.slow  # a trained run: the slow tier
def test_the_saved_model_is_the_plain_model_and_the_heads_are_in_the_checkpoints(runs):
    plain, mtp = runs
    a, b = load_file(plain / "model.safetensors"), load_file(mtp / "model.safetensors")
    assert a.keys() == b.keys() and not all(torch.equal(a[k], b[k]) for k in a)  # trained otherwise, same tensors
    config = json.loads((mtp / "config.json").read_text())
    assert config == json.loads((plain / "config.json").read_text()) and not any("mtp" in k for k in config)
    assert type(CgptForCausalLM.from_pretrained(str(mtp))) is CgptForCausalLM
    results = json.loads((mtp / "all_results.json").read_text())
    assert results["settings"]["mtp_heads"] == 2 and results["ledger"]["step_seconds"] > 0
    assert "`mtp_heads` | 2" in (mtp / "README.md").read_text()
    heads = load_file(mtp / "checkpoints" / "step_0000004" / "model_1.safetensors")
    assert sorted(heads) == ["norms.0.weight", "norms.1.weight", "projs.0.weight", "projs.1.weight"]
    assert heads["projs.1.weight"].abs().sum() > 0  # trained from zero by the run's optimizer
    assert not (plain / "checkpoints" / "step_0000004" / "model_1.safetensors").exists()


@pytest.mark.slow  # a trained run: the slow tier
def test_a_run_with_the_heads_resumes_bit_identical_and_a_changed_setting_is_refused(inputs, runs):
    _, mtp = runs
    cut = inputs / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(mtp / "checkpoints" / "step_0000002", cut / "checkpoints" / "step_0000002")
    run(inputs, cut, train={"resume_from_checkpoint": "latest"}, **MTP)
    for name in ("model.safetensors", "checkpoints/step_0000004/model_1.safetensors"):
        a, b = load_file(mtp / name), load_file(cut / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    for changed in ({**MTP, "mtp_heads": 3}, {**MTP, "mtp_weight": 0.2}, {**MTP, "mtp_anneal": 0.5}):
        name = next(k for k in MTP if changed[k] != MTP[k])
        with pytest.raises(CheckpointError, match=rf"{{'{name}': "):
            run(inputs, cut, train={"resume_from_checkpoint": "latest", "max_steps": 5}, **changed)
