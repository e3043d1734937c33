"""Text quality machinery: training windows (shifted / random / fixed), whole-split scoring and bits per character,
best-by-validation weights, early stopping, the epoch plan, and `hf-cgpu eval` for language models."""

from __future__ import annotations

import dataclasses
import json
import math

import datasets
import numpy as np
import pytest
import torch
from hypothesis import given, settings as hsettings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from hf_cgpu.data.packing import pack_dataset
from hf_cgpu.data.tokenizer import train_tokenizer
from hf_cgpu.data.windows import WindowOrder, eval_windows
from hf_cgpu.evaluation.text import score_stream
from hf_cgpu.train import SampleOrder, fit
from hf_cgpu.settings import SettingsError, TrainSettings
from test_loop import ToyTask, settings


# ---------------------------------------------------------------------------------------------------- windows


def test_shifted_windows_tile_each_epoch_at_a_new_offset():
    n, window, batch = 1000, 10, 7
    order = WindowOrder(n, window, seed=3, mode="shifted")
    per_epoch = order.per_epoch
    assert per_epoch == (n - (window - 1)) // window
    flat = torch.cat([order.indices(k, batch) for k in range(3 * per_epoch // batch + 1)]).numpy()
    offsets = set()
    for epoch in range(3):
        starts = flat[epoch * per_epoch : (epoch + 1) * per_epoch]
        # windows of one epoch share one offset, cover it without repeats, and stay inside the stream
        assert len(set(starts % window)) == 1 and len(set(starts)) == len(starts) == per_epoch
        assert starts.min() >= 0 and starts.max() + window <= n
        offsets.add(int(starts[0] % window))
    assert len(offsets) > 1, "every epoch must cut the stream at a new offset"


def test_window_order_is_a_function_of_seed_and_step_only():
    for mode in ("shifted", "random", "fixed"):
        a, b = WindowOrder(5000, 33, seed=1, mode=mode), WindowOrder(5000, 33, seed=1, mode=mode)
        late_first = [b.indices(k, 16) for k in (40, 3, 17)]  # another call order, as a resumed run has
        assert all(torch.equal(a.indices(k, 16), x) for k, x in zip((40, 3, 17), late_first)), mode
        assert not torch.equal(WindowOrder(5000, 33, seed=2, mode=mode).indices(3, 16), a.indices(3, 16)), mode


def test_random_windows_cover_any_offset_and_fixed_ones_the_old_blocks():
    n, window = 400, 9
    starts = torch.cat([WindowOrder(n, window, 0, "random").indices(k, 64) for k in range(20)])
    assert starts.min() >= 0 and starts.max() <= n - window and len(set((starts % window).tolist())) == window
    fixed = WindowOrder(n, window, seed=5, mode="fixed")
    blocks = SampleOrder(n // window, seed=5)  # what the loop drew before windows existed
    for k in range(10):
        assert torch.equal(fixed.indices(k, 8), blocks.indices(k, 8) * window)


def test_bad_data_order_is_refused():
    with pytest.raises(ValueError, match="data_order"):
        WindowOrder(100, 10, 0, mode="sorted")
    from hf_cgpu.tasks.causal_lm import GPTSettings

    with pytest.raises(SettingsError, match="data_order"):
        GPTSettings(data_order="sorted")


@given(n=st.integers(min_value=2, max_value=400), seq_len=st.integers(min_value=1, max_value=64))
@hsettings(max_examples=200, deadline=None)
def test_eval_windows_score_every_token_exactly_once(n, seq_len):
    scored = np.zeros(n, dtype=int)
    for start, skip in eval_windows(n, seq_len):
        assert 0 <= start and start + seq_len + 1 <= n and 0 <= skip < seq_len
        scored[start + 1 + skip : start + seq_len + 1] += 1
    expected = np.ones(n, dtype=int)
    expected[0] = 0  # the first token has no context
    if n < seq_len + 1:
        expected[:] = 0  # shorter than one window: nothing fits
    assert (scored == expected).all()


# ---------------------------------------------------------------------------------------------------- scoring


@pytest.fixture(scope="module")
def stream_data(tmp_path_factory):
    tok = train_tokenizer(["abc"], vocab_size=257, show_progress=False)  # one token per ASCII character
    rng = np.random.default_rng(0)
    docs = ["".join(rng.choice(list("abcdefgh"), size=int(k))) for k in rng.integers(5, 60, size=40)]
    data = pack_dataset(datasets.Dataset.from_dict({"text": docs}), tok, 16, tmp_path_factory.mktemp("pack"))
    return data, docs


def bigram_loss(table: torch.Tensor):
    """A model without context beyond one token: mean -log p(target | previous token) over scored targets."""
    def loss_fn(x, y):
        logp = torch.log_softmax(table, dim=-1)[x, y.clamp(min=0)]  # (B, T)
        mask = y != -100
        return -(logp * mask).sum() / mask.sum()
    return loss_fn


@pytest.mark.parametrize("seq_len,batch", [(16, 4), (7, 3), (50, 1)])
def test_score_stream_equals_the_closed_form_on_a_bigram_model(stream_data, seq_len, batch):
    data, docs = stream_data
    torch.manual_seed(0)
    table = torch.randn(257, 257)
    tokens = torch.from_numpy(data.tokens.astype("int64"))
    logp = torch.log_softmax(table, dim=-1)
    closed = -logp[tokens[:-1], tokens[1:]].double().sum().item()  # every consecutive pair of the stream once
    r = score_stream(bigram_loss(table), data, seq_len, batch, "cpu")
    assert r["tokens"] == data.n_tokens - 1
    assert r["loss"] == pytest.approx(closed / (data.n_tokens - 1), rel=1e-5)
    assert data.n_chars == sum(map(len, docs))
    assert r["bpc"] == pytest.approx(closed / math.log(2) / data.n_chars, rel=1e-5)
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))


def test_uniform_model_scores_ln_vocab(stream_data):
    data, _ = stream_data
    r = score_stream(bigram_loss(torch.zeros(257, 257)), data, 16, 4, "cpu")
    assert r["loss"] == pytest.approx(math.log(257))
    assert r["bpc"] == pytest.approx((data.n_tokens - 1) * math.log2(257) / data.n_chars)


def test_cgpt_stream_score_matches_one_full_forward(stream_data):
    """With one window covering the stream, the score is the model's plain next-token loss on it."""
    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM

    data, _ = stream_data
    n = data.n_tokens
    torch.manual_seed(0)
    model = CgptForCausalLM(CgptConfig(vocab_size=257, n_positions=n, n_embd=32, n_layer=2, n_head=2,
                                       loss_chunk_size=0)).eval()
    ids = torch.from_numpy(data.tokens.astype("int64"))[None]
    with torch.no_grad():
        full = torch.nn.functional.cross_entropy(model(input_ids=ids[:, :-1]).logits[0], ids[0, 1:]).item()
        fn = lambda x, y: model(input_ids=x, shift_labels=y, use_cache=False).loss  # noqa: E731
        assert score_stream(fn, data, n - 1, 2, "cpu")["loss"] == pytest.approx(full, rel=1e-5)
        short = score_stream(fn, data, 16, 2, "cpu")["loss"]  # less context: a different (higher) figure
    assert short != pytest.approx(full, rel=1e-4)


# ---------------------------------------------------------------------------------------------------- best weights


class ScriptedValTask(ToyTask):
    """The toy regression, with validation figures read from a script (one per evaluation) and safetensors saves."""

    best_metric = "val_loss"

    def __init__(self, script):
        super().__init__()
        self.script, self.evals = list(script), 0

    def evaluate(self, model, settings, device):
        value = self.script[min(self.evals, len(self.script) - 1)]
        self.evals += 1
        return {"val_loss": value}

    def save_pretrained(self, model, output_dir):
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(output_dir / "model.safetensors"))


def weights_at(tmp_path, step):
    """The toy's weights after ``step`` steps of the same run, from a plain run that stops there."""
    out = tmp_path / f"plain{step}"
    fit(ScriptedValTask([1.0]), settings(out, max_steps=step, save_best=False, checkpointing_steps=0))
    return load_file(str(out / "model.safetensors"))


def test_best_weights_are_kept_and_loaded_at_the_end(tmp_path):
    out = tmp_path / "run"
    task = ScriptedValTask([3.0, 2.0, 2.5, 2.6, 2.4, 2.7])  # evaluations at steps 2, 4, ..., 12 (final)
    r = fit(task, settings(out, eval_steps=2, load_best_at_end=True))
    assert r["best_step"] == 4 and r["best_val_loss"] == 2.0 and r["model_step"] == 4
    assert r["val_loss"] == 2.0 and r["last_val_loss"] == 2.7 and r["steps"] == 12
    assert json.loads((out / "best" / "best.json").read_text())["step"] == 4
    best, final = load_file(str(out / "best" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    expected = weights_at(tmp_path, 4)
    for k in expected:
        assert torch.equal(best[k], expected[k]) and torch.equal(final[k], expected[k])


def test_without_load_best_the_last_weights_are_saved_and_best_kept_beside(tmp_path):
    out = tmp_path / "run"
    r = fit(ScriptedValTask([3.0, 2.0, 2.5, 2.6, 2.4, 2.7]), settings(out, eval_steps=2))
    assert r["model_step"] == 12 and r["val_loss"] == 2.7 and r["best_step"] == 4
    last = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(last[k], v) for k, v in weights_at(tmp_path, 12).items())
    assert (out / "best" / "model.safetensors").is_file()


def test_early_stopping_after_patience_evaluations(tmp_path, capsys):
    out = tmp_path / "run"
    r = fit(ScriptedValTask([3.0, 2.0, 2.5, 2.6, 1.0]), settings(out, eval_steps=2, early_stopping_patience=2))
    assert r["steps"] == 8 and r["best_step"] == 4  # evaluations at 2, 4 (best), 6, 8 -> stop
    assert "early stopping at step 8" in capsys.readouterr().out


def test_best_state_survives_resume(tmp_path):
    out = tmp_path / "run"
    fit(ScriptedValTask([3.0, 2.0, 2.5]), settings(out, max_steps=6, eval_steps=2, checkpointing_steps=6))
    r = fit(ScriptedValTask([2.9, 2.8, 2.7]), settings(out, max_steps=12, eval_steps=2, checkpointing_steps=6,
                                                       resume_from_checkpoint="latest"))
    assert r["best_step"] == 4 and r["best_val_loss"] == 2.0  # the first process's best still wins


def test_load_best_needs_evaluations():
    with pytest.raises(SettingsError, match="eval_steps"):
        TrainSettings(load_best_at_end=True, eval_steps=0)


# ---------------------------------------------------------------------------------------------------- plan


def test_epoch_plan_warns_beyond_four_epochs_with_what_the_auto_rule_would_add():
    from hf_cgpu.budget.auto import REGIMES
    from hf_cgpu.tasks.causal_lm import epoch_plan

    s = TrainSettings(max_steps=100, micro_batch_size=4, gradient_accumulation_steps=2)
    few = epoch_plan(s, seq_len=128, corpus_tokens=100 * 8 * 128, num_params=10**6)
    assert len(few) == 1 and "1.0 epochs" in few[0]
    small = 100 * 8 * 128 // 10  # 10 epochs
    many = epoch_plan(s, seq_len=128, corpus_tokens=small, num_params=10**6)
    assert "10.0 epochs" in many[0] and many[1].startswith("warning: 10 epochs of one corpus for 1.0M parameters")
    assert f"~{small / 20 / 1e6:.2f}M-parameter" in many[1] and "data-bound: epochs x params/token ~ 977" in many[1]
    data_bound = REGIMES[1]
    for flag in (f"--dropout {data_bound.dropout:g}", f"--weight_decay {data_bound.weight_decay:g}",
                 "--load_best_at_end true", "--preset auto"):
        assert flag in many[1], flag
    # ten times the parameters: far data-bound, the rule's stronger dropout
    far = epoch_plan(s, seq_len=128, corpus_tokens=small, num_params=10**7)[1]
    assert "far data-bound" in far and f"--dropout {REGIMES[2].dropout:g}" in far
    # what the run already does is not asked for; all of it: a note, not a warning
    part = epoch_plan(dataclasses.replace(s, eval_steps=10, load_best_at_end=True), seq_len=128, corpus_tokens=small,
                      num_params=10**6, dropout=0.1)[1]
    assert "--dropout" not in part and "--load_best_at_end" not in part and "--weight_decay 2" in part
    done = epoch_plan(dataclasses.replace(s, eval_steps=10, load_best_at_end=True, weight_decay=2.0), seq_len=128,
                      corpus_tokens=small, num_params=10**6, dropout=0.1)
    assert len(done) == 2 and done[1].startswith("note: 10 epochs") and "warning" not in done[1]
    # many epochs of a model small for them (pressure under 0.8: 4 epochs of a compute-optimal model): no warning
    assert len(epoch_plan(s, seq_len=128, corpus_tokens=small, num_params=500)) == 1
    # --auto chose the epochs and regularised for them (its line says so): no warning that contradicts it
    chosen = epoch_plan(s, seq_len=128, corpus_tokens=small, num_params=10**6, auto=True)
    assert len(chosen) == 1 and "10.0 epochs" in chosen[0]


def test_the_text_presets_are_regularised_as_the_rule_asks_for_their_corpus():
    """zh-poetry-modern on all of zh-poetry (10.6M tokens, 110M parameters, 24.6 planned epochs): a note, no warning."""
    from hf_cgpu.recipes import RECIPES, parse
    from hf_cgpu.tasks.causal_lm import epoch_plan

    gpt, train = parse(RECIPES["gpt"], ["--preset", "zh-poetry-modern"])
    lines = epoch_plan(train, gpt.seq_len, corpus_tokens=10_639_176, num_params=110_120_000, dropout=gpt.dropout)
    assert lines[1].startswith("note: 25 epochs") and "data-bound" in lines[1], lines


# ---------------------------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def saved_gpt(tmp_path_factory):
    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM

    d = tmp_path_factory.mktemp("gpt")
    tok = train_tokenizer(["abc"], vocab_size=257, show_progress=False)
    torch.manual_seed(0)
    CgptForCausalLM(CgptConfig(vocab_size=257, n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_eval_cli_scores_the_whole_split(saved_gpt, tmp_path, capsys):
    from hf_cgpu.cli import main

    docs = tmp_path / "data"
    docs.mkdir()
    (docs / "train.jsonl").write_text("".join(json.dumps({"text": "abc " * 20 + str(i)}) + "\n" for i in range(30)))
    (docs / "validation.jsonl").write_text("".join(json.dumps({"text": "cab " * 15 + str(i)}) + "\n" for i in range(9)))
    out_json = tmp_path / "eval.json"
    assert main(["eval", str(saved_gpt), "--dataset", str(docs), "--seq_len", "32", "--batch_size", "3",
                 "--device", "cpu", "--cache_dir", str(tmp_path / "cache"), "--output_json", str(out_json)]) == 0
    r = json.loads(out_json.read_text())
    chars = sum(len("cab " * 15 + str(i)) for i in range(9))
    assert r["whole_split"] and r["characters"] == chars and r["documents"] == 9
    assert r["tokens"] == chars + 9 - 1  # one token per character, an EOS after each document, minus the first
    assert r["bpc"] == pytest.approx(r["loss"] * r["tokens"] / math.log(2) / chars)
    assert 0 < r["loss"] < 2 * math.log(257)


def test_eval_of_a_split_too_short_for_one_window_names_the_split(saved_gpt, tmp_path, capsys):
    from hf_cgpu.cli import main

    docs = tmp_path / "data"
    docs.mkdir()
    (docs / "train.jsonl").write_text("".join(json.dumps({"text": "abc " * 20}) + "\n" for i in range(5)))
    (docs / "validation.jsonl").write_text(json.dumps({"text": "short"}) + "\n")
    assert main(["eval", str(saved_gpt), "--dataset", str(docs), "--seq_len", "32", "--device", "cpu",
                 "--cache_dir", str(tmp_path / "cache")]) == 2
    assert "error: the validation split has only 6 tokens" in capsys.readouterr().err


def test_eval_of_a_file_named_alone_scores_all_of_it(saved_gpt, tmp_path, capsys):
    """--dataset data/validation.jsonl: no validation split is carved from it (training would); every document is
    scored, whatever --split says."""
    from hf_cgpu.cli import main

    path = tmp_path / "validation.jsonl"
    path.write_text("".join(json.dumps({"text": "cab " * 15 + str(i)}) + "\n" for i in range(9)))
    out_json = tmp_path / "eval.json"
    assert main(["eval", str(saved_gpt), "--dataset", str(path), "--seq_len", "32", "--device", "cpu",
                 "--cache_dir", str(tmp_path / "cache"), "--output_json", str(out_json)]) == 0
    r = json.loads(out_json.read_text())
    assert r["documents"] == 9 and r["split"] == str(path) and r["whole_split"]
    assert "carved" not in capsys.readouterr().err


def test_eval_cli_bad_input_is_one_line_exit_2(saved_gpt, tmp_path, capsys):
    from hf_cgpu.cli import main

    assert main(["eval", str(tmp_path / "nope"), "--dataset", "builtin"]) == 2
    assert main(["eval", str(tmp_path), "--dataset", "builtin"]) == 2  # a folder with no model
    assert main(["eval", str(saved_gpt), "--dataset", "builtin", "--seq_len", "999", "--device", "cpu"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 3 and "not found" in errors[0] and "config.json" in errors[1] and "positions" in errors[2]
