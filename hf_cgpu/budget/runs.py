"""A whole run's time on a card, one function per kind of task: the step (``time.step_time`` of the task's work)
and the per-run rows (compile, evaluations, checkpoints). ``hf-cgpu budget`` prints them; the trainer says them at
its start and checks them at its end (``train.forecast``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..options import CUDA_GRAPH_MODES
from .card import CPU, Card
from .memory import model_state_bytes, teacher_cache_bytes
from .shape import ModelShape, TrainSetup
from .time import CHECKPOINT_WRITE_GBS, RunTime, StepTime, TimeRow, compile_seconds, run_time, step_time
from .work import lm_step_work, teacher_cache_work

IMAGE_COMPILE_BLOCKS = 5
"""Blocks a compiled image step unrolls, for the compile row (the UNet's five residual blocks)."""


def lm_step_time(shape: ModelShape, setup: TrainSetup, card: Card) -> StepTime:
    """One optimizer step of a language-model run on ``card`` (CUDA graphs where its compile mode records them)."""
    return step_time(lm_step_work(shape, setup), card,
                     cuda_graphs=setup.compile and setup.compile_mode in CUDA_GRAPH_MODES)


def lm_run_time(shape: ModelShape, setup: TrainSetup, train, card: Card, eval_micro_batches: float = 0.0) -> RunTime:
    """The time ledger of a language-model run on ``card``: its step and its per-run rows."""
    step = lm_step_time(shape, setup, card)
    evals = train.eval_batches or eval_micro_batches
    st = model_state_bytes(shape, setup)
    return run_time(step, train, compile_seconds(shape.depth, setup.compile and card is not CPU), evals,
                    checkpoint_bytes=st.weights + st.optimizer + (st.trainable_params * 4 if setup.ema else 0),
                    before=teacher_cache_rows(shape, setup, card))


def annealed_cost(shape: ModelShape, setup: TrainSetup, card: Card) -> tuple[float, float] | None:
    """(share, ratio) of a run whose extra loss stops at ``share`` of the schedule (--mtp_anneal with heads,
    --distill_anneal with a teacher): a step after it costs ``ratio`` of one with the loss on, both priced on
    ``card``; None where nothing is annealed."""
    share = (setup.extra_heads_share if setup.extra_heads else
             setup.teacher_share if setup.teachers else 1.0)
    if share >= 1:
        return None
    on, off = (lm_step_time(shape, dataclasses.replace(setup, extra_heads_share=s, teacher_share=s), card).seconds
               for s in (1.0, 0.0))
    return share, off / on


def teacher_cache_rows(shape: ModelShape, setup: TrainSetup, card: Card) -> tuple[TimeRow, ...]:
    """The build of a ``--teacher_top_k`` cache before the first step (none without one, or where the stream's size
    is not known); a resume or a second student in the same folder reads it instead."""
    if not (setup.teachers and setup.teacher_top_k and setup.stream_tokens):
        return ()
    build = step_time(teacher_cache_work(setup, shape.vocab_size, gpu=card is not CPU), card)
    saved = teacher_cache_bytes(setup, shape.vocab_size)
    return (TimeRow("teacher_cache", "teacher cache (once)", build.seconds + saved / (CHECKPOINT_WRITE_GBS * 1e9),
                    f"the teacher's forward over the {setup.stream_tokens / 1e6:,.2f}M-token stream, its top-"
                    f"{setup.teacher_top_k} and the {saved / 1e9:.2f} GB file, before the loop (outside "
                    "--max_minutes; reused when its key matches)"),)


def image_run_time(task: str, cfg, train, card: Card, extra: dict[str, Any]) -> RunTime:
    """The time ledger of ``hf-cgpu train TASK`` (an image task) on ``card``; ``extra``: ``image_step_work``'s
    keyword arguments (a flow-distill teacher's config and guidance)."""
    from .images import image_step_work

    work = image_step_work(task, cfg, train, **extra)
    step = step_time(work, card, cuda_graphs=bool(train.compile) and train.compile_mode in CUDA_GRAPH_MODES)
    return run_time(step, train, compile_seconds(IMAGE_COMPILE_BLOCKS, bool(train.compile) and card is not CPU))


def teacher_extra(cfg) -> dict[str, Any]:
    """``image_step_work``'s keyword arguments for a flow-distill ``cfg`` whose ``--teacher`` folder exists (its
    UNet, saved guide and guidance), else none (the flow preset's UNet is assumed)."""
    from pathlib import Path

    from .images import read_pipeline

    teacher = getattr(cfg, "teacher", "")
    if not teacher or not Path(teacher).is_dir():
        return {}
    info = read_pipeline(teacher)
    return {"teacher_config": info.unet, "guide": info.guide, "guidance_scale": info.guidance_scale}
