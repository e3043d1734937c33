"""The one training loop. A task turns a batch into a loss; the loop owns everything else.

Owned here: the ``Accelerator`` (bf16 autocast on GPU, fp32 on CPU), memory tiers applied in one fixed order before
the loop (``hf_cgpu.tiers``), optional ``torch.compile``, gradient accumulation, AdamW (fused on CUDA), warmup +
cosine to ``min_lr_ratio``, clipping, validation, logging (console, progress bar, accelerate trackers), atomic
checkpoints and exact resume, EMA, and the guards (non-finite skip/stop, grad-norm spikes, label leaks, OOM retry).

Exact resume by construction: the data order, the learning rate and every random draw of step ``k`` are functions
of ``(seed, k)`` only, so a run resumed from a checkpoint at step ``k`` replays what the uninterrupted run did.
"""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import shutil
import signal
import statistics
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file

from . import checkpoint as ckpt_io
from .settings import TrainSettings


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (diverged, out of memory at micro-batch 1); a checkpoint was saved first."""


class Task:
    """What a model family supplies to the loop. Subclasses fill in every method that raises."""

    unit = "sample"  # what throughput counts: "tok", "img"
    model: torch.nn.Module
    expected_initial_loss: float | None = None  # ln(vocab) for a causal LM: a much lower first loss = label leak
    train_mode = "pretrain"  # or "finetune": adapter tiers (lora, qlora) only make sense on a pretrained base
    card_kind: str | None = None  # model card template rendered into the output directory (gpt, flow, lora)
    cfg: Any = None  # the task's settings dataclass, recorded in all_results.json
    best_metric: str | None = None  # evaluation figure (lower is better) that picks the best weights, e.g. val_loss

    def setup(self, settings: TrainSettings, accelerator: Accelerator) -> None:
        """Build ``self.model`` and the data. Runs before any tier, compile or prepare."""
        raise NotImplementedError

    def num_train_samples(self) -> int:
        raise NotImplementedError

    def sample_order(self, seed: int) -> "SampleOrder":
        """What ``train_batch`` receives at each step: ``indices(step, batch)`` and ``epoch_of(step, batch)``, a
        function of ``(seed, step)`` only (exact resume). Default: sample indices, a new permutation each epoch."""
        return SampleOrder(self.num_train_samples(), seed)

    def train_batch(self, indices: torch.Tensor, device: torch.device, generator: torch.Generator) -> dict:
        """The micro-batch made of training samples ``indices`` (1-D LongTensor from ``sample_order``), on ``device``."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """Scalar fp32 loss of ``batch`` (random draws only from ``generator``)."""
        raise NotImplementedError

    def units(self, batch: dict) -> int:
        """Throughput units in ``batch`` (tokens, images)."""
        raise NotImplementedError

    def flops_per_unit(self) -> float:
        """Training FLOPs (forward + backward) per unit, for MFU; 0 = unknown."""
        return 0.0

    def evaluate(self, model: torch.nn.Module, settings: TrainSettings, device: torch.device) -> dict[str, float]:
        return {}

    def on_evaluate(self, model: torch.nn.Module, step: int, output_dir: Path) -> None:
        """Side products of an evaluation (e.g. a sample grid). Model holds EMA weights when EMA is on."""

    def save_pretrained(self, model: torch.nn.Module, output_dir: Path) -> None:
        raise NotImplementedError

    def save_best(self, model: torch.nn.Module, folder: Path) -> None:
        """Write the best-so-far weights (``output_dir/best``); default: what ``save_pretrained`` writes."""
        self.save_pretrained(model, folder)

    def load_saved_weights(self, model: torch.nn.Module, folder: Path) -> None:
        """Load weights that ``save_pretrained`` wrote to ``folder`` back into ``model`` (for the best weights)."""
        load_saved_weights(model, folder)

    def budget_shape(self) -> tuple[Any, int, int] | None:
        """(hf_cgpu.budget.ModelShape, seq_len, loss chunk tokens) for --autofit; None = not a language model."""
        return None

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a checkpoint to be resumable (model shape, vocab, ...)."""
        return {}


