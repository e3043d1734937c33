"""Everything before the first step: the Accelerator (bf16 autocast on GPU, fp32 on CPU), the output folder claimed
for this run (writable, locked, no earlier run in it: ``outdir``), the task's setup (its data errors are one line),
autofit (a new settings object), the memory tiers in their fixed order (``hf_cgpu.tiers``), the optimizer (``hf_cgpu.optim``), accelerate's
prepare, EMA, and room on disk for two checkpoints. The result is a ``Run``; the settings it holds are the ones the
run trains with, its lock is held until ``fit`` returns."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from ..budget import autofit_settings, flops_per_token
from ..budget.card import find_card
from ..budget.ladder import GRAPHS_RECOMPUTE_NOTE
from ..budget.memory import GiB
from ..errors import SettingsError
from ..optim import build_optimizer
from ..options import CUDA_GRAPH_MODES
from ..paths import cache_dir
from ..settings import TrainSettings
from ..tiers import apply_tiers
from .compiled import RecompileWatch, use_compile_cache
from .ema import EMA, SWA
from .fingerprint import saved_config
from .forecast import cap_memory
from .outdir import RunLock, check_free_space, checkpoint_bytes, claim, entries, undo_start
from .parallel import kind, make_accelerator, template_of
from .task import Task, TaskPlan


@dataclass(frozen=True)
class Run:
    """A prepared run."""

    settings: TrainSettings
    """Frozen; after --autofit, the settings the ledger chose."""
    accelerator: Accelerator
    plan: TaskPlan
    """What the task's setup declared; ``plan.model`` is the model before tiers."""
    model: torch.nn.Module
    """The model the loop trains: tiers applied, on the device, prepared by accelerate."""
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    output_dir: Path
    lock: RunLock | None = None
    """The output folder's lock (main process), released by ``fit``."""
    recompiles: RecompileWatch | None = None
    """Counts torch.compile recompilations (compiled runs only), closed by ``fit``."""
    template: torch.nn.Module | None = None
    """FSDP2: a plain CPU copy of the model on the main process, the whole weights are gathered into it
    (``parallel.full_model``); None otherwise."""
    model_config: dict | None = None
    """The model's config as it is saved, taken before the tiers touch it (the resume fingerprint's model part)."""

    @property
    def flops_per_unit(self) -> float:
        """MFU numerator per unit: the task's count, else the ledger's model FLOPs per token (no recompute)."""
        plan = self.plan
        if plan.flops_per_unit or plan.shape is None:
            return plan.flops_per_unit
        return flops_per_token(plan.shape.model, plan.shape.setup(self.settings), count_recompute=False)


COMPILE_ON_CPU = "HF_CGPU_COMPILE_ON_CPU"
"""Set to a torch.compile backend (eager, aot_eager, inductor) to compile on the CPU too: for tests of compiled
runs (recompiles, start-up); --compile is otherwise applied on CUDA only."""

_ANNOUNCED: set[str] = set()


def announce_cache(log=print) -> None:
    """Say once per process where hf_cgpu's caches are and how large they are (packed tokens, decoded images,
    features, the bench), so the disk they take is never a surprise."""
    root = cache_dir()
    if str(root) in _ANNOUNCED or not root.is_dir():
        return
    _ANNOUNCED.add(str(root))
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
    log(f"cache: {root} holds {size / 1e6:,.0f} MB (packed tokens, decoded images, bench); set HF_CGPU_CACHE to "
        "move it, delete it to free the space (it is rebuilt when needed)")


def mixed_precision(s: TrainSettings) -> str:
    if s.mixed_precision != "auto":
        return s.mixed_precision
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def prepare(task: Task, s: TrainSettings) -> Run:
    out_dir = Path(s.output_dir)
    before = entries(out_dir)
    lock = claim(out_dir, s.resume_from_checkpoint, s.overwrite_output_dir) if _is_main() else None
    try:
        accelerator = make_accelerator(mixed_precision=mixed_precision(s), project_dir=str(out_dir),
                                       log_with=s.trackers)
        accelerator.wait_for_everyone()  # the folder is claimed (and an earlier run cleared) before anyone reads it
        return _prepare(task, s, accelerator, out_dir, lock)
    except BaseException:
        if lock is not None:  # ours while we hold the lock: what this run made before its first step goes again
            undo_start(out_dir, before)
            lock.release()
        raise


def _is_main() -> bool:
    """The main process, before the Accelerator exists (launchers set RANK)."""
    return int(os.environ.get("RANK", "0")) == 0


PROCESS_HOST_BYTES = 2 * 2**30
"""Host memory of the process besides the step's tensors (torch, transformers, the data and its tokenizer)."""


