"""``--preset auto``: the rule (``budget.auto.choose``) against the regimes it is fitted to, the one line a run prints,
the command line over the choice, a resume that keeps the choice, and ``hf-cgpu budget`` showing the same choice."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from hf_cgpu.budget.auto import REGIMES, SHAPES, Candidate, choose, train_seconds
from hf_cgpu.budget.card import CPU, find_card, with_peak
from hf_cgpu.cli import main as cli_main
from hf_cgpu.commands.budget import describe_run
from hf_cgpu.commands.budget import run as budget_run
from hf_cgpu.errors import CheckpointError, SettingsError
from hf_cgpu.recipes import RECIPES, parse
from hf_cgpu.tasks.auto import CHOICE_FILE, auto_choice, candidates, resolve

H200 = 790e12 * 0.4  # a flat model-FLOP rate for the synthetic shapes
H200_CARD = find_card("H200")  # the card the measured cells ran on, by its public figures
ZH_POETRY = 10_600_000  # zh-poetry's training tokens with the 8k tokenizer
STEP = 32 * 4 * 512  # the auto preset's tokens per step


def synthetic(n_params: float, rate: float = H200, startup: float = 0.0) -> Candidate:
    """A shape whose step runs at the model-FLOP ``rate``."""
    return Candidate(1, 1, 1, int(n_params), 6.0 * n_params, 6.0 * n_params * STEP / rate, startup)


def ladder(rate: float = H200, startup: float = 0.0) -> list[Candidate]:
    return [synthetic(n, rate, startup) for n in (1e6, 5e6, 14e6, 29e6, 91e6)]


LADDER = ladder()


def regularisation(settings: dict) -> tuple:
    """Larger = more regularisation: dropout, the two decays, and a cosine that ends lower."""
    return settings["dropout"], settings["weight_decay"], settings["muon_weight_decay"], -settings["min_lr_ratio"]


def test_a_single_epoch_run_gets_the_ordinary_pretraining_settings():
    choice = choose(10_000_000_000, 7, LADDER, STEP)  # 10B tokens: far under one epoch in 7 minutes
    s = choice.settings
    assert (s["dropout"], s["weight_decay"], s["muon_weight_decay"], s["min_lr_ratio"]) == (0.0, 0.1, 0.0, 0.1)
    assert "compute-bound" in choice.why


@pytest.mark.parametrize("minutes", [2, 7, 60, 600])
def test_where_data_is_plenty_the_shape_is_chinchillas(minutes):
    """The largest shape with at least 20 training tokens per parameter in the minutes."""
    choice = choose(100_000_000_000, minutes, LADDER, STEP)
    compute = H200 * train_seconds(minutes)
    fits = [c for c in LADDER if compute / c.flops_per_token >= 20 * c.n_params]
    assert f"({max(c.n_params for c in fits) / 1e6:,.1f}M params" in choice.why, choice.why


def test_many_epochs_get_dropout_and_strong_decay():
    for tokens, minutes in ((ZH_POETRY, 7), (ZH_POETRY, 2), (1_000_000, 2), (3_000_000, 60)):
        choice = choose(tokens, minutes, LADDER, STEP)
        epochs = float(choice.why.split(" epochs")[0].split("~ ")[-1].replace(",", ""))
        assert epochs > 10, choice.why
        s = choice.settings
        assert s["dropout"] >= 0.1 and s["weight_decay"] >= 2.0 and s["muon_weight_decay"] >= 0.25, choice.why
        assert s["min_lr_ratio"] == 0.0 and s["fit_schedule_to_time"]


def test_the_measured_cell_gets_the_measured_preset(tmp_path):
    """zh-poetry in 7 minutes on an H200: the settings zh-poetry-modern measured best (RESULTS.md, the speedrun
    options on zh-poetry), everything the rule does not choose from the auto preset."""
    gpt, train = parse(RECIPES["gpt"], ["--preset", "auto"])
    s = auto_choice(gpt, train, ZH_POETRY, H200_CARD).settings
    modern = parse(RECIPES["gpt"], ["--preset", "zh-poetry-modern"])
    for key in ("n_layer", "n_embd", "n_head", "value_embeddings", "dropout"):
        assert s[key] == getattr(modern[0], key), key
    assert (s["weight_decay"], s["muon_weight_decay"], s["min_lr_ratio"], s["warmup_steps"]) == (
        modern[1].weight_decay, modern[1].optimizer_options.muon_weight_decay, modern[1].min_lr_ratio,
        modern[1].warmup_steps)
    assert s["max_steps"] > 2000
    # what the rule does not choose comes from the auto preset: the same architecture and optimizer as the measured one
    chosen_gpt, chosen_train, _ = resolve(gpt, train, ZH_POETRY, H200_CARD, tmp_path)
    differ = {f.name for f in dataclasses.fields(chosen_gpt)
              if getattr(chosen_gpt, f.name) != getattr(modern[0], f.name)}
    assert differ <= {"auto", "preset", "given_flags", "prompts", "max_new_tokens"}, differ  # prompts: the corpus's
    differ = {f.name for f in dataclasses.fields(chosen_train)
              if getattr(chosen_train, f.name) != getattr(modern[1], f.name)}
    assert differ <= {"max_steps"}, differ


@pytest.mark.parametrize("card", [CPU, find_card("RTX 3060"), find_card("RTX 5070 Ti"), H200_CARD])
@pytest.mark.parametrize("compiled", [False, True])
def test_more_minutes_never_choose_less_regularisation_or_a_smaller_model(card, compiled):
    gpt, train = parse(RECIPES["gpt"], ["--preset", "auto", "--compile", str(compiled).lower()])
    shapes = candidates(gpt, train, card)
    for tokens in (int(10 ** (4 + i / 24)) for i in range(193)):  # 10k to 1T tokens
        before = None
        for i in range(240):
            minutes = 0.05 * 1.05 ** i  # 0.05 to ~6,000 minutes
            s = choose(tokens, minutes, shapes, STEP).settings
            now = (regularisation(s), s["n_layer"] * s["n_embd"] ** 2)
            if before is not None:
                assert now[0] >= before[0] and now[1] >= before[1], (tokens, minutes, before, now)
            before = now


def test_the_rule_chooses_from_its_table():
    regimes = {regularisation({"dropout": r.dropout, "weight_decay": r.weight_decay,
                               "muon_weight_decay": r.muon_weight_decay, "min_lr_ratio": r.min_lr_ratio})
               for r in REGIMES}
    for tokens in (10_000, 10_000_000, 10_000_000_000):
        s = choose(tokens, 7, LADDER, STEP).settings
        assert regularisation(s) in regimes
    gpt, train = parse(RECIPES["gpt"], ["--preset", "auto"])
    assert [(c.n_layer, c.n_embd, c.n_head) for c in candidates(gpt, train, H200_CARD)] == list(SHAPES)


def test_the_command_line_wins_over_the_choice(tmp_path):
    gpt, train = parse(RECIPES["gpt"], ["--preset", "auto", "--dropout", "0.3", "--n_layer", "3",
                                        "--muon_weight_decay", "0.05"])
    new_gpt, new_train, line = resolve(gpt, train, ZH_POETRY, H200_CARD, tmp_path)
    assert new_gpt.dropout == 0.3 and new_gpt.n_layer == 3
    assert new_train.optimizer_options.muon_weight_decay == 0.05
    assert new_gpt.n_embd == 768 and new_train.weight_decay == 2.0  # what was not given is chosen
    assert "given, kept: --n_layer 3, --dropout 0.3, --muon_weight_decay 0.05" in line
    assert all(c.n_layer == 3 for c in candidates(gpt, train, H200_CARD))  # the shapes priced are those it can build
    assert json.loads((tmp_path / CHOICE_FILE).read_text())["settings"]["dropout"] == 0.1  # the rule's own choice


@pytest.mark.parametrize("flags, smallest", [(["--value_embeddings", "3"], "6x384"), (["--n_head", "24"], "6x384"),
                                             (["--n_embd", "120"], "4x120")])
def test_an_option_some_shapes_cannot_take_leaves_those_out(flags, smallest):
    """A flag valid for the larger shapes only (3 value tables need 6 layers) narrows the shapes the rule chooses
    from, instead of refusing the run over a shape it need not choose."""
    gpt, train = parse(RECIPES["gpt"], ["--preset", "auto", *flags])
    shapes = candidates(gpt, train, H200_CARD)
    assert min(shapes, key=lambda c: c.n_params).name == smallest
    assert f"at {smallest} (" in choose(1_000, 7, shapes, STEP).why  # a tiny corpus: the smallest left


def test_options_no_shape_can_take_are_one_line(tmp_path):
    """7 value tables need 14 layers, more than any shape: given on the command line (a preset's deep model makes the
    flag valid), no shape is left."""
    preset = tmp_path / "deep.json"
    preset.write_text(json.dumps({"auto": True, "n_layer": 14, "max_minutes": 7}))
    gpt, train = parse(RECIPES["gpt"], ["--preset", str(preset), "--value_embeddings", "7"])
    expected = r"^--auto chooses among the shapes 4x128, .*12x768 and none takes these options: at 12x768, "
    with pytest.raises(SettingsError, match=expected + r"value_embeddings=7 must be in \[0, n_layer // 2 = 6\]"):
        candidates(gpt, train, H200_CARD)


def test_a_schedule_not_fitted_to_the_minutes_plans_the_steps_they_hold():
    """--fit_schedule_to_time false (given): the cosine ends at the steps the minutes are estimated to hold, not at
    the fitted run's upper bound (twice as many), and the line does not claim a fitted cosine."""
    argv = ["--preset", "auto", "--max_minutes", "7"]
    fitted = auto_choice(*parse(RECIPES["gpt"], argv), ZH_POETRY, H200_CARD)
    fixed = auto_choice(*parse(RECIPES["gpt"], [*argv, "--fit_schedule_to_time", "false"]), ZH_POETRY, H200_CARD)
    steps = int(fitted.why.split("~")[-2].split(" steps")[0].replace(",", ""))
    assert fitted.settings["max_steps"] >= 2 * steps and "fitted to the minutes" in fitted.why
    assert fixed.settings["max_steps"] == steps and "fitted" not in fixed.why
    assert f"cosine to 0 over {steps:,} steps" in fixed.why
    line = resolve(*parse(RECIPES["gpt"], [*argv, "--fit_schedule_to_time", "false"]), ZH_POETRY, H200_CARD, Path("."),
                   save=False)[2]
    assert line.endswith("; given, kept: --fit_schedule_to_time false")  # as it is written on the command line