# ---------------------------------------------------------------- pieces the loop uses


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup to ``learning_rate``, then cosine to ``min_lr_ratio * learning_rate`` at ``max_steps``."""
    if step < s.warmup_steps:
        return s.learning_rate * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, s.max_steps - s.warmup_steps))
    floor = s.min_lr_ratio * s.learning_rate
    return floor + 0.5 * (s.learning_rate - floor) * (1 + math.cos(math.pi * progress))


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919 + 17) % (2**62)


class SampleOrder:
    """Sample indices of optimizer step ``k``: a fresh permutation each epoch, a function of (seed, k) alone."""

    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise ValueError("the training set is empty; point --dataset at data with at least one full sample")
        self.n, self.seed = num_samples, seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _perm_of(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 7_777 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    def indices(self, step: int, batch: int) -> torch.Tensor:
        out, pos = [], step * batch
        while len(out) < batch:
            epoch, offset = divmod(pos, self.n)
            take = min(batch - len(out), self.n - offset)
            out.extend(self._perm_of(epoch)[offset : offset + take].tolist())
            pos += take
        return torch.tensor(out, dtype=torch.long)

    def epoch_of(self, step: int, batch: int) -> float:
        return step * batch / self.n


class EMA:
    """Exponential moving average of trainable weights, saved as safetensors (no pickle in checkpoints)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().clone().float() for n, p in self.params.items()}

    def decay_at(self, step: int) -> float:
        """Warm-up: min(decay, (1 + step) / (10 + step)), so early averages do not drag in the random init
        (with 0.9999 and no warm-up, 41% of the EMA is still the init after 9000 steps)."""
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, step: int) -> None:
        names = list(self.params)
        shadow = [self.shadow[n] for n in names]
        torch._foreach_lerp_(shadow, [self.params[n].detach().float() for n in names], 1.0 - self.decay_at(step))

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange live and EMA weights (call twice to restore)."""
        for n, p in self.params.items():
            live = p.detach().float().clone()
            p.copy_(self.shadow[n].to(p.dtype))
            self.shadow[n] = live

    def save(self, path: Path) -> None:
        save_file({n: t.contiguous() for n, t in self.shadow.items()}, str(path))

    def load(self, path: Path) -> None:
        loaded = load_file(str(path))
        for n in self.shadow:
            self.shadow[n].copy_(loaded[n])


def _replace_dir(tmp: Path, final: Path) -> None:
    """Put directory ``tmp`` in place of ``final``: at every instant one complete copy exists on disk."""
    old = final.with_name(f".{final.name}-old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_saved_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load ``save_pretrained`` output (a peft adapter, or transformers/diffusers safetensors) into ``model``."""
    folder = Path(folder)
    if (folder / "adapter_model.safetensors").is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(folder / "adapter_model.safetensors")))
        return
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"{folder} does not match the model (missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]})")


