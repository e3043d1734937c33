"""The one training loop: a short driver over the components, each of which decides for itself.

    prepare      accelerator, task setup, autofit, tiers, optimizer, EMA        -> Run
    checkpoint   save / seal / prune / resume, EMA and best-weights state     -> TrainState
    step         one optimizer step's forward/backward and clipping           -> StepResult
    guards       non-finite, spike, label leak, OOM
    metrics      logging window, MFU, trackers, history, progress bar
    validation   cadence, EMA weights in place, best weights, early stopping
    stopping     --max_minutes and SIGTERM
    artifacts    the model, all_results.json, history, curves, card

Exact resume by construction: the data order, the learning rate and every random draw of step ``k`` are functions
of ``(seed, k)`` only (``schedule``), so a run resumed from a checkpoint at step ``k`` replays the uninterrupted run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ..bench import training_peak
from ..budget import TrainSetup, oom_advice
from ..errors import TrainingStopped
from ..settings import TrainSettings, to_dict
from ..tiers import validate_tier
from .artifacts import final_results, save_run
from .checkpoint import Checkpointer, TrainState
from .guards import Guards, Verdict, diagnosis, free_after_oom
from .metrics import Metrics
from .prepare import Run, prepare
from .schedule import lr_at, set_lr
from .step import Stepper
from .stopping import Stopping
from .task import Task
from .validation import BestKeeper, Validator


def fit(task: Task, settings: TrainSettings) -> dict[str, Any]:
    """Train ``task`` with ``settings``; returns the final figures (also written to all_results.json).

    A run that fails before writing anything leaves no empty ``output_dir`` behind (one it created itself)."""
    out = Path(settings.output_dir)
    created = not out.exists()
    try:
        return _fit(task, settings)
    except BaseException:
        if created:
            remove_if_empty(out)
        raise


def remove_if_empty(folder: Path) -> None:
    """Delete ``folder`` when it holds no file at any depth (only empty folders)."""
    if folder.is_dir() and not any(p.is_file() or p.is_symlink() for p in folder.rglob("*")):
        shutil.rmtree(folder, ignore_errors=True)


def _fit(task: Task, settings: TrainSettings) -> dict[str, Any]:
    validate_tier(settings.tier, settings.recompute, train_mode=task.train_mode)  # before any data is loaded
    pusher = _hub_pusher(settings)  # before any data or model: a push that cannot work fails now
    run = prepare(task, settings)
    s, acc, optimizer, ema = run.settings, run.accelerator, run.optimizer, run.ema
    keeper = BestKeeper(task.best_metric, run.output_dir / "best", s.early_stopping_patience,
                        save=s.save_best or s.load_best_at_end)
    checkpointer = Checkpointer(acc, run.output_dir, s.checkpointing_steps, s.checkpoints_total_limit, ema, keeper,
                                acc.print)
    state = checkpointer.resume(s.resume_from_checkpoint, TrainState.start(s, task.fingerprint()))
    order = task.sample_order(s.seed)
    stepper = Stepper(task, run.model, acc, order, s.seed, s.max_grad_norm)
    metrics = Metrics(acc, s, task.unit, run.flops_per_unit, training_peak(s.peak_tflops, acc.device, acc.print))
    every = s.eval_steps if run.plan.eval_steps is None else run.plan.eval_steps
    validator = Validator(task, run.model, acc, ema, s, keeper, metrics, every, run.output_dir)
    guards = Guards(s, run.plan.expected_initial_loss, state.step, oom_advice(_ladder_setup(run)), metrics.write)
    with Stopping(s.max_minutes, acc.is_main_process) as stopping, metrics.progress(state.step):
        try:
            while state.step < s.max_steps:
                step, lr = state.step, lr_at(state.step, s)
                set_lr(optimizer, lr)
                try:
                    result = stepper.run(step, state.micro_batch_size, state.gradient_accumulation_steps)
                except torch.cuda.OutOfMemoryError:
                    free_after_oom(optimizer)
                    if not guards.oom.may_retry(step):
                        raise
                    guards.oom.halve(state, step, metrics.write)
                    continue
                verdict = guards.check(step, result.loss, result.grad_norm)
                if verdict is not Verdict.OK:  # weights and optimizer state stay as they were
                    optimizer.zero_grad(set_to_none=True)
                    state.skipped_steps += 1
                    metrics.skipped(step, state.skipped_steps)
                    if verdict is Verdict.STOP:
                        checkpointer.save(step, state)
                        raise TrainingStopped(diagnosis(step, lr))
                    state.step += 1  # the step's data is consumed; the next step draws fresh samples
                    continue
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if ema is not None:
                    ema.update(step)
                state.step = step = step + 1
                state.units_seen += result.units * acc.num_processes
                metrics.record(step, result.loss, lr, result.grad_norm, result.units * acc.num_processes,
                               order.epoch_of(step, state.effective_batch))
                if validator.due(step):
                    with metrics.paused():
                        validator.run(step)
                    if validator.stop_early(step):
                        break
                if checkpointer.due(step):
                    with metrics.paused():
                        saved = checkpointer.save(step, state)
                    if pusher is not None:
                        pusher.checkpoint(saved, step)
                if stopping.out_of_time():
                    metrics.write(f"--max_minutes {s.max_minutes} reached at step {step}; finishing the run here")
                    break
                if stopping.signalled:
                    checkpointer.save(step, state)
                    raise TrainingStopped(f"stopped by SIGTERM at step {step}; checkpoint saved, resume with "
                                          "--resume_from_checkpoint latest")
        except KeyboardInterrupt:
            if state.step > checkpointer.last_saved:
                metrics.write(f"interrupted at step {state.step}: saving a checkpoint first")
                checkpointer.save(state.step, state)
            raise
    metrics.end_training()
    checkpointer.save_if_new(state)
    results = _finish(run, task, state, metrics, validator, keeper)
    if pusher is not None:
        pusher.finish(task.card_kind)
    return results


def _hub_pusher(s: TrainSettings):
    """The main process's ``HubPusher`` when ``--push_to_hub`` (the repo created now), else None."""
    if not s.push_to_hub:
        return None
    from accelerate import PartialState

    from ..hub import HubPusher

    if not PartialState().is_main_process:
        return None
    return HubPusher(s.hub_model_id or Path(s.output_dir).resolve().name, s.output_dir, private=s.hub_private,
                     strategy=s.hub_strategy, log=print)


