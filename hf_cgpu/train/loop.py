"""The one training loop: a short driver over the components, each of which decides for itself.

    prepare      output folder claimed (outdir), accelerator, task setup, autofit, tiers, optimizer, EMA -> Run
    checkpoint   save / seal / prune / resume, EMA, best-weights and metrics state -> TrainState
    step         one optimizer step's forward/backward and clipping           -> StepResult
    update       the optimizer step and EMA, or a skip; figures read one step late -> Outcome
    guards       non-finite, spike, label leak, OOM
    metrics      logging window, MFU, trackers, history, progress bar
    validation   cadence, EMA weights in place, best weights, early stopping
    stopping     --max_minutes, SIGTERM (also when only the launcher received it), Ctrl-C
    artifacts    the model, all_results.json, history, curves, card

Exact resume by construction: the data order, the learning rate and every random draw of step ``k`` are functions
of ``(seed, k)`` only (``schedule``), so a run resumed from a checkpoint at step ``k`` replays the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..bench import training_peak
from ..budget import TrainSetup, oom_advice
from ..errors import Interrupted, OutputDirError, TrainingStopped, UserError
from ..hub.push import HubPusher
from ..integrity import as_disk_error
from ..settings import TrainSettings, to_dict
from ..options import CUDA_GRAPH_MODES
from .artifacts import against_base, final_results, save_run
from .checkpoint import Checkpointer, TrainState, list_checkpoints, nonfinite_tensors
from .guards import Guards, Verdict, diagnosis, diverged, free_after_oom
from .ema import SWA, ema_weights
from .fingerprint import run_fingerprint
from .forecast import Forecast, emulate, forecast
from .metrics import Metrics, peak_memory
from .outdir import LOCK_NAME
from .parallel import end_processes, full_model, gather_list, is_sharded, peak_memory_per_process
from .prepare import Run, prepare
from .quiet import quiet_saves
from .schedule import TimeFit, set_lr
from .step import Stepper
from .stopping import Stopping, resume_command
from .task import Task
from .update import Updater
from .validation import BestKeeper, Validator


def fit(task: Task, settings: TrainSettings) -> dict[str, Any]:
    """Train ``task`` with ``settings``; returns the final figures (also written to all_results.json).

    A run that fails before writing anything leaves no empty ``output_dir`` behind (one it created itself)."""
    out = Path(settings.output_dir)
    created = not out.exists()
    try:
        with task.running():
            return _run(task, settings)
    except BaseException as err:
        if created:
            remove_if_empty(out)
        if type(err) is KeyboardInterrupt:  # a Ctrl-C outside the steps, or a second one: stopped at once
            raise Interrupted(interruption("interrupted (Ctrl-C)", out)) from None
        raise


def interruption(what: str, output_dir: Path, saved: Path | None = None) -> str:
    """``what``, the checkpoint that is kept (``saved``, else the newest in ``output_dir``) and the command that
    resumes from it."""
    kept = saved or next(iter(reversed(list_checkpoints(output_dir))), None)
    if kept is None:
        return f"{what} before the first checkpoint; start again with: {resume_command()}"
    return f"{what}; checkpoint {kept} is kept: resume with: {resume_command()}"


def remove_if_empty(folder: Path) -> None:
    """Delete ``folder`` when it holds no file at any depth but the (released) run lock."""
    if folder.is_dir() and not any((p.is_file() or p.is_symlink()) and p.name != LOCK_NAME for p in folder.rglob("*")):
        shutil.rmtree(folder, ignore_errors=True)


def _run(task: Task, settings: TrainSettings) -> dict[str, Any]:
    if settings.train_mode != task.train_mode:  # settings made without the task: validated again for it
        settings = dataclasses.replace(settings, train_mode=task.train_mode)
    started = time.perf_counter()  # start-up (data, model, compile, first step) is timed from here
    pusher = hub_pusher(settings)  # before any data or model: a push that cannot work fails now
    run = prepare(task, settings)
    try:
        with quiet_saves(run.accelerator.unwrap_model(run.model)):
            results = _fit(run, task, pusher, started)
    except Exception as err:  # a disk error anywhere (best weights, the final save, samples): one line
        disk = None if isinstance(err, UserError) else as_disk_error(err)
        if disk is None:
            raise
        ckpts = list_checkpoints(run.output_dir)
        intact = f"checkpoint {ckpts[-1].name} is intact" if ckpts else "no checkpoint was sealed yet"
        where = f": {disk.filename}" if disk.filename else ""
        raise OutputDirError(f"writing to {run.output_dir} failed ({disk.strerror or disk}{where}); "
                             f"{intact}: free space (or fix the disk) and resume with --resume_from_checkpoint "
                             "latest") from err
    finally:
        if run.recompiles is not None:
            run.recompiles.close()
        if run.lock is not None:
            run.lock.release()
    if pusher is not None:
        pusher.finish(task.card)
    return results


def hub_pusher(s: TrainSettings):
    """The main process's ``HubPusher`` when ``--push_to_hub`` (the repo created now), else None."""
    if not s.push_to_hub:
        return None
    from accelerate import PartialState

    if not PartialState().is_main_process:
        return None
    return HubPusher(s.hub_model_id or Path(s.output_dir).resolve().name, s.output_dir, private=s.hub_private,
                     strategy=s.hub_strategy, log=print)