class BestKeeper:
    """Keeps the weights with the lowest evaluation ``metric`` in ``output_dir/best`` and counts evaluations since
    the last improvement (early stopping). Its state travels in every checkpoint, so a resumed run keeps it."""

    def __init__(self, metric: str | None, folder: Path, patience: int = 0, save: bool = True):
        self.metric, self.folder, self.patience, self.save = metric, folder, patience, save
        self.value: float | None = None
        self.step: int | None = None
        self.metrics: dict[str, float] = {}
        self.stale = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "step": self.step, "metrics": self.metrics, "stale": self.stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value, self.step = state.get("value"), state.get("step")
        self.metrics, self.stale = dict(state.get("metrics") or {}), int(state.get("stale") or 0)

    def observe(self, metrics: dict[str, float], step: int, write: Callable[[Path], None] | None) -> bool:
        """Record one evaluation; ``write(folder)`` saves the weights evaluated when they are the best so far."""
        value = metrics.get(self.metric) if self.metric else None
        if value is None or not math.isfinite(value):
            return False
        if self.value is not None and value >= self.value:
            self.stale += 1
            return False
        self.value, self.step, self.metrics, self.stale = value, step, dict(metrics), 0
        if self.save and write is not None:
            tmp = self.folder.with_name(f".{self.folder.name}-tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            write(tmp)
            (tmp / "best.json").write_text(json.dumps({"step": step, **metrics}, indent=1))
            _replace_dir(tmp, self.folder)
        return True

    def should_stop(self) -> bool:
        return self.patience > 0 and self.stale >= self.patience


def _peak_memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "peak_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _peak_tflops(s: TrainSettings, device: torch.device) -> tuple[float, str]:
    if s.peak_tflops > 0:
        return s.peak_tflops, "--peak_tflops"
    if device.type == "cuda":
        from .bench import load_measured_peak

        peak = load_measured_peak()
        if peak:
            return peak, "hf-cgpu bench"
    return 0.0, "unknown (run `hf-cgpu bench` or pass --peak_tflops)"


def _mixed_precision(s: TrainSettings) -> str:
    if s.mixed_precision != "auto":
        return s.mixed_precision
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def _diagnosis(step: int, lr: float) -> str:
    return (
        f"training stopped at step {step}: loss or gradient norm kept coming out non-finite. Check, in this order: "
        f"(1) numerics - rerun a few steps with --mixed_precision no; (2) learning rate - cut it tenfold "
        f"(now {lr:.2e}) or lengthen warmup; (3) data - look for extremely long or single-token samples in the "
        f"batches of this step; (4) clipping - keep --max_grad_norm 1.0. The last good state is checkpointed."
    )


# ---------------------------------------------------------------- the loop


def fit(task: Task, s: TrainSettings) -> dict[str, Any]:
    """Train ``task`` with settings ``s``; returns the final figures (also written to all_results.json)."""
    from .tiers import apply_tiers, build_optimizer, validate_tier

    out_dir = Path(s.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(
        mixed_precision=_mixed_precision(s),
        log_with=None if s.report_to == "none" else s.report_to,
        project_dir=str(out_dir),
    )
    log = accelerator.print
    set_seed(s.seed)
    task.setup(s, accelerator)
    if s.autofit:
        apply_autofit(task, s, accelerator.device, log)
    validate_tier(s.tier, s.recompute, train_mode=task.train_mode)
    model = apply_tiers(
        task.model, s.tier, recompute=s.recompute, compile=s.compile, lora_r=s.lora_r, lora_alpha=s.lora_alpha,
        lora_dropout=s.lora_dropout, target_modules=[m for m in s.lora_target_modules.split(",") if m] or None,
    )
    if not getattr(model, "is_loaded_in_4bit", False) and not getattr(model, "hf_device_map", None):
        model = model.to(accelerator.device)  # before the optimizer, so AdamW can be fused on CUDA
    task.model = model
    optimizer = build_optimizer(
        model, s.tier, lr=s.learning_rate, weight_decay=s.weight_decay, betas=(s.adam_beta1, s.adam_beta2),
        eps=s.adam_eps, paged=s.paged_optimizer,
    )
    device = accelerator.device
    model, optimizer = accelerator.prepare(model, optimizer)
    ema = EMA(accelerator.unwrap_model(model), s.ema_decay) if s.ema_decay > 0 else None
    best = BestKeeper(task.best_metric, out_dir / "best", s.early_stopping_patience,
                      save=s.save_best or s.load_best_at_end)
    if accelerator.is_main_process and s.report_to != "none":
        accelerator.init_trackers("hf_cgpu", config={k: v for k, v in asdict(s).items() if v is not None})

    # ---- resume
    state = {"step": 0, "micro_batch_size": s.micro_batch_size, "accumulation": s.gradient_accumulation_steps,
             "skipped_steps": 0, "fingerprint": task.fingerprint(), "units_seen": 0}
    if s.resume_from_checkpoint:
        found = ckpt_io.find_resumable(out_dir, s.resume_from_checkpoint, warn=log)
        if found is None:
            log(f"no checkpoint in {ckpt_io.checkpoint_root(out_dir)}; starting from step 0")
        else:
            saved = ckpt_io.read_trainer_state(found)
            if saved.get("fingerprint") != state["fingerprint"]:
                diff = {k: (saved.get("fingerprint", {}).get(k), v) for k, v in state["fingerprint"].items()
                        if saved.get("fingerprint", {}).get(k) != v}
                raise ckpt_io.CheckpointError(
                    f"{found} was written for a different model/data ({diff} as checkpoint vs now); "
                    "resume with the settings it was made with, or use a fresh --output_dir"
                )
            accelerator.load_state(str(found))
            if ema is not None:
                ema.load(found / "ema.safetensors")
            best.load_state_dict(saved.pop("best", None) or {})
            state.update(saved)
            log(f"resumed from {found} at step {state['step']}")

    order = task.sample_order(s.seed)
    effective = state["micro_batch_size"] * state["accumulation"]
    peak, peak_source = _peak_tflops(s, device)
    flops_per_unit = task.flops_per_unit()
    grad_norms: deque[float] = deque(maxlen=200)
    bad_in_row, last_saved = 0, state["step"]
    window = {"loss": 0.0, "n": 0, "units": 0, "t0": time.perf_counter()}
    history: list[dict[str, Any]] = []
    metrics: dict[str, float] = {}
    trainable = [p for p in model.parameters() if p.requires_grad]

    def save_checkpoint(step: int) -> Path:
        nonlocal last_saved
        root = ckpt_io.checkpoint_root(out_dir)
        final, tmp = root / f"step_{step:07d}", root / f".tmp-step_{step:07d}"
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            tmp.mkdir(parents=True, exist_ok=True)
        accelerator.save_state(str(tmp))
        if accelerator.is_main_process:
            if ema is not None:
                ema.save(tmp / "ema.safetensors")
            (tmp / ckpt_io.TRAINER_STATE).write_text(
                json.dumps({**state, "step": step, "best": best.state_dict()}, indent=1))
            ckpt_io.seal(tmp, final)
            ckpt_io.prune(out_dir, s.checkpoints_total_limit)
        last_saved = step
        return final

    def run_step(step: int) -> tuple[float, float, int]:
        """Forward/backward over the accumulation window; returns (loss, grad_norm, units)."""
        micro, accum = state["micro_batch_size"], state["accumulation"]
        idx = order.indices(step, effective * accelerator.num_processes)
        idx = idx[accelerator.process_index * effective : (accelerator.process_index + 1) * effective]
        torch.manual_seed(step_seed(s.seed, step))  # dropout and any other global draw
        gen = torch.Generator(device=device).manual_seed(step_seed(s.seed, step))
        loss_sum = torch.zeros((), device=device)
        units = 0
        for k in range(accum):
            batch = task.train_batch(idx[k * micro : (k + 1) * micro], device, gen)
            ctx = accelerator.no_sync(model) if k < accum - 1 else nullcontext()
            with ctx:
                loss = task.loss(model, batch, gen)
                accelerator.backward(loss / accum)
            loss_sum += loss.detach().float()
            units += task.units(batch)
        if s.max_grad_norm > 0:
            norm = accelerator.clip_grad_norm_(trainable, s.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().float().norm() for p in trainable if p.grad is not None]))
        return (loss_sum / accum).item(), float(norm), units

    # ---- train
    stop_signal = {"hit": False}

    def _on_term(signum, frame):  # SIGTERM (e.g. a scheduler or `kill`): checkpoint, then stop
        stop_signal["hit"] = True

    old_term = signal.signal(signal.SIGTERM, _on_term) if accelerator.is_main_process else None
    bar = None
    if s.progress and accelerator.is_local_main_process:
        from tqdm.auto import tqdm

        bar = tqdm(total=s.max_steps, initial=state["step"], desc="train", unit="step", dynamic_ncols=True)
    first_step = state["step"]
    step = state["step"]
    last_eval: tuple[int | None, dict[str, float]] = (None, {})
    deadline = time.monotonic() + 60 * s.max_minutes if s.max_minutes > 0 else math.inf
    try:
        while step < s.max_steps:
            lr = lr_at(step, s)
            for group in optimizer.param_groups:
                group["lr"] = lr
            try:
                loss, gnorm, units = run_step(step)
            except torch.cuda.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
                if not s.oom_retry or step - first_step > 2:
                    raise
                if state["micro_batch_size"] == 1:
                    raise TrainingStopped(_oom_advice(task, s)) from None
                state["micro_batch_size"] //= 2
                state["accumulation"] *= 2
                log(f"CUDA out of memory at step {step}: retrying with micro_batch_size {state['micro_batch_size']} "
                    f"x accumulation {state['accumulation']} (same effective batch)")
                continue
            if step == first_step == 0 and task.expected_initial_loss and loss < 0.5 * task.expected_initial_loss:
                log(f"warning: first loss {loss:.3f} is far below ln(vocab)={task.expected_initial_loss:.3f}: "
                    "targets may not be shifted (label leak)")
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                optimizer.zero_grad(set_to_none=True)  # skip: weights and optimizer state stay as they were
                state["skipped_steps"] += 1
                bad_in_row += 1
                log(f"step {step}: non-finite loss/grad_norm ({loss}, {gnorm}); optimizer step skipped "
                    f"({bad_in_row}/{s.nan_patience} in a row)")
                accelerator.log({"train/skipped_steps": state["skipped_steps"]}, step=step)
                if bad_in_row >= s.nan_patience:
                    save_checkpoint(step)
                    raise TrainingStopped(_diagnosis(step, lr))
                step += 1  # the step's data is consumed; the next step draws fresh samples
                continue
            bad_in_row = 0
            if len(grad_norms) >= 20 and gnorm > s.spike_factor * statistics.median(grad_norms):
                log(f"warning: step {step} grad_norm {gnorm:.2f} is {gnorm / statistics.median(grad_norms):.0f}x "
                    "its running median; loss blow-ups often follow within tens of steps (consider lower LR)")
            grad_norms.append(gnorm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update(step)
            step += 1
            state["step"] = step
            state["units_seen"] += units * accelerator.num_processes
            window["loss"] += loss
            window["n"] += 1
            window["units"] += units * accelerator.num_processes
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.1e}")
            if step % s.log_steps == 0 or step == s.max_steps:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - window["t0"]
                rate = window["units"] / dt
                metrics = {"train/loss": window["loss"] / window["n"], "train/lr": lr, "train/grad_norm": gnorm,
                           f"train/{task.unit}_per_s": rate, "train/epoch": order.epoch_of(step, effective)}
                if peak and flops_per_unit:
                    metrics["train/mfu"] = flops_per_unit * rate / (peak * 1e12)
                metrics.update({f"train/{k}": v for k, v in _peak_memory(device).items()})
                accelerator.log(metrics, step=step)
                history.append({"step": step, **metrics})
                msg = " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items())
                (bar.write if bar is not None else log)(f"step {step}: {msg}")
                window = {"loss": 0.0, "n": 0, "units": 0, "t0": time.perf_counter()}
            if s.eval_steps and step % s.eval_steps == 0 and step < s.max_steps:
                last_eval = (step, _evaluate(task, model, ema, s, device, step, out_dir, accelerator, history, bar, best))
                if best.should_stop():
                    log(f"early stopping at step {step}: {best.metric} has not improved for {best.stale} evaluations "
                        f"(best {best.value:.4g} at step {best.step})")
                    break
            if s.checkpointing_steps and step % s.checkpointing_steps == 0:
                save_checkpoint(step)
            if time.monotonic() > deadline:
                log(f"--max_minutes {s.max_minutes} reached at step {step}; finishing the run here")
                break
            if stop_signal["hit"]:
                save_checkpoint(step)
                raise TrainingStopped(f"stopped by SIGTERM at step {step}; checkpoint saved, resume with "
                                      "--resume_from_checkpoint latest")
    except KeyboardInterrupt:
        if step > last_saved:
            log(f"interrupted at step {step}: saving a checkpoint first")
            save_checkpoint(step)
        raise
    finally:
        if bar is not None:
            bar.close()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)

    if step > last_saved:
        save_checkpoint(step)
    if last_eval[0] != step:  # an early stop (or the deadline) right after an evaluation reuses it
        last_eval = (step, _evaluate(task, model, ema, s, device, step, out_dir, accelerator, history, None, best))
    final = {k.split("/")[-1]: v for k, v in last_eval[1].items()}
    use_best = bool(s.load_best_at_end and best.step is not None and best.step != step and best.folder.is_dir())
    if use_best:
        accelerator.wait_for_everyone()
        task.load_saved_weights(accelerator.unwrap_model(model), best.folder)
        log(f"load_best_at_end: the saved model is the one of step {best.step} ({best.metric} {best.value:.4g}; "
            f"last step {step}: {final.get(best.metric, float('nan')):.4g})")
    last = next((h for h in reversed(history) if "train/loss" in h), {})
    results = {
        "steps": step,
        f"{task.unit}s_seen": state["units_seen"],
        "train_loss": last.get("train/loss"),
        **(best.metrics if use_best else final),
        **({f"best_{best.metric}": best.value, "best_step": best.step} if best.step is not None else {}),
        **({f"last_{k}": v for k, v in final.items()} if use_best else {}),
        "model_step": best.step if use_best else step,
        f"{task.unit}_per_s": last.get(f"train/{task.unit}_per_s"),
        "mfu": last.get("train/mfu"),
        "mfu_peak_tflops": peak or None,
        "mfu_peak_source": peak_source,
        "skipped_steps": state["skipped_steps"],
        "micro_batch_size": state["micro_batch_size"],
        "gradient_accumulation_steps": state["accumulation"],
        "mixed_precision": accelerator.mixed_precision,
        **_peak_memory(device),
    }
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        swap = ema is not None and not use_best  # the best weights were evaluated (and saved) with EMA in place
        if swap:
            ema.swap()
        task.save_pretrained(unwrapped, out_dir)
        if swap:
            ema.swap()
        settings = {**(asdict(task.cfg) if task.cfg is not None else {}), **asdict(s)}
        (out_dir / "all_results.json").write_text(json.dumps({**results, "settings": settings}, indent=2))
        (out_dir / "history.json").write_text(json.dumps(history))
        _plot_history(history, out_dir / "training_curves.png", task.unit, log)
        if task.card_kind:
            _render_card(task.card_kind, out_dir, log)
    accelerator.end_training()
    return results


