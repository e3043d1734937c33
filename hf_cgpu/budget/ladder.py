"""The memory-saving ladder, written once: the seed's order of rungs, each a step down from a ``TrainSetup``.

smaller micro-batch with more accumulation -> recompute -> shorter sequence -> 8-bit AdamW -> LoRA -> QLoRA.

The one ``LADDER`` drives ``autofit`` (walk down until the ledger fits; the trainer's ``--autofit`` takes the rungs
it can apply by itself, ``TRAINER_RUNGS``), ``next_rung`` (``hf-cgpu budget``'s "next rung" line) and
``oom_advice`` (what the trainer says when CUDA runs out of memory at micro-batch 1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SettingsError
from ..optim import optimizer_spec
from ..options import ADAPTER_TIERS, CUDA_GRAPH_MODES, TIERS
from .memory import Ledger, fmt_gib, ledger, parse_memory
from .shape import ModelShape, RunShape, TrainSetup

MIN_AUTOFIT_SEQ_LEN = 256
"""The ladder halves the sequence no further than this (shorter contexts change what the model can learn)."""
MAX_AUTOFIT_MICRO_BATCH = 64


def _with_micro_batch(setup: TrainSetup, micro_batch: int, tokens_per_step: int) -> TrainSetup:
    acc = max(1, math.ceil(tokens_per_step / (micro_batch * setup.seq_len)))
    return dataclasses.replace(setup, micro_batch_size=micro_batch, gradient_accumulation_steps=acc)


@dataclass(frozen=True)
class Rung:
    """One rung: ``lower`` steps a setup down (None when the rung is taken already), ``advice`` says it as flags."""

    key: str
    advice: str
    """What a user sets for this rung by hand."""
    lower: Callable[[TrainSetup, int, int], TrainSetup | None]
    """(setup, tokens per optimizer step, smallest micro-batch) -> the setup one rung down, or None."""
    label: Callable[[TrainSetup, TrainSetup], str]
    """(before, after) -> what changed, in words."""
    grow_back: bool = False
    """After this saving, buy the sequence and the micro-batch back as far as they fit."""


def _halve_micro_batch(s: TrainSetup, tokens: int, floor: int) -> TrainSetup | None:
    return _with_micro_batch(s, s.micro_batch_size // 2, tokens) if s.micro_batch_size // 2 >= max(1, floor) else None


def _halve_sequence(s: TrainSetup, tokens: int, floor: int) -> TrainSetup | None:
    if s.seq_len // 2 < MIN_AUTOFIT_SEQ_LEN:
        return None
    return _with_micro_batch(dataclasses.replace(s, seq_len=s.seq_len // 2), s.micro_batch_size, tokens)


def _tier_rung(tier: str, words: str, advice: str) -> Rung:
    def lower(s: TrainSetup, tokens: int, floor: int) -> TrainSetup | None:
        if tier not in optimizer_spec(s.optimizer).tiers or TIERS.index(s.tier) >= TIERS.index(tier):
            return None  # an optimizer without a form for this tier stays where it is
        mode = "finetune" if tier in ADAPTER_TIERS else s.train_mode  # adapters: fine-tune a trained model instead
        return dataclasses.replace(s, tier=tier, train_mode=mode)

    return Rung(tier, advice, lower, lambda before, after: f"{words} (--tier {tier})", grow_back=True)


LADDER: tuple[Rung, ...] = (
    Rung("micro-batch", "a smaller --micro_batch_size with more --gradient_accumulation_steps", _halve_micro_batch,
         lambda b, a: f"micro-batch {b.micro_batch_size} -> {a.micro_batch_size}, accumulation "
                      f"{b.gradient_accumulation_steps} -> {a.gradient_accumulation_steps}"),
    Rung("recompute", "--recompute",
         lambda s, tokens, floor: None if s.reruns_forward
         else dataclasses.replace(s, recompute=True, recompute_policy="full"),
         lambda b, a: "full recompute" if b.recompute else "recompute on", grow_back=True),
    Rung("sequence", "a shorter --seq_len", _halve_sequence, lambda b, a: f"sequence {b.seq_len} -> {a.seq_len}"),
    _tier_rung("adamw8bit", "8-bit AdamW", "--tier adamw8bit"),
    _tier_rung("lora", "LoRA", "--tier lora (fine-tune an existing model instead)"),
    _tier_rung("qlora", "QLoRA", "--tier qlora"),
)
RUNGS = tuple(r.key for r in LADDER)
TRAINER_RUNGS = ("micro-batch", "recompute", "adamw8bit")
"""What ``--autofit`` changes by itself: the sequence and the model (adapters need another base) stay as asked."""


@dataclass(frozen=True)
class FitPlan:
    """What ``autofit`` chose: the setup, its ledger, whether it fits, and why each rung was taken."""

    setup: TrainSetup
    ledger: Ledger
    fits: bool
    reasons: tuple[str, ...]
    memory_cap: float


def autofit(
    shape: ModelShape,
    memory_cap: float,
    seq_len: int = 1024,
    effective_batch_tokens: int | None = None,
    micro_batch_size: int | None = None,
    gradient_accumulation_steps: int | None = None,
    rungs: Sequence[str] = RUNGS,
    min_micro_batch: int = 1,
    base: TrainSetup | None = None,
) -> FitPlan:
    """Walk the ladder's ``rungs`` until the ledger fits ``memory_cap``; keep the tokens per optimizer step.

    Start from ``micro_batch_size`` (x ``gradient_accumulation_steps``) or the largest power-of-two micro-batch
    within ``effective_batch_tokens``. The micro-batch rung halves it (doubling accumulation) down to
    ``min_micro_batch`` (1 in the seed's ladder; a floor of 4 keeps a consumer GPU busier and reaches recompute
    sooner). Every later rung is switched on cumulatively, and after recompute and each tier the micro-batch (and
    the sequence) grow back as far as they fit, because a memory saving is best spent on throughput. A ``base``
    that fits without its recompute (when the ``recompute`` rung is among ``rungs``: recompute costs a forward), or
    else fits as given, is the plan. Otherwise the walk starts without recompute, whatever ``base`` says (and says
    so), and takes it only where the run does not fit otherwise.
    """
    unknown = set(rungs) - set(RUNGS)
    if unknown:
        raise SettingsError(f"unknown rungs {sorted(unknown)}: choose from {', '.join(RUNGS)}")
    base = dataclasses.replace(base or TrainSetup(), seq_len=seq_len)
    given = dataclasses.replace(base, micro_batch_size=micro_batch_size or base.micro_batch_size,
                                gradient_accumulation_steps=gradient_accumulation_steps or base.gradient_accumulation_steps)
    if "recompute" in rungs and given.recompute:  # the ladder's to choose: a run that fits without it is faster
        without = dataclasses.replace(given, recompute=False, recompute_policy="full")
        if (led := ledger(shape, without, memory_cap)).fits:
            return FitPlan(setup=without, ledger=led, fits=True, memory_cap=memory_cap, reasons=(
                f"fits without the given --recompute, which costs a forward: {fmt_gib(led.total)} <= "
                f"{fmt_gib(memory_cap)}",))
    as_given = ledger(shape, given, memory_cap)
    if as_given.fits:
        return FitPlan(setup=given, ledger=as_given, fits=True, memory_cap=memory_cap,
                       reasons=(f"fits as given: {fmt_gib(as_given.total)} <= {fmt_gib(memory_cap)}",))
    reasons: list[str] = []
    if "recompute" in rungs and base.recompute:
        base = dataclasses.replace(base, recompute=False, recompute_policy="full")
        reasons.append(f"as given {fmt_gib(as_given.total)} > {fmt_gib(memory_cap)} cap; the walk starts without "
                       "--recompute, which the ladder takes only where the run does not fit otherwise")
    if effective_batch_tokens is None:
        mb = micro_batch_size or base.micro_batch_size
        effective_batch_tokens = mb * (gradient_accumulation_steps or base.gradient_accumulation_steps) * seq_len
    if micro_batch_size is None:
        micro_batch_size = 1
        while micro_batch_size * 2 * seq_len <= effective_batch_tokens and micro_batch_size < MAX_AUTOFIT_MICRO_BATCH:
            micro_batch_size *= 2
    if effective_batch_tokens < seq_len:
        raise SettingsError(f"effective batch {effective_batch_tokens} tokens is below one sequence of {seq_len}")
    tokens, cap = effective_batch_tokens, memory_cap

    def total(s: TrainSetup) -> float:
        return ledger(shape, s, cap).total

    def over(s: TrainSetup) -> str:
        return f"{fmt_gib(total(s))} > {fmt_gib(cap)} cap"

    def grow(s: TrainSetup, rung: str) -> TrainSetup:
        """After a saving, restore the sequence, then the micro-batch, as far as they fit."""
        while s.seq_len < seq_len:
            t = dataclasses.replace(s, seq_len=min(seq_len, s.seq_len * 2))
            t = _with_micro_batch(t, t.micro_batch_size, tokens)
            if total(t) > cap:
                break
            reasons.append(f"{rung}: sequence back {s.seq_len} -> {t.seq_len} ({fmt_gib(total(t))})")
            s = t
        while s.micro_batch_size < micro_batch_size:
            t = _with_micro_batch(s, s.micro_batch_size * 2, tokens)
            if total(t) > cap:
                break
            reasons.append(f"{rung}: micro-batch back {s.micro_batch_size} -> {t.micro_batch_size} "
                           f"({fmt_gib(total(t))})")
            s = t
        return s

    setup = _with_micro_batch(base, micro_batch_size, tokens)
    for rung in (r for r in LADDER if r.key in rungs):
        while total(setup) > cap and (lower := rung.lower(setup, tokens, min_micro_batch)) is not None:
            reasons.append(f"{rung.label(setup, lower)}: {over(setup)}")
            setup = grow(lower, rung.key) if rung.grow_back else lower
    final = ledger(shape, setup, cap)
    if final.fits:
        reasons.append(f"fits: {fmt_gib(final.total)} <= {fmt_gib(cap)} at micro-batch {setup.micro_batch_size} "
                       f"x accumulation {setup.gradient_accumulation_steps}, seq {setup.seq_len}, tier {setup.tier}"
                       f"{', ' + setup.recompute_words if setup.recompute else ''}")
    else:
        reasons.append(f"nothing on the ladder fits: {over(setup)} even at the last rung; pick a smaller model")
    return FitPlan(setup=setup, ledger=final, fits=final.fits, reasons=tuple(reasons), memory_cap=cap)


def next_rung(shape: ModelShape, setup: TrainSetup, memory_cap: float) -> tuple[str, Ledger] | None:
    """The first rung of the ladder that lowers the memory of ``setup``, with its ledger (None when all are taken)."""
    now = ledger(shape, setup, memory_cap).total
    for rung in LADDER:
        lower = rung.lower(setup, setup.tokens_per_step, 1)
        if lower is not None and (led := ledger(shape, lower, memory_cap)).total < now:
            return rung.label(setup, lower), led
    return None


def oom_advice(setup: TrainSetup) -> str:
    """What to set when a step runs out of memory even at micro-batch 1: the rungs below, as flags."""
    rungs = [r.advice for r in LADDER if r.key != "micro-batch" and r.lower(setup, setup.tokens_per_step, 1)]
    steps = "; then ".join(rungs) or "a smaller model"
    return f"CUDA out of memory even at micro_batch_size 1; next rung of the memory ladder: {steps} (see `hf-cgpu budget`)"


QLORA_RECOMPUTE_NOTE = (
    "a checkpoint dynamo cannot trace in QLoRA's compiled blocks falls back to wrapping the compiled block, which "
    "holds more than the ledger prices; the eager QLoRA step with recompute matches it")
"""Why autofit keeps QLoRA with recompute eager."""
GRAPHS_RECOMPUTE_NOTE = "CUDA graphs keep a memory pool of their own, which takes back part of what recompute saves"
"""Why a recompute chosen to save memory runs without CUDA graphs."""


def autofit_settings(settings: Any, run_shape: RunShape | None, device_memory: int | None, log=print,
                     processes: int = 1, parallel: str = "single") -> Any:
    """``--autofit``: the trainer's ``settings`` (a ``TrainSettings``) with micro-batch, accumulation, recompute and
    8-bit AdamW chosen by the ladder so the run fits ``memory_cap`` (else ``device_memory``); a new object.

    The effective batch (tokens per optimizer step) is kept; the sequence length and the model are not touched,
    and adapter tiers are not chosen (the base model is already loaded). Compile stays as asked for LoRA: compiled
    adapter blocks trace their checkpoint (``tiers.compile``), so recompute saves what the ledger prices; QLoRA with
    recompute goes eager (``QLORA_RECOMPUTE_NOTE``), and a recompute it chose runs without CUDA graphs
    (``GRAPHS_RECOMPUTE_NOTE``). Logs each reason.
    """
    if run_shape is None:
        raise SettingsError("--autofit needs a language-model task; set micro_batch_size/recompute by hand here")
    if settings.memory_cap:
        cap = parse_memory(settings.memory_cap)
    elif device_memory:
        cap = device_memory
    else:
        raise SettingsError("--autofit without a GPU needs --memory_cap, e.g. --memory_cap 16GB")
    base = run_shape.setup(settings, processes=processes, fsdp=parallel == "fsdp2")  # the ledger per GPU
    plan = autofit(run_shape.model, cap, seq_len=base.seq_len, micro_batch_size=base.micro_batch_size,
                   gradient_accumulation_steps=base.gradient_accumulation_steps, rungs=TRAINER_RUNGS, base=base)
    for reason in plan.reasons:
        log(f"autofit: {reason}")
    if not plan.fits:
        shard = (f", or shard the states over the {processes} GPUs with recipes/accelerate/fsdp2.yaml"
                 if processes > 1 and parallel != "fsdp2" else "")
        raise SettingsError(f"autofit: no micro-batch/recompute/8-bit setting fits {fmt_gib(cap)}; "
                            f"pick a smaller preset or fine-tune an existing model with --tier lora{shard}")
    chosen = plan.setup
    compile, mode = settings.compile, settings.compile_mode
    if compile and chosen.recompute and chosen.tier == "qlora":
        compile = False
        log(f"autofit: compile off with the recompute it chose ({QLORA_RECOMPUTE_NOTE})")
    elif compile and chosen.recompute and mode in CUDA_GRAPH_MODES:
        mode = "default" if mode == "reduce-overhead" else "max-autotune-no-cudagraphs"
        log(f"autofit: --compile_mode {mode} with the recompute it chose ({GRAPHS_RECOMPUTE_NOTE})")
    return dataclasses.replace(settings, micro_batch_size=chosen.micro_batch_size, tier=chosen.tier,
                               gradient_accumulation_steps=chosen.gradient_accumulation_steps,
                               recompute=chosen.recompute, recompute_policy=chosen.recompute_policy, compile=compile,
                               compile_mode=mode)

