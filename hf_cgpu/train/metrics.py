"""Metrics: the logging window (loss, throughput, MFU, memory), accelerate's trackers, the history that becomes
history.json and the curves, and the progress bar; ``write`` prints beside the bar."""

from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from .compiled import first_step_line


def peak_memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "peak_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def counted_training_flops(model: torch.nn.Module, *inputs: Any) -> float:
    """Training FLOPs of one sample = 3 x the forward FLOPs that torch's FlopCounterMode counts on ``inputs``
    (eval mode, so BatchNorm uses its running statistics; the mode is restored)."""
    from torch.utils.flop_counter import FlopCounterMode

    was = model.training
    model.eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(*inputs)
    model.train(was)
    return 3.0 * counter.get_total_flops()


def device_label(device: torch.device) -> str:
    """The device a run trained on, as a card says it: 'NVIDIA GeForce RTX 5070 Ti', 'CPU (2 threads)'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"CPU ({torch.get_num_threads()} threads)"
    return device.type


@dataclass
class Window:
    """Training steps since the last log line."""

    loss_sum: float = 0.0
    steps: int = 0
    units: int = 0
    t0: float = field(default_factory=lambda: time.perf_counter())
    paused: float = 0.0
    """Seconds of evaluation and checkpointing inside the window: not training time."""

    def seconds(self) -> float:
        return max(1e-9, time.perf_counter() - self.t0 - self.paused)


class Metrics:
    """Every ``log_steps`` steps (and the last): mean loss, lr, grad norm, units/s, MFU, epoch, peak memory.

    ``state_dict`` (the history, the open logging window and the training time so far) travels in every checkpoint,
    so a resumed run's history.json, curves, train_loss and throughput cover the whole run, not its last process.
    """

    def __init__(self, accelerator, settings, unit: str, flops_per_unit: float, peak_tflops: tuple[float, str]):
        self.accelerator, self.unit, self.flops_per_unit = accelerator, unit, flops_per_unit
        self.peak, self.peak_source = peak_tflops
        self.log_steps, self.max_steps, self.show_progress = settings.log_steps, settings.max_steps, settings.progress
        self.device = accelerator.device
        self.history: list[dict[str, Any]] = []
        self.window = Window()
        self.seconds_before = 0.0
        """Training time of the processes before this one (restored from the checkpoint)."""
        self.started = time.perf_counter()
        self.run_units, self.run_seconds, self.run_steps = 0, 0.0, 0  # every logged window: the run's mean
        self.bar = None
        self.run_started, self.first_step_seconds, self.recompiles = None, None, None
        self.first_units, self.first_seconds, self.first_steps = 0, 0.0, 0
        """The first step of every process of the run (its compile included), summed: left out of
        ``{unit}_per_s_after_first_step``."""
        self._first_seen = False
        if accelerator.is_main_process and settings.report_to != "none":
            accelerator.init_trackers("hf_cgpu", config={k: v for k, v in asdict(settings).items() if v is not None})

    # ---- checkpointed state
    def state_dict(self) -> dict[str, Any]:
        w = self.window
        return {"history": self.history, "train_seconds": self.train_seconds,
                "run_units": self.run_units, "run_seconds": self.run_seconds, "run_steps": self.run_steps,
                "first_units": self.first_units, "first_seconds": self.first_seconds, "first_steps": self.first_steps,
                "window": {"loss_sum": w.loss_sum, "steps": w.steps, "units": w.units, "seconds": w.seconds()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = list(state.get("history") or [])
        self.seconds_before = float(state.get("train_seconds") or 0.0)
        self.started = time.perf_counter()
        self.run_units = int(state.get("run_units") or 0)
        self.run_seconds = float(state.get("run_seconds") or 0.0)
        self.run_steps = int(state.get("run_steps") or 0)
        self.first_units = int(state.get("first_units") or 0)
        self.first_seconds = float(state.get("first_seconds") or 0.0)
        self.first_steps = int(state.get("first_steps") or 0)
        w = state.get("window") or {}
        self.window = Window(float(w.get("loss_sum", 0.0)), int(w.get("steps", 0)), int(w.get("units", 0)),
                             time.perf_counter() - float(w.get("seconds", 0.0)))

    @property
    def train_seconds(self) -> float:
        """Wall time spent in the loop, over every process of the run (resumes included)."""
        return self.seconds_before + time.perf_counter() - self.started

    # ---- output
    def write(self, msg: str) -> None:
        (self.bar.write if self.bar is not None else self.accelerator.print)(msg)

    def set_total(self, steps: int) -> None:
        """The run's last step (``max_steps``, or the length ``--fit_schedule_to_time`` fixed): the progress bar's
        total and the step that is always logged."""
        self.max_steps = steps
        if self.bar is not None:
            self.bar.total = steps
            self.bar.refresh()

    @contextmanager
    def progress(self, first_step: int):
        if self.show_progress and self.accelerator.is_local_main_process:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.max_steps, initial=first_step, desc="train", unit="step", dynamic_ncols=True)
        self.started = time.perf_counter()
        try:
            yield self
        finally:
            if self.bar is not None:
                self.bar.close()
            self.bar = None

    @contextmanager
    def paused(self):
        """Time spent inside (evaluation, checkpoints) does not count as training time in the throughput."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.window.paused += time.perf_counter() - t0

    # ---- start-up and recompiles
    def watch_start_up(self, run_started: float | None, recompiles=None) -> None:
        """Time the first optimizer step from ``run_started`` (perf_counter at the start of ``fit``: data, model,
        compile and the step itself) and tell ``recompiles`` (a ``RecompileWatch``) the step it is at."""
        self.run_started, self.recompiles = run_started, recompiles

    def _first_step(self, step: int) -> None:
        if self.run_started is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()

        self.first_step_seconds = time.perf_counter() - self.run_started
        self.write(first_step_line(self.first_step_seconds, self.recompiles is not None))

    # ---- training steps
    def record(self, step: int, loss: float, lr: float, grad_norm: float, units: int, epoch: float) -> None:
        """One optimizer step done (``step`` counts it); logs when the window is due."""
        if not self._first_seen:  # this process's first step (its compile): timed, and kept out of one rate
            self._first_seen = True
            self._first_step(step)
            self.first_units += units
            self.first_steps += 1
            self.first_seconds += time.perf_counter() - self.started
        if self.recompiles is not None:
            self.recompiles.step = step
        w = self.window
        w.loss_sum, w.steps, w.units = w.loss_sum + loss, w.steps + 1, w.units + units
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.1e}")
        if step % self.log_steps and step != self.max_steps:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = w.seconds()
        rate = w.units / seconds
        self.run_units, self.run_seconds = self.run_units + w.units, self.run_seconds + seconds
        self.run_steps += w.steps
        metrics = {"train/loss": w.loss_sum / w.steps, "train/lr": lr, "train/grad_norm": grad_norm,
                   f"train/{self.unit}_per_s": rate, "train/epoch": epoch}
        if self.peak and self.flops_per_unit:
            metrics["train/mfu"] = self.flops_per_unit * rate / (self.peak * 1e12)
        metrics.update({f"train/{k}": v for k, v in peak_memory(self.device).items()})
        self._emit(step, metrics, " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items()))
        self.window = Window()

    def skipped(self, step: int, skipped_steps: int) -> None:
        self.accelerator.log({"train/skipped_steps": skipped_steps}, step=step)

    def evaluation(self, step: int, metrics: dict[str, float], improved: bool) -> None:
        if metrics:
            text = " ".join(f"{k}={v:.4g}" for k, v in metrics.items()) + (" (best so far)" if improved else "")
            self._emit(step, metrics, text)

    def _emit(self, step: int, metrics: dict[str, float], text: str) -> None:
        self.accelerator.log(metrics, step=step)
        self.history.append({"step": step, **metrics})
        self.write(f"step {step}: {text}")

    def end_training(self) -> None:
        """The loop is done: a window not yet logged (a run stopped between log lines) joins the run's totals."""
        w = self.window
        if w.steps:
            self.run_units, self.run_seconds = self.run_units + w.units, self.run_seconds + w.seconds()
            self.run_steps += w.steps
        self.window = Window()

    def mean_rate(self) -> float | None:
        """Units per second over the whole run's training time (evaluation and checkpoints left out)."""
        return self.run_units / self.run_seconds if self.run_units and self.run_seconds > 0 else None

    def rate_after_first_step(self) -> float | None:
        """The same without each process's first step, whose compile can dominate a short run's mean."""
        units, seconds = self.run_units - self.first_units, self.run_seconds - self.first_seconds
        return units / seconds if self.first_units and units > 0 and seconds > 0 else None

    def step_seconds(self) -> float | None:
        """Mean training seconds of an optimizer step, each process's first step (its compile) left out."""
        steps, seconds = self.run_steps - self.first_steps, self.run_seconds - self.first_seconds
        return seconds / steps if self.first_steps and steps > 0 and seconds > 0 else None

    def summary(self) -> dict[str, Any]:
        """What all_results.json says about throughput (the run's mean), MFU, its peak, the device, memory and the
        training time."""
        rate = self.mean_rate()
        mfu = self.flops_per_unit * rate / (self.peak * 1e12) if rate and self.peak and self.flops_per_unit else None
        return {f"{self.unit}_per_s": rate, f"{self.unit}_per_s_after_first_step": self.rate_after_first_step(),
                "mfu": mfu, "mfu_peak_tflops": self.peak or None,
                "mfu_peak_source": self.peak_source, "device": device_label(self.device),
                "train_seconds": round(self.train_seconds, 3), "step_seconds": self.step_seconds(),
                **peak_memory(self.device),
                "seconds_to_first_step": None if self.first_step_seconds is None else round(self.first_step_seconds, 3),
                "recompiles": self.recompiles.count if self.recompiles is not None else None}