def _evaluate(task, model, ema, s, device, step, out_dir, accelerator, history, bar, best=None) -> dict[str, float]:
    was_training, improved = model.training, False
    model.eval()
    if ema is not None:
        ema.swap()
    with torch.no_grad(), accelerator.autocast():
        raw = task.evaluate(model, s, device)
    metrics = {f"eval/{k}": v for k, v in raw.items()}
    if accelerator.is_main_process:
        task.on_evaluate(accelerator.unwrap_model(model), step, out_dir)
    if best is not None:  # while the evaluated (EMA) weights are in place
        write = (lambda folder: task.save_best(accelerator.unwrap_model(model), folder)) \
            if accelerator.is_main_process else None
        improved = best.observe(raw, step, write)
        accelerator.wait_for_everyone()
    if ema is not None:
        ema.swap()
    model.train(was_training)
    if metrics:
        accelerator.log(metrics, step=step)
        history.append({"step": step, **metrics})
        msg = " ".join(f"{k}={v:.4g}" for k, v in metrics.items()) + (" (best so far)" if improved else "")
        (bar.write if bar is not None else accelerator.print)(f"step {step}: {msg}")
    return metrics


def apply_autofit(task: Task, s: TrainSettings, device: torch.device, log=print) -> None:
    """Let the ledger choose micro-batch, accumulation, recompute and 8-bit AdamW so the run fits ``memory_cap``.

    The effective batch (tokens per optimizer step) is kept; the sequence length and the model are not touched, and
    adapter tiers are not chosen (the base model is already loaded). Changes ``s`` in place and logs each reason.
    """
    from . import budget
    from .settings import SettingsError

    info = task.budget_shape()
    if info is None:
        raise SettingsError("--autofit needs a language-model task; set micro_batch_size/recompute by hand here")
    shape, seq_len, loss_chunk = info
    if s.memory_cap:
        cap = budget.parse_memory(s.memory_cap)
    elif device.type == "cuda":
        cap = torch.cuda.get_device_properties(device).total_memory
    else:
        raise SettingsError("--autofit without a GPU needs --memory_cap, e.g. --memory_cap 16GB")
    base = budget.TrainSetup(seq_len=seq_len, micro_batch_size=s.micro_batch_size,
                             accumulation_steps=s.gradient_accumulation_steps, tier=s.tier, recompute=s.recompute,
                             loss_chunk=loss_chunk)
    plan = budget.autofit(shape, cap, seq_len=seq_len, micro_batch_size=s.micro_batch_size,
                          accumulation_steps=s.gradient_accumulation_steps, allow_lora=False,
                          allow_shorter_seq=False, base=base)
    for reason in plan.reasons:
        log(f"autofit: {reason}")
    if not plan.fits:
        raise SettingsError(f"autofit: no micro-batch/recompute/8-bit setting fits {budget.fmt_gib(cap)}; "
                            "pick a smaller preset or fine-tune an existing model with --tier lora")
    s.micro_batch_size = plan.setup.micro_batch_size
    s.gradient_accumulation_steps = plan.setup.accumulation_steps
    s.recompute = plan.setup.recompute
    s.tier = plan.setup.tier


