"""What the ledger predicts for this run, said before its first step and checked at its end.

Every run prices itself on its own card (``budget.card.run_card``: this GPU's ``hf-cgpu bench``, else its public
figures; the CPU's rough figures on a CPU) with the functions ``hf-cgpu budget`` prints, and all_results.json keeps
the prediction beside what the run measured (``ledger``: seconds a step, peak reserved GiB on a GPU, the steps
``--max_minutes`` holds), so every run is a check of the ledger on the user's own card.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..budget.card import find_card, run_card
from ..budget.memory import CUDA_CONTEXT_BYTES, GiB, ledger
from ..budget.runs import annealed_cost, image_run_time, lm_run_time, teacher_extra
from ..budget.time import RunTime
from ..errors import SettingsError
from .schedule import fix_length


@dataclass(frozen=True)
class Forecast:
    """The ledger's figures for one run on its card."""

    card: str
    """The card priced, and where its figures come from."""
    time: RunTime
    reserved_bytes: float | None
    """Peak reserved memory per GPU (None on a CPU, where the ledger prices no allocator)."""
    start_step: int = 0
    """The step this process starts at (a resumed run's checkpoint): its minutes hold the steps after it."""
    emulated: bool = False
    """--emulate_card: the card priced is not this machine's, and the run trains the steps the card holds."""
    annealed: tuple[float, float] | None = None
    """(share, ratio): an extra loss stops at ``share`` of the schedule, a step after it ``ratio`` of one before
    (``budget.runs.annealed_cost``), for --fit_schedule_to_time; None where none is annealed."""

    @property
    def step_seconds(self) -> float:
        return self.time.step.seconds

    def line(self) -> str:
        """One line for the log before the first step."""
        steps = (f"; --max_minutes {self.time.minutes:g} holds ~{self.time.steps:,} steps"
                 if self.time.limited_by_minutes else "")
        memory = f", {self.reserved_bytes / GiB:.2f} GiB reserved" if self.reserved_bytes is not None else ""
        head = "ledger (emulated card)" if self.emulated else "ledger"
        return f"{head}: about {self.step_seconds:.4g} s a step{memory} on {self.card}{steps} (hf-cgpu budget)"

    def checked(self, results: dict[str, Any]) -> dict[str, Any]:
        """The prediction beside the run's measurement (``results``: all_results.json's figures): the mean step
        after each process's first, peak reserved memory, steps done in this process's --max_minutes (from
        ``start_step``)."""
        measured = results.get("step_seconds")
        out: dict[str, Any] = {"card": self.card, "step_seconds": float(f"{self.step_seconds:.6g}"),
                               "measured_step_seconds": float(f"{measured:.6g}") if measured else None,
                               "step_error": round(self.step_seconds / measured - 1, 4) if measured else None}
        if self.emulated:  # the step was measured on another card than the one priced: no error to state
            out.update(emulated=True, minutes=self.time.minutes, step_error=None)
        reserved = results.get("peak_reserved_gib")
        if self.reserved_bytes is not None and reserved:
            predicted = self.reserved_bytes / GiB
            out.update(reserved_gib=round(predicted, 3), measured_reserved_gib=round(reserved, 3),
                       reserved_error=round(predicted / reserved - 1, 4))
        if self.time.limited_by_minutes:
            out.update(steps_in_minutes=self.time.steps, measured_steps=(results.get("steps") or 0) - self.start_step)
        return out


def forecast(task, plan, settings, accelerator, start_step: int = 0) -> Forecast | None:
    """The ledger's figures for this run (a process that starts at ``start_step``), or None where the ledger does
    not price the task (a language model whose shape the task does not declare, the 2D toy)."""
    card = run_card(settings.peak_tflops, accelerator.device, settings.emulate_card)
    label = f"{card.name} ({card.source.split(':')[0]})"
    emulated = bool(settings.emulate_card)
    gpu = accelerator.device.type == "cuda"
    if plan.shape is not None:
        shape = plan.shape
        setup = shape.setup(settings, processes=accelerator.num_processes)
        rt = lm_run_time(shape.model, setup, settings, card, task.eval_micro_batches(settings))
        reserved = ledger(shape.model, setup).reserved if gpu else None
        return Forecast(label, rt, reserved, start_step=start_step, emulated=emulated,
                        annealed=annealed_cost(shape.model, setup, card))
    if task.ledger_task is None:
        return None
    from ..budget.images import image_ledger

    extra = teacher_extra(task.cfg)
    rt = image_run_time(task.ledger_task, task.cfg, settings, card, extra)
    reserved = image_ledger(task.ledger_task, task.cfg, settings, **extra).reserved if gpu else None
    return Forecast(label, rt, reserved, start_step=start_step, emulated=emulated)


def emulate(predicted: Forecast | None, settings, state, log=print) -> None:
    """--emulate_card on a fresh run: the schedule's length fixed to the steps the ledger gives that card in
    --max_minutes (a resumed run keeps the length its checkpoint holds); its warmup cut as --fit_schedule_to_time
    cuts it where the length cannot hold it."""
    if state.schedule_steps:
        return
    if predicted is None:
        raise SettingsError("--emulate_card trains the steps the ledger gives the card, and the ledger does not price "
                            "this run: drop --emulate_card")
    length = max(1, min(settings.max_steps, predicted.time.steps))
    fix_length(state, settings, 0, length)
    log(f"emulating {predicted.card}: the {length:,} steps the ledger gives it in --max_minutes "
        f"{settings.max_minutes:g}, the cosine fitted to them; this machine's clock ends nothing")


def cap_memory(settings, device, log=print) -> None:
    """--emulate_card on CUDA: the caching allocator capped at the card's memory less the CUDA context (which lies
    outside it), so a run that would not fit that card fails here as it would there."""
    if not settings.emulate_card or getattr(device, "type", "") != "cuda":
        return
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    cap = find_card(settings.emulate_card).memory_gib * GiB - CUDA_CONTEXT_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()  # it takes no bare "cuda"
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
    log(f"emulating {settings.emulate_card}: memory capped at {min(cap, total) / GiB:.2f} GiB of this GPU's "
        f"{total / GiB:.1f}")
