"""Typed settings: dataclasses with one docstring per field, one command-line parser for all of them.

Precedence: command line > preset file (``--preset NAME`` or ``--preset path.json``) > dataclass defaults.
Every field becomes ``--field_name``; its help text is the docstring written under the field. Impossible
combinations are rejected in ``__post_init__`` (or by ``check``) with a one-line error that names the fix.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import math
import sys
import textwrap
import typing
from importlib.resources import files
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ArgumentParser, MissingPathError, SettingsError
from .optim import optimizer_choices, optimizer_settings, optimizer_spec
from .options import COMPILE_MODES, CUDA_GRAPH_MODES, MIXED_PRECISIONS, RECOMPUTE_POLICIES, check_choice, check_tier

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def preset_root() -> Traversable:
    """``hf_cgpu/presets`` as the installed package holds it (``importlib.resources``: a wheel, a zip, a checkout)."""
    return files("hf_cgpu") / "presets"


FIXED = {"resume": "fixed"}
"""Field metadata of a setting that changes the math of every later step: a resume must use the checkpoint's value
(``fixed_settings``; the resume fingerprint compares them). Settings without it may change on resume and apply from
there (the schedule's length, evaluation, logging)."""


def fixed_settings(*settings: Any) -> dict[str, Any]:
    """The ``FIXED`` fields of ``settings`` by name, and every field of a registered choice's settings (an optimizer's
    own settings change its updates)."""
    out: dict[str, Any] = {}
    for s in settings:
        for f in dataclasses.fields(s):
            value = getattr(s, f.name)
            if "options_of" in f.metadata and value is not None:
                out.update(dataclasses.asdict(value))
            elif f.metadata.get("resume") == "fixed":
                out[f.name] = value
    return out


def fixed_defaults(*settings: Any) -> dict[str, Any]:
    """What ``fixed_settings`` would give for settings left at their defaults: the value a checkpoint written before a
    setting existed was trained with (a new setting's default keeps the behaviour before it)."""
    out: dict[str, Any] = {}
    for s in settings:
        for f in dataclasses.fields(s):
            value = getattr(s, f.name)
            if "options_of" in f.metadata and value is not None:
                out.update(dataclasses.asdict(type(value)()))
            elif f.metadata.get("resume") == "fixed" and f.default is not dataclasses.MISSING:
                out[f.name] = f.default
    return out


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What the one training loop needs, whatever the model. Frozen: a change (autofit) is a new object."""

    output_dir: str = "outputs/run"
    """Where checkpoints, logs, the final model and all_results.json go."""
    max_steps: int = 1000
    """Optimizer steps to run (each sees micro_batch_size * gradient_accumulation_steps samples)."""
    max_minutes: float = 0.0
    """Stop (checkpoint, evaluate, save as usual) once training has run this many minutes; 0 = no time limit."""
    fit_schedule_to_time: bool = False
    """With --max_minutes: time the first steps on this machine (after warmup and the first evaluation), then end
    the cosine at the step that fits in the minutes left (at most max_steps), so a slower card still finishes its
    decay instead of stopping at a high learning rate. Where that timing point would come after half the minutes,
    the schedule is fitted from the steps so far, and a warmup too long for it is shortened. Where an extra loss
    stops partway (--mtp_anneal, --distill_anneal), the steps after it are counted at the ledger's cheaper cost. The
    length is kept in the checkpoint: a resumed run continues the same schedule."""
    micro_batch_size: int = 8
    """Samples per forward/backward pass; lower it (and raise accumulation) when memory is short."""
    gradient_accumulation_steps: int = 1
    """Micro-batches summed before each optimizer step; effective batch = micro_batch_size * this."""
    learning_rate: float = 6e-4
    """Peak learning rate reached after warmup."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at learning_rate * this (the seed decays to 10%)."""
    warmup_steps: int = 100
    """Linear warmup steps from 0 to learning_rate."""
    weight_decay: float = field(default=0.1, metadata=FIXED)
    """AdamW weight decay, applied to >=2-D weights only (not norms, biases, 1-D tensors)."""
    weight_decay_end: float = field(default=1.0, metadata=FIXED)
    """Weight-decay schedule: every group's weight decay (Muon's --muon_weight_decay too) is held at its value until
    --weight_decay_hold of the schedule's steps, then moves linearly to this multiple of it at the schedule's end
    (1 = constant, off; 0 = decayed away; 2 = ramped up to twice)."""
    weight_decay_hold: float = field(default=0.0, metadata=FIXED)
    """Fraction of the schedule's steps before --weight_decay_end starts moving the weight decay, in [0, 1)."""
    embedding_learning_rate: float = field(default=0.0, metadata=FIXED)
    """Peak learning rate of the input embedding tables (token table when untied from the head, learned positions,
    value embeddings), on the same schedule; their per-step weight decay stays what --weight_decay gives at
    --learning_rate. 0 = --learning_rate."""
    adam_beta1: float = field(default=0.9, metadata=FIXED)
    """AdamW beta1."""
    adam_beta2: float = field(default=0.95, metadata=FIXED)
    """AdamW beta2."""
    adam_eps: float = field(default=1e-8, metadata=FIXED)
    """AdamW epsilon."""
    optimizer: str = field(default="adamw", metadata={"choices": optimizer_choices, **FIXED})
    """The optimizer (hf_cgpu.optim registry); its own settings are the flags of its group below."""
    optimizer_options: Any = field(default=None, metadata={"cli": False, "options_of": "optimizer",
                                                           "registry": optimizer_settings})
    """The chosen optimizer's own settings (its spec's dataclass, e.g. MuonSettings); None = its defaults."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    mixed_precision: str = "auto"
    """'auto' (bf16 on a GPU that has it, else fp32), 'bf16' or 'no'."""
    compile: bool = False
    """torch.compile the model on CUDA (static shapes, dynamic=False; minutes of compile on the first step). Skipped
    with a note on the CPU, where compiling takes minutes and rarely pays off."""
    compile_mode: str = "default"
    """torch.compile's mode with --compile: default, reduce-overhead (CUDA graphs: fewer kernel launches, more
    memory), max-autotune-no-cudagraphs (autotuned matmul templates: a much longer first compile) or max-autotune
    (both). With gradient accumulation under CUDA graphs the loop accumulates into gradient buffers of its own
    (graph-owned gradients are overwritten by the next replay)."""
    recompute: bool = False
    """Activation checkpointing of every block: far less activation memory for one more forward in the backward."""
    recompute_policy: str = "full"
    """With --recompute: full (the backward re-runs each block: the least memory), selective (keeps the matmul and
    attention outputs and re-runs only norms, activations and casts: less time, more memory) or offload (full, with
    each block's input kept in pinned host memory, copied on a side stream: long sequences; not under CUDA graphs, so
    a preset's reduce-overhead / max-autotune becomes compile mode default). Without --compile selective runs a
    Python policy on every op and is slower than full."""
    tier: str = field(default="full", metadata=FIXED)
    """Memory tier: full (AdamW), adamw8bit (bitsandbytes 8-bit states), lora (frozen base + adapters), qlora."""
    lora_r: int = field(default=16, metadata=FIXED)
    """LoRA rank (tiers lora/qlora)."""
    lora_alpha: int = field(default=32, metadata=FIXED)
    """LoRA alpha; the update is scaled by alpha / r."""
    lora_dropout: float = field(default=0.0, metadata=FIXED)
    """Dropout on the LoRA input."""
    lora_target_modules: str = field(default="", metadata=FIXED)
    """Comma-separated module names to adapt; empty = chosen per architecture."""
    autofit: bool = False
    """Before training, let the ledger pick micro-batch/accumulation (effective batch kept), recompute and 8-bit
    AdamW, in the seed's order, so the run fits memory_cap; prints why (language models)."""
    memory_cap: str = ""
    """Memory budget for --autofit, e.g. 16GB (a 5070 Ti); empty = this GPU's total memory."""
    paged_optimizer: bool = field(default=False, metadata=FIXED)
    """Use bitsandbytes' paged AdamW8bit (tier adamw8bit) so optimizer state can spill to host memory."""
    eval_steps: int = 200
    """Run validation every this many optimizer steps (0 = only at the end)."""
    eval_batches: int = 0
    """Micro-batches of validation data per evaluation (0 = the whole validation split)."""
    save_best: bool = True
    """Keep the weights with the best validation figure (language models: val_loss) in output_dir/best."""
    load_best_at_end: bool = False
    """Finish with the best-by-validation weights as the output model (the last weights stay in checkpoints/)."""
    early_stopping_patience: int = 0
    """Stop when validation has not improved for this many evaluations in a row (0 = never stop early)."""
    log_steps: int = 10
    """Log loss, lr, grad_norm, throughput, MFU and memory every this many steps."""
    checkpointing_steps: int = 500
    """Save a resumable checkpoint every this many steps (0 = only at the end)."""
    checkpoints_total_limit: int = 3
    """Keep only the newest this many checkpoints."""
    resume_from_checkpoint: str = ""
    """'latest' (newest valid checkpoint in output_dir/checkpoints) or a checkpoint directory; empty = fresh start."""
    overwrite_output_dir: bool = False
    """A fresh start in an output_dir holding an earlier run deletes that run first (default: refuse)."""
    seed: int = field(default=0, metadata=FIXED)
    """Seed of data order, initialisation and every random draw (each step reseeds from seed and step)."""
    report_to: str = "none"
    """Experiment trackers for accelerate, comma-separated: none, tensorboard, wandb, ... (console logging is always
    on)."""
    peak_tflops: float = 0.0
    """bf16 peak used as the MFU denominator; 0 = what `hf-cgpu bench` measured on this machine, else none."""
    emulate_card: str = field(default="", metadata=FIXED)
    """Train as a named card would in --max_minutes (e.g. "RTX 5070 Ti"; `hf-cgpu budget --card` takes the same
    names): the run trains the steps the ledger says that card holds in the minutes, its schedule fitted to them (this
    machine's clock ends nothing), with the allocator capped at that card's memory less the CUDA context, and --preset
    auto chooses for that card; all_results.json and the model card say it was emulated. Needs --max_minutes."""
    ema_decay: float = field(default=0.0, metadata=FIXED)
    """Exponential moving average of the weights (0 = off); the image recipe uses 0.9999-ish. Warm-up
    min(decay, (1 + step) / (10 + step)): the decay itself applies from step (10 decay - 1) / (1 - decay) on
    (0.999: 8,990); a run that ends before says so where --ema_decay was given on the command line."""
    swa_start: float = field(default=0.0, metadata=FIXED)
    """Weight averaging (SWA): from this fraction of the schedule's steps on, every step's weights enter a running
    average with equal weight, and that average is what is evaluated, kept as the best weights and saved, as
    --ema_decay's average is; before it, evaluation sees the live weights. 0 = off; e.g. 0.7. Not with --ema_decay."""
    nan_patience: int = 5
    """Non-finite losses/gradient norms in a row before the run stops (each one skips its optimizer step)."""
    spike_factor: float = 10.0
    """Warn when grad_norm exceeds this times its running median (spikes precede loss blow-ups)."""
    oom_retry: bool = True
    """On CUDA out-of-memory in the first steps, halve micro_batch_size and double accumulation, down to 1."""
    progress: bool = True
    """Show a progress bar."""
    push_to_hub: bool = False
    """Upload the finished run to the Hub (weights, tokenizer or pipeline code, card, figures) with huggingface_hub;
    the token comes from HF_TOKEN or `hf auth login`, the repo is created before training starts."""
    hub_model_id: str = ""
    """Repo to push to: owner/name, or a name in your own namespace; empty = the output_dir's folder name."""
    hub_private: bool = False
    """Create the Hub repo private."""
    hub_strategy: str = "end"
    """end: push the finished run; checkpoint: also upload each checkpoint to last-checkpoint/ in the background (as
    the HF Trainer does), so a crashed run can be resumed from the Hub."""
    train_mode: str = field(default="", metadata={"cli": False})
    """What the task starts from (pretrain: random weights, finetune: a trained model), which decides the tiers it can
    use; set from the task (by the recipe's parser, else by ``fit``); empty = not known yet."""
    given_flags: str = field(default="", metadata={"cli": False, "given_flags": True})
    """The flags given on the command line, comma-separated (set by the parser; empty for settings made in code): a
    note about a setting's value is for the person who typed it, not for a preset's choice."""

    def _check_offload(self) -> None:
        """Offload's host copies run in autograd hooks, which a CUDA graph's replay skips: a typed CUDA-graph compile
        mode is refused, a preset's becomes ``default``."""
        if not (self.recompute and self.recompute_policy == "offload" and self.compile
                and self.compile_mode in CUDA_GRAPH_MODES):
            return
        if {"compile_mode", "compile"} & set(self.given_flags.split(",")):
            raise SettingsError(f"--recompute_policy offload copies block inputs to host memory in autograd hooks, "
                                f"which --compile_mode {self.compile_mode} (CUDA graphs) never replays: use "
                                "--compile_mode default, --compile false or --recompute_policy full")
        object.__setattr__(self, "compile_mode", "default")

    def __post_init__(self) -> None:
        check_types(self)
        check_tier(self.tier, self.train_mode)
        check_choice("compile_mode", self.compile_mode, COMPILE_MODES)
        check_choice("recompute_policy", self.recompute_policy, RECOMPUTE_POLICIES)
        self._check_offload()
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise SettingsError(f"mixed_precision={self.mixed_precision!r}; use auto, bf16 or no (fp16 needs loss "
                                "scaling)")
        self._check_optimizer()
        for name in ("max_steps", "micro_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.warmup_steps < 0 or self.learning_rate <= 0:
            raise SettingsError("learning_rate must be > 0 and warmup_steps >= 0")
        if not 0 <= self.ema_decay < 1:
            raise SettingsError(f"ema_decay={self.ema_decay!r}; use 0 (off) or a decay in (0, 1), "
                                "e.g. --ema_decay 0.999")
        if self.weight_decay_end < 0 or not 0 <= self.weight_decay_hold < 1:
            raise SettingsError(f"--weight_decay_end {self.weight_decay_end} / --weight_decay_hold "
                                f"{self.weight_decay_hold}; use a multiple >= 0 (1 = constant) and a fraction in "
                                "[0, 1)")
        if not 0 <= self.swa_start < 1:
            raise SettingsError(f"--swa_start {self.swa_start}; use a fraction of the steps in [0, 1), e.g. 0.7 "
                                "(0 = off)")
        if self.swa_start and self.ema_decay:
            raise SettingsError("--swa_start and --ema_decay both average the weights; keep one: add --ema_decay 0 "
                                "(or drop --swa_start)")
        if self.early_stopping_patience < 0 or self.eval_batches < 0:
            raise SettingsError("early_stopping_patience and eval_batches must be >= 0")
        if self.emulate_card:
            from .budget.card import find_card

            find_card(self.emulate_card)  # an unknown name: one line listing the known ones
            if self.max_minutes <= 0:
                raise SettingsError(f"--emulate_card {self.emulate_card!r} trains the steps that card holds in the "
                                    "minutes: add --max_minutes M")
        if self.fit_schedule_to_time and self.max_minutes <= 0:
            raise SettingsError("--fit_schedule_to_time needs the minutes to fit into: add --max_minutes M")
        if self.hub_strategy not in ("end", "checkpoint"):
            raise SettingsError(f"hub_strategy={self.hub_strategy!r}; choose end or checkpoint")
        if (self.load_best_at_end or self.early_stopping_patience) and not self.eval_steps:
            raise SettingsError("load_best_at_end/early_stopping_patience need evaluations: set --eval_steps N")
        self._check_ranges()

    def _check_optimizer(self) -> None:
        """The optimizer is registered, can train this tier, and holds settings of its own kind (its defaults when
        none are given)."""
        spec = optimizer_spec(self.optimizer)
        if self.tier not in spec.tiers:
            raise SettingsError(f"optimizer {self.optimizer} trains tier {' or '.join(spec.tiers)} only, not "
                                f"{self.tier}; use --tier {spec.tiers[0]} or --optimizer adamw")
        options = self.optimizer_options
        if spec.settings is None and options is not None:
            raise SettingsError(f"optimizer {self.optimizer} takes no settings of its own, got {options!r}")
        if spec.settings is not None:
            if options is None:
                object.__setattr__(self, "optimizer_options", spec.settings())
            elif not isinstance(options, spec.settings):
                raise SettingsError(f"optimizer_options is a {type(options).__name__}; --optimizer {self.optimizer} "
                                    f"takes a {spec.settings.__name__}")
        if self.paged_optimizer and self.tier != "adamw8bit":
            raise SettingsError("--paged_optimizer pages 8-bit AdamW state: add --tier adamw8bit or drop it")

    def _check_ranges(self) -> None:
        """Values the libraries would reject with a traceback, or take silently to mean something else (a negative
        eval_steps evaluated every step, min_lr_ratio 2 raised the learning rate, a negative clip turned it off)."""
        at_least = {"log_steps": 1, "checkpoints_total_limit": 1, "nan_patience": 1, "lora_r": 1, "eval_steps": 0,
                    "checkpointing_steps": 0, "max_minutes": 0, "max_grad_norm": 0, "weight_decay": 0, "seed": 0,
                    "peak_tflops": 0, "embedding_learning_rate": 0}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                zero = {"eval_steps": " (0 = only at the end)", "checkpointing_steps": " (0 = only at the end)",
                        "max_minutes": " (0 = no time limit)", "max_grad_norm": " (0 = no clipping)"}.get(name, "")
                raise SettingsError(f"--{name} must be >= {low}{zero}, got {getattr(self, name)}")
        if self.seed >= 2**32:
            raise SettingsError(f"--seed must be below 2**32 (numpy's seed range), got {self.seed}")
        for name, value, closed in (("min_lr_ratio", self.min_lr_ratio, True), ("adam_beta1", self.adam_beta1, False),
                                    ("adam_beta2", self.adam_beta2, False), ("lora_dropout", self.lora_dropout, False)):
            if not (0 <= value <= 1 if closed else 0 <= value < 1):
                raise SettingsError(f"--{name} must be in [0, 1{']' if closed else ')'}, got {value}")
        if self.adam_eps <= 0 or self.lora_alpha <= 0 or self.spike_factor <= 1:
            raise SettingsError("--adam_eps and --lora_alpha must be > 0 and --spike_factor > 1 "
                                f"(got {self.adam_eps}, {self.lora_alpha}, {self.spike_factor})")
        resume = self.resume_from_checkpoint
        if resume not in ("", "latest") and not Path(resume).expanduser().is_dir():  # before any folder is made
            raise MissingPathError(f"checkpoint {resume!r} not found; pass 'latest' or an existing step_N directory")
        if self.trackers:
            from accelerate.utils import LoggerType

            known = sorted(str(k.value) for k in LoggerType)
            unknown = [n for n in self.trackers if n not in known]
            if unknown:
                raise SettingsError(f"--report_to {self.report_to!r}: {', '.join(unknown)} is no tracker accelerate "
                                    f"knows; choose none or from {', '.join(known)}")

    @property
    def trackers(self) -> list[str] | None:
        """``report_to`` as accelerate's ``log_with`` takes it: the names, or None for none."""
        return None if self.report_to == "none" else [n.strip() for n in self.report_to.split(",")]

    def samples_per_step(self, processes: int = 1) -> int:
        """Samples per optimizer step over ``processes`` data-parallel processes (the effective batch)."""
        return self.micro_batch_size * self.gradient_accumulation_steps * processes


def check_types(settings: Any) -> None:
    """One line for a field given a value of the wrong kind (the command line converts them, code may not): a bool
    that is not True or False, a number that is not one (a string "yes" would otherwise be truthy, "8" compare as
    text), a float that is nan or infinite (``--learning_rate nan`` would train nothing, silently)."""
    hints = _hints(type(settings))
    for f in dataclasses.fields(settings):
        value, kind = getattr(settings, f.name), hints.get(f.name)
        if kind is bool and not isinstance(value, bool):
            raise SettingsError(f"{f.name} must be True or False, got {value!r}")
        if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise SettingsError(f"{f.name} must be a number, got {value!r}")
        if kind is float and not math.isfinite(value):
            raise SettingsError(f"--{f.name} must be a finite number, got {value!r}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# ---------------------------------------------------------------- parsing


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each dataclass field (the litgpt convention), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _str2bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _arg_type(tp: Any):
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _arg_type(args[0])
    if tp is bool:
        return _str2bool
    if tp in (int, float, str):
        return tp
    raise TypeError(f"unsupported settings field type {tp}")


def _family_files(family: str) -> dict[str, Traversable]:
    folder = preset_root() / family
    if not folder.is_dir():
        return {}
    return {f.name[: -len(".json")]: f for f in folder.iterdir() if f.name.endswith(".json")}


def list_presets(family: str) -> list[str]:
    return sorted(_family_files(family))


def preset_description(name: str, family: str) -> str:
    """The one-line ``description`` of a preset (empty when it has none)."""
    found = _family_files(family).get(name)
    if found is None:
        return ""
    try:
        return str(json.loads(found.read_text(encoding="utf-8")).get("description", ""))
    except (ValueError, AttributeError):
        return ""


def presets_text(family: str) -> str:
    """A ``presets:`` block for ``--help``: each preset of ``family`` with its description."""
    names = list_presets(family)
    width = max(map(len, names), default=0) + 2
    return "presets:\n" + "\n".join(f"  {n:<{width}}{preset_description(n, family)}" for n in names)


def load_preset(name: str, family: str) -> dict[str, Any]:
    """A preset by name (``hf_cgpu/presets/<family>/<name>.json``, read with importlib.resources) or a JSON file."""
    path = Path(name).expanduser()
    if path.suffix:
        if not path.is_file():
            raise SettingsError(f"preset file {name!r} not found; give an existing .json file or a preset name "
                                f"({', '.join(list_presets(family))})")
        text = path.read_text(encoding="utf-8")
    else:
        found = _family_files(family).get(name)
        if found is None:
            raise SettingsError(f"unknown preset {name!r}; choose one of {', '.join(list_presets(family))} or give "
                                "a .json file")
        text = found.read_text(encoding="utf-8")
    try:
        preset = json.loads(text)
    except json.JSONDecodeError as e:
        raise SettingsError(f"preset {name!r} is not valid JSON ({e.msg} at line {e.lineno}); fix the file") from None
    if not isinstance(preset, dict):
        raise SettingsError(f"preset {name!r} must be a JSON object of setting names and values")
    return preset


def _shown(value: Any) -> str:
    """A default as the user would type it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return str(value)


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a settings class that are flags (not those marked ``metadata={"cli": False}``)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def option_groups(classes: tuple[type, ...]) -> list[tuple[dataclasses.Field, dict[str, type | None]]]:
    """Fields that hold the settings of a registered choice (``metadata["options_of"]``: the field naming the choice,
    ``metadata["registry"]``: choice -> its settings class), with the registry read now."""
    return [(f, f.metadata["registry"]()) for cls in classes for f in dataclasses.fields(cls)
            if "options_of" in f.metadata]


def parser_classes(classes: tuple[type, ...]) -> tuple[type, ...]:
    """``classes`` with the settings class of every registered choice (the optimizers' own settings) right after the
    class that holds the choice."""
    out: list[type] = []
    for cls in classes:
        out.append(cls)
        out += [c for _, registry in option_groups((cls,)) for c in registry.values() if c is not None]
    return tuple(dict.fromkeys(out))


def build_parser(
    classes: tuple[type, ...], description: str = "", family: str | None = None, prog: str | None = None,
    preset: dict[str, Any] | None = None, preset_name: str | None = None, epilog: str | None = None,
) -> argparse.ArgumentParser:
    """One flag per field (and per field of every registered choice's settings); its help is the field's docstring,
    the registered choices where the field lists them, and the value the run would use without the flag (the
    preset's when ``preset`` is given, else the dataclass default). Parsed values are None when not given."""
    usage = "%(prog)s" + (" [--preset NAME]" if family else "") + " [--SETTING VALUE ...]"
    if family and list_presets(family):
        epilog = "\n\n".join(x for x in (presets_text(family), epilog) if x)
    parser = ArgumentParser(prog=prog, description=description, epilog=epilog, usage=usage,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = preset or {}
    if family:
        shown = f" (default: {preset_name})" if preset_name else ""
        parser.add_argument("--preset", default=None,
                            help=f"preset name ({', '.join(list_presets(family))}) or a .json file; the defaults "
                                 f"below are the preset's where it sets them{shown}")
    owners = {cls: name for field_, registry in option_groups(classes) for name, cls in registry.items() if cls}
    seen: set[str] = set()
    for cls in parser_classes(classes):
        title = (cls.__doc__ or "").strip().splitlines()[0] or None
        if cls in owners:
            title = f"{title} (only with --{_choice_field(classes)} {owners[cls]})"
        group = parser.add_argument_group(cls.__name__, title)
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in cli_fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            kind = _arg_type(hints[f.name])
            extra = ({"nargs": "?", "const": True, "metavar": "true|false"} if kind is _str2bool
                     else {"metavar": {int: "INT", float: "FLOAT"}.get(kind, "TEXT")})
            value = preset.get(f.name, f.default)
            origin = f"; preset {preset_name}" if f.name in preset and preset_name else ""
            listed = choices_text(f.metadata.get("choices"))
            help_ = f"{docs.get(f.name, '')}{listed} (default: {_shown(value)}{origin})".strip().replace("%", "%%")
            group.add_argument(f"--{f.name}", type=kind, default=None, help=help_, **extra)
    return parser


def choices_text(choices: Any) -> str:
    """`` Choices: ...`` for a field whose registry lists them (``metadata["choices"]``: a function returning names, or
    names with a one-line summary each); empty for others."""
    if not choices:
        return ""
    found = choices()
    if isinstance(found, dict):
        return " Choices: " + "; ".join(f"{k}: {v}" for k, v in found.items()) + "."
    return f" Choices: {', '.join(found)}."


def _choice_field(classes: tuple[type, ...]) -> str:
    return next(f.metadata["options_of"] for f, _ in option_groups(classes))


def preset_in(argv: list[str] | None) -> str | None:
    """The ``--preset`` value of a command line (the last one wins, as argparse would have it)."""
    found = None
    args = list(argv or [])
    for i, arg in enumerate(args):
        if arg.startswith("--preset="):
            found = arg.split("=", 1)[1]
        elif arg == "--preset" and i + 1 < len(args):
            found = args[i + 1]
    return found


def parse_settings(
    classes: tuple[type, ...], argv: list[str] | None = None, family: str | None = None, description: str = "",
    prog: str | None = None, default_preset: str | None = None, epilog: str | None = None,
    fixed: dict[str, Any] | None = None,
) -> tuple:
    """Parse ``argv`` into one instance per dataclass: command line > preset > dataclass defaults.

    ``default_preset`` applies when ``argv`` names none; ``fixed`` sets fields that are no flags (a task's
    ``train_mode``); a field with ``metadata["given_flags"]`` receives the names of the flags given on the command
    line, comma-separated. The settings of a registered choice (``--optimizer muon`` -> ``MuonSettings``) become the
    instance of its ``options_of`` field; a value given for a choice that was not made is refused. ``--help`` shows
    the values the run would use.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    name = (preset_in(argv) or default_preset) if family else None
    preset = load_preset(name, family) if name else {}
    parser = build_parser(classes, description, family, prog, preset, name, epilog)
    ns = vars(parser.parse_args(argv))
    ns.pop("preset", None)
    known = {f.name for cls in parser_classes(classes) for f in cli_fields(cls)}
    unknown = set(preset) - known - {"description"}
    if unknown:
        raise SettingsError(f"preset has unknown keys {sorted(unknown)}; remove them or fix their names")
    values = {**{k: v for k, v in preset.items() if k in known}, **{k: v for k, v in ns.items() if v is not None},
              **(fixed or {})}
    typed = {k for k, v in ns.items() if v is not None}
    for f, registry in option_groups(classes):
        chosen = values.get(f.metadata["options_of"], _default_of(classes, f.metadata["options_of"]))
        for choice, cls in registry.items():
            given = {g.name: values[g.name] for g in (cli_fields(cls) if cls else []) if g.name in values}
            if choice == chosen and cls is not None:
                values[f.name] = cls(**given)
                check_types(values[f.name])
            elif given.keys() & typed:  # a preset's settings of another choice are left with it
                flag = next(k for k in given if k in typed)
                raise SettingsError(f"--{flag} is a setting of --{f.metadata['options_of']} {choice}; add "
                                    f"--{f.metadata['options_of']} {choice} or drop it")
    given = ",".join(sorted(typed))
    values.update({f.name: given for cls in classes for f in dataclasses.fields(cls) if f.metadata.get("given_flags")})
    out = []
    for cls in classes:
        names = {f.name for f in dataclasses.fields(cls)}
        out.append(cls(**{k: v for k, v in values.items() if k in names}))
        check_types(out[-1])
    return tuple(out)


def _default_of(classes: tuple[type, ...], name: str) -> Any:
    return next(f.default for cls in classes for f in dataclasses.fields(cls) if f.name == name)


def to_dict(*settings) -> dict[str, Any]:
    """The settings as one flat dict of flags (``all_results.json``, the card): a registered choice's settings
    (``optimizer_options``) are flattened in beside the choice, fields that are no flags are left out."""
    merged: dict[str, Any] = {}
    for s in settings:
        for f in dataclasses.fields(s):
            value = getattr(s, f.name)
            if "options_of" in f.metadata:
                merged.update(dataclasses.asdict(value) if value is not None else {})
            elif f.metadata.get("cli", True):
                merged[f.name] = value
    return merged