def _fit(run: Run, task: Task, pusher, started: float | None = None) -> dict[str, Any]:
    s, acc, optimizer, ema = run.settings, run.accelerator, run.optimizer, run.ema
    keeper = BestKeeper(task.best_metric, run.output_dir / "best", s.early_stopping_patience,
                        save=s.save_best or s.load_best_at_end, write=task.save_best)
    metrics = Metrics(acc, s, task.unit, run.flops_per_unit, training_peak(s.peak_tflops, acc.device, acc.print))
    metrics.watch_start_up(started, run.recompiles)
    checkpointer = Checkpointer(acc, run.output_dir, s.checkpointing_steps, s.checkpoints_total_limit, ema, keeper,
                                metrics.write, model=run.model, optimizer=optimizer, metrics=metrics)
    if pusher is not None:
        checkpointer.on_sealed = pusher.checkpoint  # a checkpoint goes up once it is sealed, never half-written
    settings_of_run = [x for x in (task.cfg, s) if x is not None]
    fingerprint = run_fingerprint(run.model_config, task.data_fingerprint(), *settings_of_run)
    fresh = TrainState.start(s, fingerprint, acc.num_processes)
    state = checkpointer.resume(s.resume_from_checkpoint, fresh, settings_of_run)
    predicted = _forecast(run, task, state.step)
    if s.emulate_card:
        emulate(predicted, s, state, acc.print)
    if isinstance(ema, SWA):  # the average starts at its fraction of the schedule this run trains (fitted or not)
        ema.last_step = lambda: state.last_step(s)
        fitted = " of the schedule once it is fitted" if s.fit_schedule_to_time else ""
        acc.print(f"swa: the weights of every step from step {ema.start:,} of {state.last_step(s):,} averaged "
                  f"(--swa_start {s.swa_start:g}{fitted}); evaluated, kept and saved in place of the live weights")
    if threads := state.use_cpu_threads(acc.device):
        metrics.write(threads)
    order = task.sample_order(s.seed)
    stepper = Stepper(task, run.model, acc, order, s.seed, s.max_grad_norm,
                      cuda_graphs=s.compile and acc.device.type == "cuda" and s.compile_mode in CUDA_GRAPH_MODES,
                      also=run.plan.joint_modules)
    every = s.eval_steps if run.plan.eval_steps is None else run.plan.eval_steps
    validator = Validator(task, run.model, acc, ema, s, keeper, metrics, every, run.output_dir, run.template)
    guards = Guards(s, run.plan.expected_initial_loss, state.step, oom_advice(_ladder_setup(run)), metrics.write,
                    processes=acc.num_processes)
    if task.train_mode == "finetune" and state.step == 0:  # the base it starts from: base_* in all_results
        with metrics.paused():
            validator.run(0)
    try:
        minutes = 0 if s.emulate_card else s.max_minutes  # an emulated card's minutes are its steps
        with Stopping(minutes, catch_signals=True) as stopping, metrics.progress(state.step):
            _train(s, acc, optimizer, ema, state, stepper, order, metrics, validator, guards, checkpointer, stopping,
                   predicted.annealed if predicted is not None else None)
            metrics.end_training()
            checkpointer.save_if_new(state)
            checkpointer.wait()
    except BaseException:
        checkpointer.close(raise_errors=False)
        raise
    return _finish(run, task, state, metrics, validator, keeper, checkpointer, predicted)