def test_a_given_max_steps_below_the_estimate_gets_a_warmup_that_fits():
    """--max_steps 100 where the minutes hold ~2,600 steps: the warm-up is a share of the 100 (it was 181, so the
    learning rate never reached its peak and never decayed)."""
    gpt, train = parse(RECIPES["gpt"], ["--preset", "auto", "--max_steps", "100"])
    new_gpt, new_train, line = resolve(gpt, train, ZH_POETRY, H200_CARD, Path("."), save=False)
    assert new_train.max_steps == 100 and new_train.warmup_steps == 7 and "warm-up 7," in line
    assert auto_choice(*parse(RECIPES["gpt"], ["--preset", "auto"]), ZH_POETRY, H200_CARD).settings["warmup_steps"] == 50


def test_the_line_names_small_counts_and_the_single_epoch_reason():
    """A corpus of thousands of tokens is named as such (not 0.00M); where the smallest shape sees every token at
    most once the line says so, not a regime whose bound the figure it shows exceeds."""
    tiny = choose(677, 7, LADDER, STEP)
    assert tiny.why.startswith("677 tokens x 7 min") and "far data-bound" in tiny.why
    once = choose(100_684, 0.2, ladder(4e10), STEP)
    assert once.why.startswith("100.7k tokens x 0.2 min") and once.settings["dropout"] == 0.0
    assert "(at most one epoch at the smallest shape: no token is seen twice)" in once.why, once.why
    single = choose(100_684, 0.01, ladder(4e10), STEP)  # minutes that hold one step
    assert single.settings["max_steps"] == 2 and ", ~1 step after start-up" in single.why, single.why