def available_host_memory() -> int | None:
    """Bytes the kernel says a new allocation can take (MemAvailable), or None where /proc/meminfo has no figure."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 if match else None


def check_cpu_run(setup, shape, s: TrainSettings, log=print, available: int | None = None, processes: int = 1) -> None:
    """Before a CPU run builds anything large: refuse, in one line, a run whose fp32 tensors (``host_ledger``) do not
    fit this machine's free memory (the kernel would kill it mid-step, saying nothing), and say how long a step
    takes on a CPU where the minutes would hold few steps."""
    from ..budget.card import CPU
    from ..budget.memory import host_ledger
    from ..budget.time import step_time
    from ..budget.work import lm_step_work

    need = (host_ledger(shape, setup).allocated + PROCESS_HOST_BYTES) * processes
    free = available_host_memory() if available is None else available
    if free is not None and need > free:
        raise SettingsError(f"on the CPU this run holds about {need / GiB:.1f} GiB (its fp32 tensors, the ledger: "
                            f"hf-cgpu budget --card cpu ...) and {free / GiB:.1f} GiB are free: train --preset tiny "
                            "here, lower --micro_batch_size, or run it on a GPU")
    step = step_time(lm_step_work(shape, setup), CPU).seconds
    if s.max_minutes > 0 and step * 10 > s.max_minutes * 60:
        log(f"note: on a CPU a step of this run takes about {step:,.0f} s (the ledger's assumed CPU): "
            f"--max_minutes {s.max_minutes:g} holds about {int(s.max_minutes * 60 / step)} of them; --preset tiny "
            "is the CPU-sized run")


def _prepare(task: Task, s: TrainSettings, accelerator: Accelerator, out_dir: Path, lock: RunLock | None) -> Run:
    device = accelerator.device
    if accelerator.num_processes > 1:
        accelerator.print(f"parallel: {kind(accelerator)} over {accelerator.num_processes} processes "
                          f"({accelerator.state.backend}, {device.type}); global batch {s.samples_per_step(accelerator.num_processes)}"
                          f" = micro_batch_size {s.micro_batch_size} x gradient_accumulation_steps "
                          f"{s.gradient_accumulation_steps} x {accelerator.num_processes} processes")
    set_seed(s.seed)
    cap_memory(s, device, accelerator.print)
    plan = task.setup(s, accelerator)
    s = plan.settings or s  # chosen from the data (--auto) before anything reads them
    model_config = saved_config(plan.model)
    if s.autofit:
        memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        if s.emulate_card:
            memory = find_card(s.emulate_card).memory_gib * GiB
        s = autofit_settings(s, plan.shape, memory, accelerator.print, processes=accelerator.num_processes,
                             parallel=kind(accelerator))
    if device.type == "cpu" and plan.shape is not None and s.tier == "full":
        check_cpu_run(plan.shape.setup(s), plan.shape.model, s, accelerator.print, processes=accelerator.num_processes)
    announce_cache(accelerator.print)
    cpu_backend = os.environ.get(COMPILE_ON_CPU, "")
    compile = s.compile and (device.type == "cuda" or bool(cpu_backend))
    if s.compile and not compile:
        accelerator.print(f"compile: skipped on {device.type} (torch.compile is applied on CUDA only: on a CPU the "
                          "first step compiles for minutes and the steps are rarely faster)")
    if compile and s.recompute and s.compile_mode in CUDA_GRAPH_MODES and device.type == "cuda":
        accelerator.print(f"note: --recompute under --compile_mode {s.compile_mode} saves less memory: "
                          f"{GRAPHS_RECOMPUTE_NOTE}; for the least memory add --compile_mode default")
    watch = None
    if compile:
        use_compile_cache(accelerator.print)  # before the first compile: a second run finds its kernels
        watch = RecompileWatch(accelerator.print).install()
    backend = cpu_backend if device.type != "cuda" and cpu_backend else "inductor"
    model = apply_tiers(plan.model, s, compile=compile, backend=backend)
    template = template_of(accelerator, model)  # on the CPU, before prepare shards the parameters in place
    if not getattr(model, "is_loaded_in_4bit", False) and not getattr(model, "hf_device_map", None):
        model = model.to(device)  # before the optimizer, so AdamW can be fused on CUDA
    optimizer = build_optimizer(model, s, also=plan.joint_modules)
    if plan.companions and accelerator.num_processes > 1:
        raise SettingsError(f"this run trains a second network beside the model, on one process only; launch it "
                            f"without accelerate's {accelerator.num_processes} processes")
    model, optimizer, *_ = accelerator.prepare(model, optimizer, *plan.companions)
    ema = EMA(accelerator.unwrap_model(model), s.ema_decay) if s.ema_decay > 0 else None
    if s.swa_start:  # the schedule's length is the run state's (``_fit`` points it there)
        ema = SWA(accelerator.unwrap_model(model), s.swa_start, lambda: s.max_steps)
    typed = "ema_decay" in s.given_flags.split(",")  # a preset's decay is its author's choice: no note for it
    if ema is not None and typed and (note := ema.warmup_note(s.max_steps)):
        accelerator.print(note)
    if accelerator.is_main_process:
        check_free_space(out_dir, checkpoint_bytes(accelerator.unwrap_model(model), s.tier, ema is not None))
    return Run(s, accelerator, plan, model, optimizer, ema, out_dir, lock, watch, template, model_config)