def _forecast(run: Run, task: Task, start_step: int) -> Forecast | None:
    """The ledger's figures for this process of the run (from ``start_step``), said once (a run the ledger cannot
    price says why and trains on)."""
    try:
        predicted = forecast(task, run.plan, run.settings, run.accelerator, start_step)
    except UserError as err:
        run.accelerator.print(f"ledger: this run is not priced ({err})")
        return None
    if predicted is not None:
        run.accelerator.print(predicted.line())
    return predicted


def _train(s, acc, optimizer, ema, state, stepper, order, metrics, validator, guards, checkpointer,
           stopping, annealed: tuple[float, float] | None = None) -> None:
    fit_time = TimeFit(s, state, stopping.clock, annealed)  # annealed: the steps after an extra loss stops are cheaper
    metrics.set_total(state.last_step(s))
    updater = Updater(acc, optimizer, ema)
    account = _Accounts(updater, guards, state, metrics, order, checkpointer)
    try:
        while state.step < state.last_step(s):
            step, lr = state.step, state.lr(state.step, s)
            set_lr(optimizer, lr, state.weight_decay_factor(step, s))
            stepper.task.at_step(step, state.last_step(s))
            try:
                result = stepper.run(step, state.micro_batch_size, state.gradient_accumulation_steps)
            except torch.cuda.OutOfMemoryError:
                free_after_oom(optimizer)
                if not guards.oom.may_retry(step):
                    raise
                guards.oom.halve(state, step, metrics.write)
                continue
            outcomes = updater.apply(step, lr, result)
            state.step = step = step + 1
            account(outcomes)
            fitted = fit_time.after_step(step, state, stopping.deadline, acc)
            if fitted:
                metrics.set_total(state.last_step(s))
                metrics.write(fitted)
            evaluate, save = validator.due(step, state.last_step(s)), checkpointer.due(step)
            if evaluate or save:
                account.flush()
                if guards.skipping:  # this step was skipped: a divergence under way prunes no older checkpoint
                    evaluate = save = False
            if evaluate:
                with metrics.paused():
                    validator.run(step)
                if validator.stop_early(step):
                    break
            if save:
                with metrics.paused():
                    saved = checkpointer.save(step, state)
                if saved is None:
                    checkpointer.wait()
                    raise TrainingStopped(diverged(step, lr, checkpointer.good))
            signalled, out_of_time = stopping.poll(acc)
            if out_of_time:
                account.flush()
                metrics.write(f"--max_minutes {s.max_minutes} reached at step {step}; finishing the run here"
                              + fit_time.unfitted())
                break
            if signalled:
                _stop_for_signal(step, stopping, account)
        account.flush()
    except KeyboardInterrupt:  # a second Ctrl-C: the step under way may be half done, so it is not saved
        checkpointer.close(raise_errors=False)
        raise


@dataclasses.dataclass
class _Accounts:
    """The guards, counters and logs for steps whose figures reached the host (one step late where the optimizer
    skips on the device, ``update``); a stop once they are all counted."""

    updater: Updater
    guards: Guards
    state: TrainState
    metrics: Metrics
    order: Any
    checkpointer: Checkpointer

    def __call__(self, outcomes) -> None:
        state, metrics = self.state, self.metrics
        queue, stop = list(outcomes), None
        while queue:
            o = queue.pop(0)
            verdict = self.guards.check(o.step, o.loss, o.grad_norm)
            # in a non-finite streak each step is read before the next
            self.updater.read_now = verdict is not Verdict.OK
            if verdict is Verdict.OK:
                state.units_seen += o.units
                metrics.record(o.step + 1, o.loss, o.lr, o.grad_norm, o.units,
                               self.order.epoch_of(o.step + 1, state.effective_batch * state.processes))
                continue
            queue += self.updater.flush()  # the step queued behind this one
            state.skipped_steps += 1  # the weights and optimizer state stayed as they were; the data is consumed
            metrics.skipped(o.step + 1, state.skipped_steps)
            if verdict is Verdict.STOP and stop is None:
                stop = o
        if stop is not None:
            saved = self.checkpointer.save(state.step, state, prune_old=False)
            self.checkpointer.wait()
            raise TrainingStopped(diagnosis(stop.step + 1, stop.lr, saved, self.checkpointer.good,
                                            list_checkpoints(self.checkpointer.output_dir)))

    def flush(self) -> None:
        """Count the step whose figures are still on the device (``Updater.flush``)."""
        self(self.updater.flush())