def _ladder_setup(run: Run) -> TrainSetup:
    """The run as the memory ladder sees it (a generic sequence for tasks without a run shape)."""
    s = run.settings
    return run.plan.shape.setup(s) if run.plan.shape else TrainSetup(tier=s.tier, recompute=s.recompute)


def _finish(run: Run, task: Task, state: TrainState, metrics: Metrics, validator: Validator,
            keeper: BestKeeper) -> dict[str, Any]:
    """The final evaluation (EMA weights), the best weights if asked, and what the run leaves on disk."""
    acc, s = run.accelerator, run.settings
    final = validator.final(state.step)
    use_best = validator.restore_best(state.step, final)
    results = final_results(state.step, task.unit, state.units_seen, final, keeper, use_best, metrics.history, {
        **metrics.summary(), "skipped_steps": state.skipped_steps, "micro_batch_size": state.micro_batch_size,
        "gradient_accumulation_steps": state.gradient_accumulation_steps, "mixed_precision": acc.mixed_precision})
    if acc.is_main_process:
        recorded = to_dict(*(x for x in (task.cfg, s) if x is not None))
        save_run(task, acc.unwrap_model(run.model), run.ema, use_best, run.output_dir, results, recorded,
                 metrics.history, metrics.write)
    acc.end_training()
    return results