def _plot_history(history: list[dict[str, Any]], path: Path, unit: str, log) -> None:
    """Loss (train and validation), learning rate, gradient norm and throughput against step, one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is a convenience
        return
    panels = [("loss", ["train/loss", "eval/val_loss"]), ("learning rate", ["train/lr"]),
              ("gradient norm", ["train/grad_norm"]), (f"{unit}/s", [f"train/{unit}_per_s"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            pts = [(h["step"], h[key]) for h in history if key in h]
            if pts:
                ax.plot(*zip(*pts), marker="o" if key.startswith("eval") else None, label=key.split("/")[-1])
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(keys) > 1:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    log(f"training curves: {path}")


def _render_card(kind: str, out_dir: Path, log) -> None:
    from .hub import render_model_card

    try:
        render_model_card(kind, out_dir)
    except Exception as err:  # a card is documentation: never let it fail a finished run
        log(f"warning: model card not written ({err})")


def _oom_advice(task: Task, s: TrainSettings) -> str:
    ladder = ["--recompute" if not s.recompute else None, "--tier adamw8bit" if s.tier == "full" else None,
              "a shorter --seq_len", "--tier lora (fine-tune an existing model instead)"]
    steps = "; then ".join(x for x in ladder if x)
    return f"CUDA out of memory even at micro_batch_size 1; next rung of the memory ladder: {steps} (see `hf-cgpu budget`)"