@pytest.mark.parametrize("damage", ['{"settings": {"dropout": 0.1', '{"why": "x"}', "[]",
                                    '{"settings": {"colour": 1}, "why": "x"}'])
def test_a_damaged_choice_file_on_resume_is_one_line(tmp_path, damage):
    """A resume reads the choice back; a file cut short or edited is refused naming it and the way out."""
    gpt, train = parse(RECIPES["gpt"], ["--preset", "auto", "--resume_from_checkpoint", "latest"])
    (tmp_path / CHOICE_FILE).write_text(damage)
    named = re.escape(str(tmp_path / CHOICE_FILE))
    with pytest.raises(CheckpointError, match=f"^{named} cannot be read .*a fresh --output_dir$"):
        resolve(gpt, train, ZH_POETRY, H200_CARD, tmp_path)


def test_an_adamw_run_gets_the_adamw_settings_only(tmp_path):
    """--optimizer adamw has no Muon weight decay: the choice sets AdamW's, and the line names that one only."""
    gpt, train = parse(RECIPES["gpt"], ["--preset", "auto", "--optimizer", "adamw"])
    new_gpt, new_train, line = resolve(gpt, train, ZH_POETRY, H200_CARD, tmp_path)
    assert new_train.optimizer == "adamw" and new_train.weight_decay == 2.0 and new_gpt.dropout == 0.1
    assert "weight decay 2 (AdamW)," in line and "Muon" not in line
    assert "muon_weight_decay" not in json.loads((tmp_path / CHOICE_FILE).read_text())["settings"]
    assert budget_run(["--preset", "auto", "--optimizer", "adamw", "--corpus_tokens", str(ZH_POETRY)])
    resolve(*parse(RECIPES["gpt"], ["--preset", "auto"]), ZH_POETRY, H200_CARD, tmp_path)  # a Muon run's choice
    resumed = parse(RECIPES["gpt"], ["--preset", "auto", "--optimizer", "adamw", "--resume_from_checkpoint", "latest"])
    assert resolve(*resumed, ZH_POETRY, H200_CARD, tmp_path)[1].weight_decay == 2.0  # (the fingerprint then refuses)


