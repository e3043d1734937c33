"""``--preset auto``: the GPT's shape, regularisation and schedule chosen from the corpus and the minutes.

One pure function, ``choose``: (training tokens, minutes, the candidate shapes with their ledger figures: parameters,
FLOPs per token, and the time ledger's step seconds and start-up on the card) -> the settings and one line saying
why. The rule is the table of
constants below; what each is fitted to is named beside it (headings of benchmarks/RESULTS.md, or the paper).

The over-fit *pressure* is compute / (6 x corpus tokens^2): epochs times parameters per corpus token for a run
that spends the compute as 6 N D. It depends on the minutes and the corpus only, so more minutes on one corpus never
lower it (a larger shape trades epochs for parameters at about equal pressure), and the regularisation it picks
never falls when the minutes grow. A run of at most one epoch (the smallest shape is larger than the compute calls
for) sees no token twice and is regularised as a single-epoch one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .shape import fmt_count

# ---------------------------------------------------------------------------------------------------- the rule
TRAIN_FRACTION = 0.9
"""Share of the minutes after the first step spent in training steps (evaluations and best-weight saves take the
rest)."""
# Fitted: the tokens that run trained against the ledger's rate for its card (the same RESULTS.md entry).
MIN_TRAIN_SHARE = 0.25
"""Where start-up would take nearly all the minutes, at least this share of them is counted as training."""
TOKENS_PER_PARAM = 20
"""Compute-optimal tokens per parameter where data is not short (Chinchilla, Hoffmann et al. 2022)."""
DATA_BOUND_SCALE = 4.0
"""Where data is short, the model is this times the compute-optimal size, held back by strong regularisation."""
# Fitted: the shape zh-poetry-modern measured best against the Chinchilla size for its compute (the same RESULTS.md
# entry), rounded up so that shape is the one chosen for that cell; with regularisation tuned, larger models keep
# gaining on repeated data (Kim et al. 2025, "Pre-training under infinite compute").
MAX_PARAMS_PER_TOKEN = 11.0
"""A data-bound model has at most this many parameters per corpus token, value tables included."""
# Fitted: zh-poetry-modern's 10.4 on all of zh-poetry (RESULTS.md, "the speedrun options on zh-poetry") and 8 x 512's
# 10.7 on a third of it, which beat 6 x 384 (4.8) there in 2 minutes (RESULTS.md, "the auto rule's 7-minute cells");
# rounded up.
WARMUP_FRACTION = 0.07
"""Warm-up as a share of the steps the minutes hold."""
# Fitted: zh-poetry-modern's warm-up against its fitted steps (the same RESULTS.md entry).
WARMUP_MAX = 50
"""The longest warm-up chosen: with the speedrun options (value tables, U-net skips) a short warm-up measured better
than 7% of the steps."""
# Fitted: zh-poetry-modern's warm-up since the speedrun options (RESULTS.md, "the speedrun options on zh-poetry").
LAYERS_PER_VALUE_TABLE = 4
"""One value-embedding table per this many layers (at least one): 3 tables feeding the first and last 3 of 12 layers,
the ratio of the modded-nanogpt speedrun and of zh-poetry-modern."""
# Fitted: measured at 12 layers only (the same RESULTS.md entry); other depths keep the ratio.
MAX_STEPS_HEADROOM = 2.0
"""max_steps is this times the estimated steps: an upper bound the fitted cosine (fit_schedule_to_time) lowers."""


@dataclass(frozen=True)
class Regime:
    """Regularisation for over-fit pressures up to ``pressure``."""

    pressure: float
    name: str
    dropout: float
    weight_decay: float
    """AdamW's (embeddings, head, norms under Muon)."""
    muon_weight_decay: float
    min_lr_ratio: float