def _stop_for_signal(step: int, stopping: Stopping, account: _Accounts) -> None:
    """Ctrl-C or a SIGTERM after ``step``: its figures counted, a checkpoint of it (unless the newest is), then the
    one line naming it and the command that resumes (Ctrl-C: ``Interrupted``, exit 130)."""
    checkpointer = account.checkpointer
    account.flush()
    if step > checkpointer.last_saved:
        checkpointer.save(step, account.state)
    checkpointer.wait()
    if stopping.signal_name == "SIGINT":  # the newest whole checkpoint: this step's unless not finite
        raise Interrupted(interruption(f"interrupted (Ctrl-C) at step {step}", checkpointer.output_dir,
                                       checkpointer.good))
    raise TrainingStopped(f"stopped by {stopping.signal_name} at step {step}; checkpoint saved, resume with: "
                          f"{resume_command()}")


def _stop_unless_finite(run: Run, state: TrainState, checkpointer: Checkpointer, with_ema: bool) -> None:
    """Stop in one line (exit 2) when the weights the run would save (the EMA's where it is in place) hold a NaN or
    an infinity, naming the newest finite checkpoint; the final checkpoint was refused already for the same reason."""
    acc = run.accelerator
    bad = gather_list(acc, nonfinite_tensors(run.model, None, run.ema if with_ema else None))
    if bad:
        checkpointer.wait()
        lr = state.lr(max(0, state.step - 1), run.settings)
        raise TrainingStopped(f"{diverged(state.step, lr, checkpointer.good)} Nothing was evaluated, saved or sealed "
                              f"at the end ({len(bad)} tensors, first: {bad[0]}).")


def _ladder_setup(run: Run) -> TrainSetup:
    """The run as the memory ladder sees it (a generic sequence for tasks without a run shape)."""
    s = run.settings
    return run.plan.shape.setup(s) if run.plan.shape else TrainSetup(tier=s.tier, recompute=s.recompute)


def _finish(run: Run, task: Task, state: TrainState, metrics: Metrics, validator: Validator,
            keeper: BestKeeper, checkpointer: Checkpointer, predicted: Forecast | None = None) -> dict[str, Any]:
    """The final evaluation (EMA weights), the best weights if asked, and what the run leaves on disk; weights that
    are not finite are never evaluated, saved or sealed."""
    acc, s = run.accelerator, run.settings
    best_kept = s.load_best_at_end and keeper.step is not None
    if not best_kept:
        _stop_unless_finite(run, state, checkpointer, with_ema=True)
    final = validator.final(state.step)
    keeper.flush()  # the main process's copy of the best weights, written once more at the end
    acc.wait_for_everyone()
    use_best = validator.restore_best(state.step, final)
    _stop_unless_finite(run, state, checkpointer, with_ema=not use_best)  # the weights save_run writes
    results = final_results(state.step, task.unit, state.units_seen, final, keeper, use_best, metrics.history, {
        **metrics.summary(), "skipped_steps": state.skipped_steps, "micro_batch_size": state.micro_batch_size,
        "gradient_accumulation_steps": state.gradient_accumulation_steps, "processes": state.processes,
        "batch_changes": state.batch_changes, "mixed_precision": acc.mixed_precision,
        **({"card": task.card} if task.card else {}),
        **({"schedule_steps": state.last_step(s)} if s.fit_schedule_to_time else {})})
    if predicted is not None:  # beside what this process measured (a resumed run: from the step it resumed at)
        results["ledger"] = predicted.checked(results)
    if acc.num_processes > 1:
        results["processes_peak_memory"] = peak_memory_per_process(acc, peak_memory(acc.device))
    if warning := against_base(results):
        metrics.write(warning)
    recorded = to_dict(*(x for x in (task.cfg, s) if x is not None))
    with torch.compiler.set_stance("force_eager"):  # the end-of-run samples: no compile for their shapes
        if is_sharded(acc):  # the EMA weights are put in place on every rank, then gathered whole
            with ema_weights(run.ema, enabled=not use_best), full_model(acc, run.model, run.template) as whole:
                if whole is not None:
                    save_run(task, whole, None, use_best, run.output_dir, results, recorded, metrics.history,
                             metrics.write)
        elif acc.is_main_process:
            save_run(task, acc.unwrap_model(run.model), run.ema, use_best, run.output_dir, results, recorded,
                     metrics.history, metrics.write)
    end_processes(acc)
    return results
