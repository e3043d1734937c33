"""Pretraining with ``--document_masking``: positions restart after each EOS of a window, so attention stays within
each document (transformers' mask from restarting positions); off, the run is the plain one. Checked: the positions
in closed form, a document inside a window against the document alone (and a planted cross-document leak), no
recompile of a compiled model across windows of different layouts, the ledger's mask, a run that records the setting
for ``hf-cgpu eval``, resumes bit-identical, and refuses a resume with the setting changed.

The model applies the setting itself where transformers users call it: a plain ``model(input_ids)`` over a stream
scores as ``hf-cgpu eval``, ``generate`` starts a new document after each EOS (cached = uncached, left padding), given
position ids win, a model without the setting is the plain one bit for bit, and a saved folder does the same where
hf_cgpu is not installed."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from hf_cgpu.data.corpus import builtin_corpus, load_text_dataset
from hf_cgpu.data.packing import pack_dataset
from hf_cgpu.data.tokenizer import train_tokenizer
from hf_cgpu.data.windows import document_position_ids, eval_windows
from hf_cgpu.errors import CheckpointError
from hf_cgpu.evaluation.text import cgpt_target_loss, evaluate_language_model
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.models.cgpt.modeling_cgpt import document_position_ids as model_positions
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings
from hf_cgpu.train import fit
from hf_cgpu.train.compiled import RecompileWatch

ATOL = 2e-5  # fp32 logits of a document alone vs inside a window: only the summation order differs
EOS = 0
PAD = 1
DOCS = [[5, 9, 3, EOS], [7, 7, 8, 2, 6, EOS], [4, EOS], [11, 12, 13, 14, 15]]  # the last one runs past the window
WINDOW = [token for doc in DOCS for token in doc]


def test_positions_restart_after_each_eos():
    ids = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, EOS, 3], [EOS, 1, 2, 3, 4, EOS, 1, 2, 3]])
    assert document_position_ids(ids, EOS).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 0, 1, 2, 3, 4, 0, 1, 2]]
    # the model's own count: padding (an EOS among it too) takes no position, and a document runs on across it
    ids = torch.tensor([[EOS, PAD, 5, EOS, 7, 8], [5, 6, EOS, 7, PAD, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 1]])
    assert model_positions(ids == EOS, mask).tolist() == [[0, 0, 0, 1, 0, 1], [0, 1, 2, 0, 0, 1]]


def _model(pe: str, attn: str, **config) -> CgptForCausalLM:
    torch.manual_seed(0)
    cfg = CgptConfig(vocab_size=32, n_positions=32, n_embd=32, n_layer=2, n_head=2, position_embedding=pe, **config)
    cfg._attn_implementation = attn
    return CgptForCausalLM(cfg).eval()


@pytest.mark.parametrize("pe, attn", [("learned", "sdpa"), ("rotary", "sdpa"), ("rotary", "eager"),
                                      pytest.param("rotary", "flex_attention", marks=pytest.mark.slow)])  # block mask
def test_a_document_in_a_masked_window_has_the_logits_it_has_alone(pe, attn):
    """Each document's logits inside the window equal its logits run alone (ATOL): with the positions given, as
    training and hf-cgpu eval give them, and from the model's own reading of the EOS in a plain call (the mask beside
    its cache) and in a left-padded batch (beside the padding mask); the window with positions running on across
    the EOS (a planted cross-document leak) differs from the second document on."""
    model = _model(pe, attn, document_masking=True, pad_token_id=PAD)
    ids = torch.tensor([WINDOW])
    padded = torch.tensor([WINDOW, [PAD] * 3 + WINDOW[:-3]])
    with torch.no_grad():
        masked = model(ids, position_ids=document_position_ids(ids, EOS), use_cache=False).logits[0]
        plain = model(ids).logits[0]
        batch = model(padded, attention_mask=(padded != PAD).long()).logits
        at = 0
        for doc in DOCS:
            alone = model(torch.tensor([doc])).logits[0]
            for window in (masked, plain, batch[0]):
                torch.testing.assert_close(window[at : at + len(doc)], alone, atol=ATOL, rtol=0)
            at += len(doc)
        torch.testing.assert_close(batch[1, 3:], plain[:-3], atol=ATOL, rtol=0)
        leaked = model(ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits[0]
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


# ---------------------------------------------------------------------------- the model applies it by itself


def plain_transformers_loss(model, data, seq_len: int) -> float:
    """Mean loss of a stream as a transformers user scores it: windows of the stream (each token scored once, as
    ``eval_windows`` plans them), ``model(input_ids=...)`` with nothing else, cross-entropy of the logits."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start, skip in eval_windows(data.n_tokens, seq_len):
            window = data.windows([start], seq_len + 1)[0]
            logits = model(input_ids=window[None, :-1]).logits[0, skip:]
            total += float(F.cross_entropy(logits.double(), window[1 + skip :], reduction="sum"))
            count += seq_len - skip
    return total / count


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_plain_forward_over_a_stream_scores_as_hf_cgpu_eval(written, attn):
    """The saved run, loaded as transformers loads it and called on windows of the validation stream with input_ids
    alone, gives hf-cgpu eval's loss (1e-5); the same calls with the setting removed from the config (positions and
    attention across documents, as before) give another."""
    root, _, _ = written
    out = root / "full"
    evaluated = evaluate_language_model(str(out), str(root / "data"), seq_len=32, batch_size=3, device="cpu",
                                        progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation=attn).eval()
    data = pack_dataset(load_text_dataset(str(root / "data"))["validation"], model_tokenizer(out), 32,
                        cache_dir=root / "packed", split="validation")
    windows = torch.stack([data.windows([s], 33)[0] for s, _ in eval_windows(data.n_tokens, 32)])
    boundaries = (windows[:, :-1] == model.config.eos_token_id).sum(-1)
    assert (boundaries > 0).float().mean() > 0.6  # most windows hold the end of one document and another's start
    assert plain_transformers_loss(model, data, 32) == pytest.approx(evaluated["loss"], abs=1e-5)
    model.config.document_masking = False
    assert abs(plain_transformers_loss(model, data, 32) - evaluated["loss"]) > 1e-3


