"""Pretraining with ``--document_masking``: positions restart after each EOS of a window, so attention stays within
each document (transformers' mask from restarting positions); off, the run is the plain one. Checked: the positions
in closed form, a document inside a window against the document alone (and a planted cross-document leak), no
recompile of a compiled model across windows of different layouts, the ledger's mask, a run that records the setting
for ``hf-cgpu eval``, resumes bit-identical, and refuses a resume with the setting changed."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from hf_cgpu.data.corpus import builtin_corpus
from hf_cgpu.data.tokenizer import train_tokenizer
from hf_cgpu.data.windows import document_position_ids
from hf_cgpu.errors import CheckpointError
from hf_cgpu.evaluation.text import cgpt_target_loss, evaluate_language_model
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings
from hf_cgpu.train import fit
from hf_cgpu.train.compiled import RecompileWatch

ATOL = 2e-5  # fp32 logits of a document alone vs inside a window: only the summation order differs
EOS = 0
DOCS = [[5, 9, 3, EOS], [7, 7, 8, 2, 6, EOS], [4, EOS], [11, 12, 13, 14, 15]]  # the last one runs past the window
WINDOW = [token for doc in DOCS for token in doc]


def test_positions_restart_after_each_eos():
    ids = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, EOS, 3], [EOS, 1, 2, 3, 4, EOS, 1, 2, 3]])
    assert document_position_ids(ids, EOS).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 0, 1, 2, 3, 4, 0, 1, 2]]


def _model(pe: str, attn: str) -> CgptForCausalLM:
    torch.manual_seed(0)
    cfg = CgptConfig(vocab_size=32, n_positions=32, n_embd=32, n_layer=2, n_head=2, position_embedding=pe)
    cfg._attn_implementation = attn
    return CgptForCausalLM(cfg).eval()


@pytest.mark.parametrize("pe, attn", [("learned", "sdpa"), ("rotary", "sdpa"), ("rotary", "eager"),
                                      pytest.param("rotary", "flex_attention", marks=pytest.mark.slow)])  # block mask
def test_a_document_in_a_masked_window_has_the_logits_it_has_alone(pe, attn):
    """Each document's logits inside the window equal its logits run alone (ATOL); the same window without the
    positions (a planted cross-document leak) differs from the second document on."""
    model = _model(pe, attn)
    ids = torch.tensor([WINDOW])
    with torch.no_grad():
        masked = model(ids, position_ids=document_position_ids(ids, EOS), use_cache=False).logits[0]
        at = 0
        for doc in DOCS:
            alone = model(torch.tensor([doc])).logits[0]
            torch.testing.assert_close(masked[at : at + len(doc)], alone, atol=ATOL, rtol=0)
            at += len(doc)
        leaked = model(ids, use_cache=False).logits[0]
    second = slice(len(DOCS[0]), len(DOCS[0]) + len(DOCS[1]))
    assert not torch.allclose(leaked[second], masked[second], atol=1e-3)


def test_the_masked_loss_is_the_documents_loss_and_off_is_the_plain_call():
    """The summed loss of a window with document masking is the sum of each document's loss alone (EOS predicts the
    next document's first token from its own document); off, ``cgpt_target_loss`` is the model's plain call, bit for bit."""
    model = _model("learned", "sdpa")
    ids = torch.tensor([WINDOW])
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        total = cgpt_target_loss(model, x, y, EOS) * y.numel()
        alone, at = 0.0, 0
        for doc in DOCS:
            n = min(len(doc), x.shape[1] - at)
            alone += cgpt_target_loss(model, x[:, at : at + n], y[:, at : at + n]) * n
            at += n
        assert float(total) == pytest.approx(float(alone), rel=1e-5)
        plain = model(input_ids=x, shift_labels=y, use_cache=False, return_logits=False).loss
        assert torch.equal(cgpt_target_loss(model, x, y), plain)


def test_a_compiled_model_takes_windows_of_any_layout_without_recompiling():
    """One graph, no graph break; then dynamo's eager backend (the guards inductor gets, no codegen): three windows
    with their EOS in different places, forward and backward, compile once and never again."""
    model = _model("rotary", "sdpa").train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 32, (2, 24), generator=g)
    ids[:, 5] = EOS
    explained = torch._dynamo.explain(model)(input_ids=ids, position_ids=document_position_ids(ids, EOS),
                                             shift_labels=ids, use_cache=False, return_logits=False)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    model.compile(dynamic=False, backend="eager")
    with RecompileWatch(lambda line: None) as watch:
        for _ in range(3):
            ids = torch.randint(1, 32, (2, 25), generator=g)
            ids[torch.rand(ids.shape, generator=g) < 0.2] = EOS
            cgpt_target_loss(model, ids[:, :-1], ids[:, 1:], EOS).backward()
    assert watch.count == 0, watch.events


def test_the_ledger_prices_a_mask_per_window_when_on():
    """As for packed fine-tuning rows: one (B, 1, T, T) bool mask under SDPA; none when off."""
    from hf_cgpu.budget.memory import ledger

    def mask(**kw):
        shape = GPTSettings(n_layer=2, n_embd=64, n_head=4, seq_len=256, **kw).run_shape(vocab_size=1000)
        setup = shape.setup(TrainSettings(micro_batch_size=3))
        return next(r.bytes for r in ledger(shape.model, setup).rows if r.key == "packed_mask")

    assert mask() == 0
    assert mask(document_masking=True) == 3 * 256**2


GPT = dict(n_layer=1, n_embd=32, n_head=2, seq_len=32, loss_chunk_size=8, prompts="a", max_new_tokens=2,
           document_masking=True)
TRAIN = dict(max_steps=4, micro_batch_size=2, warmup_steps=1, eval_steps=0, eval_batches=0, checkpointing_steps=2,
             progress=False, mixed_precision="no", learning_rate=1e-2)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Short documents (a few per window, as poems are), a finished run with checkpoints."""
    root = tmp_path_factory.mktemp("documents")
    lines = [line.strip() for text in builtin_corpus()[:40] for line in text.splitlines() if len(line.strip()) > 20]
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("".join(json.dumps({"text": t[:60]}) + "\n" for t in lines[:600]))
    tok = train_tokenizer(lines[:600], vocab_size=300, show_progress=False)
    tok.save_pretrained(root / "tok")
    gpt = GPTSettings(**GPT, tokenizer=str(root / "tok"), dataset=str(root / "data"))
    results = fit(CausalLMTask(gpt), TrainSettings(**TRAIN, output_dir=str(root / "full")))
    return root, gpt, results