REGIMES = (
    # Up to 4 epochs at 20 tokens/parameter (pressure 0.8): repeated tokens are nearly as good as new ones
    # (Muennighoff et al. 2023), so the ordinary single-epoch pretraining settings: no dropout, weight decay 0.1,
    # Muon's default 0, the seed's cosine to 10%.
    Regime(0.8, "compute-bound", 0.0, 0.1, 0.0, 0.1),
    # zh-poetry-modern's measured best dropout, weight decay and cosine floor (the same RESULTS.md entry, which names
    # the runs they beat).
    Regime(1000.0, "data-bound", 0.1, 2.0, 0.25, 0.0),
    # Far beyond that pressure dropout 0.1 turns well before the end and 0.2 later (the same RESULTS.md entry), so 0.2.
    Regime(math.inf, "far data-bound", 0.2, 2.0, 0.25, 0.0),
)


@dataclass(frozen=True)
class Candidate:
    """One GPT shape the rule may choose, with the ledger's figures for it."""

    n_layer: int
    n_embd: int
    n_head: int
    n_params: int = 0
    flops_per_token: float = 0.0
    """Training FLOPs per token (``budget.time.flops_per_token``)."""
    step_seconds: float = 0.0
    """Seconds of one optimizer step of the run at this shape on the card (the time ledger's ``step_time``)."""
    startup_s: float = 0.0
    """Seconds before the first step (the time ledger's compile row)."""

    def model_flop_rate(self, tokens_per_step: int) -> float:
        """Model FLOP/s the card sustains at this shape."""
        return self.flops_per_token * tokens_per_step / self.step_seconds

    @property
    def name(self) -> str:
        return f"{self.n_layer}x{self.n_embd}"


SHAPES = ((4, 128, 4), (4, 256, 4), (6, 384, 6), (8, 512, 8), (12, 768, 12))
"""(n_layer, n_embd, n_head) the rule chooses from, smallest first: the tiny preset's shape up to the measured 12 x 768
(head size 32 below 384, 64 from there)."""

CHOSEN = ("n_layer", "n_embd", "n_head", "value_embeddings", "dropout", "weight_decay", "muon_weight_decay",
          "min_lr_ratio", "warmup_steps", "max_steps", "fit_schedule_to_time")
"""The settings the rule sets (a flag given on the command line keeps its value instead)."""


@dataclass(frozen=True)
class AutoChoice:
    settings: dict[str, Any]
    """Setting name -> chosen value (all of ``CHOSEN``; ``muon_weight_decay`` only for a Muon run)."""
    why: str
    """The one line: what was chosen and why."""


def pressure(corpus_tokens: int, compute: float) -> float:
    """Epochs x parameters per corpus token of a run of ``compute`` FLOPs spent as 6 N D."""
    return compute / (6.0 * float(corpus_tokens) ** 2)


def regime(p: float) -> Regime:
    return next(r for r in REGIMES if p <= r.pressure)


def pick_shape(candidates: Sequence[Candidate], compute: float, corpus_tokens: int, reg: Regime) -> Candidate:
    """The largest candidate not above the target size: Chinchilla's for the compute, larger where data is short."""
    target = math.sqrt(compute / (6.0 * TOKENS_PER_PARAM))
    if reg is not REGIMES[0]:
        target = min(target * DATA_BOUND_SCALE, MAX_PARAMS_PER_TOKEN * corpus_tokens)
    fitting = [c for c in candidates if c.n_params <= target]
    return max(fitting, key=lambda c: c.n_params) if fitting else min(candidates, key=lambda c: c.n_params)