def model_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class ForceEos(LogitsProcessor):
    """Makes the next token EOS when the sequence is ``at`` tokens long and never otherwise (one EOS inside the
    continuation, real tokens after it)."""

    def __init__(self, at: int):
        self.at = at

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = input_ids.shape[1] == self.at
        scores = torch.full_like(scores, -torch.inf) if forced else scores.clone()  # the raw logits stay as they are
        scores[:, EOS] = 0.0 if forced else -torch.inf
        return scores


def generate_across_an_eos(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=PAD, logits_processor=LogitsProcessorList([ForceEos(ids.shape[1] + 3)]),
                              return_dict_in_generate=True, output_logits=True, **kwargs)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_generate_starts_a_new_document_after_each_eos(attn):
    """Left-padded prompts with an EOS inside, and an EOS forced into the continuation: with a dynamic cache, a static
    one (the mask built ahead) and none, every step's logits are those of the step's own document run alone (the
    prompt's second document, then the new document after the generated EOS), so nothing before the EOS is seen and
    positions restart there."""
    model = _model("rotary", attn, document_masking=True, pad_token_id=PAD)
    ids = torch.tensor([[5, 9, 3, EOS, 7, 7, 8], [PAD, 11, 12, 13, EOS, 4, 6]])
    mask = (torch.arange(7) >= torch.tensor([[0], [1]])).long()
    caches = ({"use_cache": True}, {"use_cache": False}, {"cache_implementation": "static"})  # static: a 4D mask
    runs = [generate_across_an_eos(model, ids, mask, **kwargs) for kwargs in caches]
    assert all(torch.equal(run.sequences, runs[0].sequences) for run in runs)
    for run in runs:
        for row in range(2):
            seq = run.sequences[row, int((mask[row] == 0).sum()) :]  # the row without its padding
            new = seq.shape[0] - len(run.logits)
            assert seq[new + 3] == EOS and seq[new + 4 :].ne(EOS).all()  # real tokens after the generated EOS
            starts = torch.arange(seq.shape[0]) - document_position_ids(seq[None], EOS)[0]
            for step, logits in enumerate(run.logits):
                last = new + step - 1  # the token whose logits choose the next one
                with torch.no_grad():
                    alone = model(seq[None, starts[last] : last + 1]).logits[0, -1]
                torch.testing.assert_close(logits[row], alone, atol=ATOL, rtol=0)


def test_given_position_ids_win():
    """Position ids given to the model or to generate are the caller's: counting on across an EOS, they make one
    document of the window, as the model without the setting reads it; restarting ones are the model's own."""
    masked = _model("rotary", "sdpa", document_masking=True, pad_token_id=PAD)
    plain = _model("rotary", "sdpa", pad_token_id=PAD)
    ids = torch.tensor([WINDOW])
    across = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        torch.testing.assert_close(masked(ids, position_ids=across).logits, plain(ids).logits)
        torch.testing.assert_close(masked(ids, position_ids=document_position_ids(ids, EOS)).logits,
                                   masked(ids).logits)
        assert not torch.allclose(masked(ids).logits, plain(ids).logits, atol=1e-3)
    prompt, mask = ids[:, :8], torch.ones(1, 8, dtype=torch.long)
    given = generate_across_an_eos(masked, prompt, mask, position_ids=across[:, :8])
    assert torch.equal(given.sequences, generate_across_an_eos(plain, prompt, mask).sequences)
    for a, b in zip(given.logits, generate_across_an_eos(plain, prompt, mask).logits):
        torch.testing.assert_close(a, b)