def test_the_run_records_the_setting_and_eval_scores_as_it_validated(written):
    """config.json says document_masking; hf-cgpu eval reads it and gives the run's own final validation loss, which
    differs from scoring the same windows without the mask."""
    root, _, results = written
    out = root / "full"
    assert json.loads((out / "config.json").read_text())["document_masking"] is True
    scored = evaluate_language_model(str(out), str(root / "data"), seq_len=32, batch_size=3, device="cpu", progress=False)
    assert scored["loss"] == pytest.approx(results["val_loss"], rel=1e-6)
    config = json.loads((out / "config.json").read_text())
    del config["document_masking"]
    (root / "unmasked").mkdir()
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (root / "unmasked" / f).write_bytes((out / f).read_bytes())
    (root / "unmasked" / "config.json").write_text(json.dumps(config))
    unmasked = evaluate_language_model(str(root / "unmasked"), str(root / "data"), seq_len=32, batch_size=3, device="cpu",
                                       progress=False)
    assert unmasked["loss"] != pytest.approx(scored["loss"], rel=2e-4)


def test_a_masked_run_resumes_bit_identical_and_the_setting_is_fixed(written):
    """Resumed at step 2, the run ends with the uninterrupted run's weights bit for bit; resuming with the setting
    off is refused naming it."""
    from safetensors.torch import load_file

    root, gpt, _ = written
    cut = root / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "full" / "checkpoints" / "step_0000002", cut / "checkpoints" / "step_0000002")
    fit(CausalLMTask(gpt), TrainSettings(**TRAIN, output_dir=str(cut), resume_from_checkpoint="latest"))
    a, b = load_file(root / "full" / "model.safetensors"), load_file(cut / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(CheckpointError, match="document_masking"):
        fit(CausalLMTask(dataclasses.replace(gpt, document_masking=False)),
            TrainSettings(**{**TRAIN, "max_steps": 5}, output_dir=str(cut), resume_from_checkpoint="latest"))