def value_tables(n_layer: int) -> int:
    """Value-embedding tables for a model of ``n_layer`` layers (``LAYERS_PER_VALUE_TABLE``)."""
    return max(1, n_layer // LAYERS_PER_VALUE_TABLE)


def train_seconds(minutes: float, startup_s: float = 0.0) -> float:
    """Seconds of ``minutes`` spent in training steps, ``startup_s`` of them before the first step."""
    return max(minutes * 60 - startup_s, MIN_TRAIN_SHARE * minutes * 60) * TRAIN_FRACTION


def choose(corpus_tokens: int, minutes: float, candidates: Sequence[Candidate], tokens_per_step: int,
           fitted: bool = True, muon: bool = True, max_steps: int = 0) -> AutoChoice:
    """The settings for ``corpus_tokens`` training tokens in ``minutes``, choosing the shape from ``candidates`` (each
    priced by the time ledger on the card: its step seconds and start-up); ``tokens_per_step``: the run's effective
    batch in tokens, all processes;
    ``fitted``: the cosine is fitted to the minutes (max_steps only bounds it), else it ends at the estimated steps;
    ``muon``: the run trains its block matrices with Muon (its own weight decay), else AdamW trains all;
    ``max_steps``: a step limit given by the user (0 = none), which the schedule then plans for if it is fewer.

    The compute of the minutes is the largest shape's model FLOP rate on the card (where the card is busiest) over
    the minutes its start-up leaves, so it does not depend on the shape chosen."""
    largest = max(candidates, key=lambda c: c.n_params)
    flop_rate = largest.model_flop_rate(tokens_per_step)
    compute = flop_rate * train_seconds(minutes, max(c.startup_s for c in candidates))
    p = pressure(corpus_tokens, compute)
    reg = regime(p)
    reason = f"{reg.name}: epochs x params/token ~ {p:,.3g}"
    shape = pick_shape(candidates, compute, corpus_tokens, reg)
    own = train_seconds(minutes, shape.startup_s)  # this shape's start-up, not the deepest's
    tokens = own / shape.step_seconds * tokens_per_step
    smallest = min(candidates, key=lambda c: c.n_params)
    if shape == smallest and tokens <= corpus_tokens and reg is not REGIMES[0]:
        # larger than the compute calls for: no token is seen twice
        reg, reason = REGIMES[0], "at most one epoch at the smallest shape: no token is seen twice"
    steps = max(1, round(tokens / tokens_per_step))
    planned = min(steps, max_steps) if max_steps > 0 else steps
    warmup = min(WARMUP_MAX, max(1, round(WARMUP_FRACTION * planned)))
    tables = value_tables(shape.n_layer)
    settings = {"n_layer": shape.n_layer, "n_embd": shape.n_embd, "n_head": shape.n_head, "value_embeddings": tables,
                "dropout": reg.dropout, "weight_decay": reg.weight_decay, "min_lr_ratio": reg.min_lr_ratio,
                "warmup_steps": warmup,
                "max_steps": max(warmup + 1, math.ceil(MAX_STEPS_HEADROOM * steps) if fitted else planned),
                "fit_schedule_to_time": True}
    decay = f"{reg.weight_decay:g} (AdamW)"
    if muon:
        settings["muon_weight_decay"] = reg.muon_weight_decay
        decay = f"{reg.muon_weight_decay:g} (Muon) / {decay}"
    cosine = "fitted to the minutes" if fitted else f"over {steps:,} steps"
    why = (f"{fmt_count(corpus_tokens)} tokens x {minutes:g} min at {flop_rate / 1e12:,.3g} TFLOP/s ~ "
           f"{tokens / corpus_tokens:,.1f} epochs at {shape.name} ({fmt_count(shape.n_params)} params, "
           f"~{steps:,} step{'s' * (steps != 1)} after start-up and evaluation) -> "
           f"{tables} value table{'s' * (tables > 1)}, "
           f"dropout {reg.dropout:g}, weight decay {decay}, warm-up {warmup:,}, "
           f"cosine to {reg.min_lr_ratio:g} {cosine} ({reason})")
    return AutoChoice(settings, why)


__all__ = ["CHOSEN", "REGIMES", "SHAPES", "AutoChoice",
           "Candidate", "Regime", "choose", "pick_shape", "pressure", "regime", "train_seconds", "value_tables"]