def test_budget_shows_the_choice_a_run_makes():
    argv = ["--preset", "auto", "--corpus_tokens", str(ZH_POETRY), "--max_minutes", "2", "--peak_tflops", "790"]
    text = budget_run(argv)
    line = next(x.strip() for x in text.splitlines() if x.strip().startswith("auto: "))
    gpt, train = parse(RECIPES["gpt"], ["--preset", "auto", "--max_minutes", "2", "--peak_tflops", "790"])
    choice = auto_choice(gpt, train, ZH_POETRY, with_peak(find_card("RTX 5070 Ti"), 790))
    assert line == f"auto: {choice.why}"
    shape, priced, _ = describe_run(argv)
    assert (shape.model.n_layer, shape.model.d_model) == (choice.settings["n_layer"], choice.settings["n_embd"])
    assert priced.warmup_steps == choice.settings["warmup_steps"]


# ---------------------------------------------------------------------------------------------------- a real run
TINY = ["train", "gpt", "--preset", "auto", "--seq_len", "64", "--vocab_size", "512", "--micro_batch_size", "4",
        "--gradient_accumulation_steps", "1", "--compile", "false", "--eval_steps", "3", "--eval_batches", "1",
        "--checkpointing_steps", "0", "--log_steps", "3", "--max_new_tokens", "2", "--progress", "false",
        "--mixed_precision", "no"]