def test_a_cache_continued_by_hand_needs_position_ids():
    """Only generate sees the whole sequence: a call that continues a cache without position ids is refused in one
    line naming the fix, and with them it gives the full call's logits."""
    model = _model("rotary", "sdpa", document_masking=True)
    ids = torch.tensor([WINDOW[:10]])  # the second document is running at the cut
    with torch.no_grad():
        cache = model(ids[:, :9]).past_key_values
        with pytest.raises(ValueError, match=r"^document_masking: .*pass position_ids") as err:
            model(ids[:, 9:], cache=cache)
        assert "\n" not in str(err.value)
        step = model(ids[:, 9:], cache=cache, position_ids=document_position_ids(ids, EOS)[:, 9:]).logits
        torch.testing.assert_close(step[:, -1], model(ids).logits[:, -1], atol=ATOL, rtol=0)


def test_documents_longer_together_than_the_positions_fit():
    """Positions count within each document: a stream longer than n_positions runs when each document fits."""
    model = _model("learned", "sdpa", document_masking=True)
    stream = torch.tensor([WINDOW[:12] * 3])  # 36 tokens, n_positions 32, documents of at most 6
    with torch.no_grad():
        logits = model(stream).logits[0]
        torch.testing.assert_close(logits[28:34], model(torch.tensor([DOCS[1]])).logits[0], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="n_positions=32"):
        _model("learned", "sdpa")(stream)
    with pytest.raises(ValueError, match=r"^the documents' positions reach 32, beyond n_positions=32; shorten"):
        model(torch.tensor([[5] * 33]))  # one document longer than the positions


def test_without_the_setting_the_model_is_the_plain_one_bit_for_bit():
    """Off (the default, and every config saved without it): positions run on across each EOS and every token sees
    all before it, bit for bit the blocks run by hand; generate continues across an EOS as before; config.json does
    not name the setting."""
    model = _model("learned", "sdpa", pad_token_id=PAD)
    assert model.config.document_masking is False and "document_masking" not in model.config.to_diff_dict()
    ids = torch.tensor([WINDOW])
    backbone = model.transformer

    def by_hand(x):
        h = backbone.wte(x) + backbone.wpe(torch.arange(x.shape[1]))[None]
        for block in backbone.h:
            h = block(h)
        return model.lm_head(backbone.ln_f(h))

    with torch.no_grad():
        reference = by_hand(ids)
        for kwargs in ({}, {"use_cache": False}, {"attention_mask": torch.ones_like(ids)}):
            assert torch.equal(model(ids, **kwargs).logits, reference), kwargs
        out = generate_across_an_eos(model, ids[:, :8], torch.ones(1, 8, dtype=torch.long))
        for step, logits in enumerate(out.logits):
            torch.testing.assert_close(logits, by_hand(out.sequences[:, : 8 + step])[:, -1], atol=ATOL, rtol=0)


def test_the_saved_folder_applies_it_without_hf_cgpu(written, tmp_path):
    """Loaded with trust_remote_code where hf_cgpu cannot be imported, the run's folder scores windows and generates
    across an EOS exactly as the model loaded with hf_cgpu does."""
    from isolation import run_without_hf_cgpu

    root, _, _ = written
    out = root / "full"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    eos = model.config.eos_token_id
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(3, model.config.vocab_size, (2, 24), generator=g)
    windows[:, [5, 13]] = eos
    torch.save(windows, tmp_path / "windows.pt")
    run_without_hf_cgpu(f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith('transformers_modules'), type(model).__module__
        windows = torch.load({str(tmp_path / "windows.pt")!r})
        with torch.no_grad():
            logits = model(windows).logits
            generated = model.generate(windows[:, :16], max_new_tokens=6, do_sample=False, eos_token_id=None,
                                       pad_token_id={eos})
        torch.save(dict(logits=logits, generated=generated), {str(tmp_path / "child.pt")!r})
        print('OK')
        """, tmp_path)
    child = torch.load(tmp_path / "child.pt")
    with torch.no_grad():
        masked = model(windows, position_ids=document_position_ids(windows, eos), use_cache=False).logits
        generated = model.generate(windows[:, :16], max_new_tokens=6, do_sample=False, eos_token_id=None,
                                   pad_token_id=eos)
    torch.testing.assert_close(child["logits"], masked, atol=ATOL, rtol=0)
    assert torch.equal(child["generated"], generated)
