"""``--auto`` (``--preset auto``) for a GPT run: the ledger's figures for the rule's shapes, the rule's choice applied
to the settings as preset values (a flag given on the command line wins), and the choice kept in the output folder
so that a resume uses it. Torch-free: ``hf-cgpu budget --preset auto`` shows the same choice without training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..budget.auto import CHOSEN, SHAPES, AutoChoice, Candidate, choose, value_tables
from ..budget.card import Card
from ..budget.time import compile_seconds, flops_per_token, step_time
from ..budget.work import lm_step_work
from ..errors import CheckpointError, SettingsError
from ..integrity import atomic_write_json
from ..settings import TrainSettings, _shown
from .settings import GPTSettings

CHOICE_FILE = "auto_choice.json"
"""In the output folder: the settings --auto chose and why; a resume applies them instead of choosing again."""
SHAPE_FLAGS = ("n_layer", "n_embd", "n_head")


def given(gpt: GPTSettings) -> set[str]:
    return {g for g in gpt.given_flags.split(",") if g}


def candidates(gpt: GPTSettings, train: TrainSettings, card: Card, vocab_size: int | None = None,
               processes: int = 1, device_type: str = "cuda") -> list[Candidate]:
    """The rule's shapes (a shape flag given on the command line replaces that part of each), each with the value
    tables the rule gives it unless --value_embeddings is given, with their parameters, training FLOPs per token and
    step seconds and start-up on ``card`` from the ledger. A shape the given options cannot build (3 value tables in
    4 layers, a width the given heads do not divide) is left out; a one-line error where none is left."""
    out = []
    for values in dict.fromkeys(SHAPES):
        shape = dict(zip(SHAPE_FLAGS, values))
        shape.update({k: getattr(gpt, k) for k in SHAPE_FLAGS if k in given(gpt)})
        tables = gpt.value_embeddings if "value_embeddings" in given(gpt) else value_tables(shape["n_layer"])
        try:
            run = dataclasses.replace(gpt, **shape, value_embeddings=tables).run_shape(vocab_size=vocab_size)
        except SettingsError as err:
            refused = f"at {shape['n_layer']}x{shape['n_embd']}, {err}"
            continue
        setup = run.setup(train, processes=processes)
        step = step_time(lm_step_work(run.model, setup), card)
        compiled = train.compile and device_type == "cuda"
        out.append(Candidate(**shape, n_params=run.model.n_params,
                             flops_per_token=flops_per_token(run.model, setup), step_seconds=step.seconds,
                             startup_s=compile_seconds(run.model.depth, compiled)))
    if not out:
        names = ", ".join(f"{layers}x{width}" for layers, width, _ in SHAPES)
        raise SettingsError(f"--auto chooses among the shapes {names} and none takes these options: {refused}")
    return list({(c.n_layer, c.n_embd, c.n_head): c for c in out}.values())


def auto_choice(gpt: GPTSettings, train: TrainSettings, corpus_tokens: int, card: Card,
                vocab_size: int | None = None, processes: int = 1, device_type: str = "cuda") -> AutoChoice:
    """The rule's choice for this run (``budget.auto.choose``) on ``card`` (a ``device_type`` device)."""
    gpt.check_with(train)
    if corpus_tokens < 1:
        raise SettingsError(f"--auto needs the training split's token count, got {corpus_tokens}; give a corpus "
                            "(or --corpus_tokens N to hf-cgpu budget)")
    per_step = train.samples_per_step(processes) * gpt.seq_len
    fitted = train.fit_schedule_to_time or "fit_schedule_to_time" not in given(gpt)  # the rule's, unless given false
    cap = train.max_steps if "max_steps" in given(gpt) else 0
    return choose(corpus_tokens, train.max_minutes, candidates(gpt, train, card, vocab_size, processes, device_type),
                  per_step, fitted, muon=train.optimizer == "muon", max_steps=cap)


def apply_choice(gpt: GPTSettings, train: TrainSettings, chosen: dict[str, Any]) -> tuple[GPTSettings, TrainSettings,
                                                                                          list[str]]:
    """New settings objects with ``chosen`` applied where no flag was given, and the flags that kept their value. A
    setting the run has no place for (a Muon weight decay, saved by a Muon run, where the optimizer is AdamW) is left
    out: the resume's fingerprint names the optimizer that changed."""
    keep = given(gpt)
    take = {k: v for k, v in chosen.items() if k not in keep}
    names = {f.name for f in dataclasses.fields(GPTSettings)}
    gpt = dataclasses.replace(gpt, **{k: v for k, v in take.items() if k in names})
    options = train.optimizer_options
    own = {f.name for f in dataclasses.fields(options)} if options is not None else set()
    fields = {f.name for f in dataclasses.fields(TrainSettings)}
    changes = {k: v for k, v in take.items() if k in fields - names - own}
    if own & take.keys():
        changes["optimizer_options"] = dataclasses.replace(options, **{k: take[k] for k in own & take.keys()})
    train = dataclasses.replace(train, **changes)
    where = {k: gpt if k in names else options if k in own else train for k in CHOSEN}
    kept = [f"--{k} {_shown(getattr(where[k], k))}" for k in CHOSEN if k in keep]  # as typed on the command line
    return gpt, train, kept


def saved_choice(path: Path) -> AutoChoice:
    """The choice an --auto run saved (``CHOICE_FILE``); a damaged file is a one-line ``CheckpointError``."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        choice = AutoChoice(dict(saved["settings"]), str(saved["why"]))
        if choice.settings.keys() - set(CHOSEN):
            raise KeyError(f"settings --auto never chooses: {sorted(choice.settings.keys() - set(CHOSEN))}")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}); the resumed run needs the "
                              "settings --auto chose for it: delete the file and give them as flags (a refused resume "
                              "names each that differs), or start a fresh --output_dir") from None
    return choice


def resolve(gpt: GPTSettings, train: TrainSettings, corpus_tokens: int, card: Card, output_dir: Path,
            vocab_size: int | None = None, processes: int = 1, save: bool = True, device_type: str = "cuda"):
    """(GPTSettings, TrainSettings, the line to print) of an --auto run: the choice this output folder's run made
    when resuming, else a new one (saved to ``output_dir/auto_choice.json`` when ``save``)."""
    path = output_dir / CHOICE_FILE
    if train.resume_from_checkpoint and path.is_file():
        choice, how = saved_choice(path), "the choice this run made (resumed)"
    else:
        choice, how = auto_choice(gpt, train, corpus_tokens, card, vocab_size, processes, device_type), ""
        if save:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, dataclasses.asdict(choice), indent=1)  # a crash never leaves half a choice
    gpt, train, kept = apply_choice(gpt, train, choice.settings)
    line = f"auto: {how + ': ' if how else ''}{choice.why}" + (f"; given, kept: {', '.join(kept)}" if kept else "")
    return gpt, train, line


__all__ = ["CHOICE_FILE", "apply_choice", "auto_choice", "candidates", "resolve", "saved_choice"]