def _train(args, capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert cli_main([*TINY, *args]) == 0
    return capsys.readouterr().out


def test_a_run_prints_one_line_records_the_choice_and_a_resume_keeps_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    # --peak_tflops 5 for 10 minutes: the builtin corpus is many epochs (data-bound: dropout 0.1); --max_steps ends it
    log = _train(["--max_minutes", "10", "--max_steps", "4", "--peak_tflops", "5", "--output_dir", str(out)],
                 capsys, monkeypatch)
    lines = [x for x in log.splitlines() if x.startswith("auto: ")]
    assert len(lines) == 1 and "epochs at 4x128" in lines[0] and "given, kept: --max_steps 4" in lines[0], log
    # hf-cgpu budget gives the same line from the figures the run printed (docs/budget.md): its training tokens and
    # its tokenizer's size, on the CPU's terms (no compile: TINY says so)
    vocab, tokens = re.search(r"vocab (\d+), .* train ([\d,]+) tokens", log).groups()
    budget = budget_run([*TINY[2:], "--max_minutes", "10", "--max_steps", "4", "--peak_tflops", "5", "--card", "cpu",
                         "--corpus_tokens", tokens.replace(",", ""), "--vocab_size", vocab])
    assert lines[0] in [x.strip() for x in budget.splitlines()]
    # or from the corpus itself: counted as the run made its tokens (the tokenizer is the one the run reused)
    budget = budget_run([*TINY[2:], "--max_minutes", "10", "--max_steps", "4", "--peak_tflops", "5", "--card", "cpu",
                         "--dataset", "builtin"])
    assert lines[0] in [x.strip() for x in budget.splitlines()]
    assert f"training split is {tokens} tokens of a {int(vocab):,}-token vocabulary" in budget
    chosen = json.loads((out / CHOICE_FILE).read_text())["settings"]
    assert chosen["dropout"] == 0.1
    saved = json.loads((out / "all_results.json").read_text())["settings"]
    for key, value in chosen.items():
        assert saved[key] == (4 if key == "max_steps" else value), key  # the run trained with the choice
    assert json.loads((out / "config.json").read_text())["n_layer"] == chosen["n_layer"]
    # resumed where a fresh choice would differ (a slow card: compute-bound, no dropout): the choice is kept
    log = _train(["--max_minutes", "10", "--max_steps", "6", "--peak_tflops", "0.001", "--output_dir", str(out),
                  "--resume_from_checkpoint", "latest"], capsys, monkeypatch)
    assert next(x for x in log.splitlines() if x.startswith("auto: ")).startswith(
        "auto: the choice this run made (resumed): ")
    resumed = json.loads((out / "all_results.json").read_text())["settings"]
    assert {k: resumed[k] for k in chosen if k != "max_steps"} == {k: v for k, v in chosen.items() if k != "max_steps"}
    assert resumed["max_steps"] == 6 and "resumed from " in log


def test_a_fresh_choice_at_the_slow_rate_would_differ():
    """The resume above is a real test: at the resumed flags the rule chooses otherwise."""
    gpt, train = parse(RECIPES["gpt"], [*TINY[2:], "--max_minutes", "10", "--peak_tflops", "0.001"])
    fast = parse(RECIPES["gpt"], [*TINY[2:], "--max_minutes", "10", "--peak_tflops", "5"])
    tokens = 200_000
    slow = auto_choice(gpt, train, tokens, with_peak(CPU, 0.001), vocab_size=512, device_type="cpu").settings
    quick = auto_choice(*fast, tokens, with_peak(CPU, 5), vocab_size=512, device_type="cpu").settings
    assert slow["dropout"] == 0.0 and quick["dropout"] == 0.1
    assert dataclasses.replace(gpt, dropout=0.1) != gpt


def test_a_small_shape_is_priced_at_its_own_step_and_its_own_compile():
    """The line's steps come from the ledger's step time of the shape chosen, over the minutes left after that
    shape's own start-up (not the deepest shape's)."""
    tiny = Candidate(4, 256, 4, 7_000_000, 6.0 * 5e6, step_seconds=0.05, startup_s=30.0)
    deep = Candidate(12, 768, 12, 110_000_000, 6.0 * 85e6, step_seconds=0.4, startup_s=70.0)
    choice = choose(1_000_000, 2, [tiny, deep], STEP)
    assert "at 4x256" in choice.why
    assert f"~{round(train_seconds(2, 30.0) / 0.05):,} steps" in choice.why, choice.why