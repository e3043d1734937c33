"""Typed settings: dataclasses with one docstring per field, one command-line parser for all of them.

Precedence: command line > preset file (``--preset NAME`` or ``--preset path.json``) > dataclass defaults.
Every field becomes ``--field_name``; its help text is the docstring written under the field. Impossible
combinations are rejected in ``__post_init__`` (or by ``check``) with a one-line error that names the fix.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import typing
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ArgumentParser, SettingsError
from .tiers import COMPILE_MODES, TIERS, validate_optimizer, validate_recompute_policy

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def preset_root() -> Traversable:
    """``hf_cgpu/presets`` as the installed package holds it (``importlib.resources``: a wheel, a zip, a checkout)."""
    return files("hf_cgpu") / "presets"


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
    decay instead of stopping at a high learning rate. The length is kept in the checkpoint: a resumed run continues
    the same schedule."""
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
    weight_decay: float = 0.1
    """AdamW weight decay, applied to >=2-D weights only (not norms, biases, 1-D tensors)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    optimizer: str = "adamw"
    """adamw (every weight) or muon: torch.optim.Muon (Nesterov momentum orthogonalised by 5 Newton-Schulz steps) on
    the 2-D hidden weight matrices, AdamW (learning_rate, weight_decay, betas) on embeddings, head, norms and biases;
    tier full only."""
    muon_learning_rate: float = 0.02
    """Peak learning rate of the Muon matrices (optimizer muon); follows the same warmup and cosine schedule."""
    muon_momentum: float = 0.95
    """Muon's Nesterov momentum (optimizer muon)."""
    muon_weight_decay: float = 0.0
    """Decoupled weight decay of the Muon matrices, times their learning rate (optimizer muon; Keller Jordan's
    default 0)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    mixed_precision: str = "auto"
    """'auto' (bf16 on a GPU that has it, else fp32), 'bf16' or 'no'."""
    compile: bool = False
    """torch.compile the model on CUDA (static shapes, dynamic=False; minutes of compile on the first step). Skipped
    with a note on the CPU, where compiling takes minutes and rarely pays off."""
    compile_mode: str = "default"
    """torch.compile's mode with --compile: default, reduce-overhead (CUDA graphs: fewer kernel launches, more
    memory), max-autotune-no-cudagraphs (autotuned matmul templates: a much longer first compile) or
    max-autotune (both). On an H200 the 124M GPT gained 0.5% from max-autotune-no-cudagraphs (cuBLAS won every
    matmul it tuned). With gradient accumulation under CUDA graphs the loop accumulates into gradient buffers of its
    own (train/step.py: graph-owned gradients are overwritten by the next replay; on an H200 the gradients match the
    default mode's, benchmarks/graphs_accumulation_check.py). Inductor's
    coordinate descent tuning (environment TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1) gave the flow UNet's step
    +2.7% for a first compile five times longer (benchmarks/RESULTS.md)."""
    recompute: bool = False
    """Activation checkpointing of every block: ~17x less activation memory for ~30% more time."""
    recompute_policy: str = "full"
    """With --recompute: full (the backward re-runs each block: the least memory) or selective (keeps the matmul and
    attention outputs and re-runs only norms, activations and casts; 1.4B LoRA with compiled blocks on an H200:
    +33% time at 6.90 GiB; full recompute +23-33% at 3.93 GiB in the recipe's step, 10.35 GiB without recompute).
    Without --compile selective runs a Python policy on every op and is slower than full."""
    tier: str = "full"
    """Memory tier: full (AdamW), adamw8bit (bitsandbytes 8-bit states), lora (frozen base + adapters), qlora."""
    lora_r: int = 16
    """LoRA rank (tiers lora/qlora)."""
    lora_alpha: int = 32
    """LoRA alpha; the update is scaled by alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_target_modules: str = ""
    """Comma-separated module names to adapt; empty = chosen per architecture."""
    autofit: bool = False
    """Before training, let the ledger pick micro-batch/accumulation (effective batch kept), recompute and 8-bit
    AdamW, in the seed's order, so the run fits memory_cap; prints why (language models)."""
    memory_cap: str = ""
    """Memory budget for --autofit, e.g. 16GB (a 5070 Ti); empty = this GPU's total memory."""
    paged_optimizer: bool = False
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
    seed: int = 0
    """Seed of data order, initialisation and every random draw (each step reseeds from seed and step)."""
    report_to: str = "none"
    """Experiment trackers for accelerate, comma-separated: none, tensorboard, wandb, ... (console logging is always
    on)."""
    peak_tflops: float = 0.0
    """bf16 peak used as the MFU denominator; 0 = what `hf-cgpu bench` measured on this machine, else none."""
    ema_decay: float = 0.0
    """Exponential moving average of the weights (0 = off); the image recipe uses 0.9999-ish. Warm-up
    min(decay, (1 + step) / (10 + step)): the decay itself applies from step (10 decay - 1) / (1 - decay) on
    (0.999: 8,990), and a run that ends before says so."""
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

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise SettingsError(f"unknown tier {self.tier!r}; choose one of {', '.join(TIERS)}")
        if self.compile_mode not in COMPILE_MODES:
            raise SettingsError(f"compile_mode={self.compile_mode!r}; choose one of {', '.join(COMPILE_MODES)}")
        if self.mixed_precision not in ("auto", "bf16", "no"):
            raise SettingsError(f"mixed_precision={self.mixed_precision!r}; use auto, bf16 or no (fp16 needs loss scaling)")
        for name in ("max_steps", "micro_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.warmup_steps < 0 or self.learning_rate <= 0:
            raise SettingsError("learning_rate must be > 0 and warmup_steps >= 0")
        if not 0 <= self.ema_decay < 1:
            raise SettingsError(f"ema_decay={self.ema_decay!r}; use 0 (off) or a decay in (0, 1), "
                                "e.g. --ema_decay 0.999")
        if self.early_stopping_patience < 0 or self.eval_batches < 0:
            raise SettingsError("early_stopping_patience and eval_batches must be >= 0")
        validate_optimizer(self.optimizer, self.tier)
        validate_recompute_policy(self.recompute_policy)
        if self.muon_learning_rate <= 0 or not 0 <= self.muon_momentum < 1 or self.muon_weight_decay < 0:
            raise SettingsError("muon_learning_rate must be > 0, muon_momentum in [0, 1) and muon_weight_decay >= 0; "
                                "e.g. --muon_learning_rate 0.02 --muon_momentum 0.95")
        if self.fit_schedule_to_time and self.max_minutes <= 0:
            raise SettingsError("--fit_schedule_to_time needs the minutes to fit into: add --max_minutes M")
        if self.hub_strategy not in ("end", "checkpoint"):
            raise SettingsError(f"hub_strategy={self.hub_strategy!r}; choose end or checkpoint")
        if (self.load_best_at_end or self.early_stopping_patience) and not self.eval_steps:
            raise SettingsError("load_best_at_end/early_stopping_patience need evaluations: set --eval_steps N")
        self._check_ranges()

    def _check_ranges(self) -> None:
        """Values the libraries would reject with a traceback, or take silently to mean something else (a negative
        eval_steps evaluated every step, min_lr_ratio 2 raised the learning rate, a negative clip turned it off)."""
        at_least = {"log_steps": 1, "checkpoints_total_limit": 1, "nan_patience": 1, "lora_r": 1, "eval_steps": 0,
                    "checkpointing_steps": 0, "max_minutes": 0, "max_grad_norm": 0, "weight_decay": 0, "seed": 0,
                    "peak_tflops": 0}
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
            from .errors import MissingPathError

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


def build_parser(
    classes: tuple[type, ...], description: str = "", family: str | None = None, prog: str | None = None,
    preset: dict[str, Any] | None = None, preset_name: str | None = None, epilog: str | None = None,
) -> argparse.ArgumentParser:
    """One flag per field; its help is the field's docstring and the value the run would use without the flag
    (the preset's when ``preset`` is given, else the dataclass default). Parsed values are None when not given."""
    usage = "%(prog)s" + (" [--preset NAME]" if family else "") + " [--SETTING VALUE ...]"
    parser = ArgumentParser(prog=prog, description=description, epilog=epilog, usage=usage,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = preset or {}
    if family:
        shown = f" (default: {preset_name})" if preset_name else ""
        parser.add_argument("--preset", default=None,
                            help=f"preset name ({', '.join(list_presets(family))}) or a .json file; the defaults "
                                 f"below are the preset's where it sets them{shown}")
    seen: set[str] = set()
    for cls in classes:
        group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0] or None)
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            kind = _arg_type(hints[f.name])
            extra = ({"nargs": "?", "const": True, "metavar": "true|false"} if kind is _str2bool
                     else {"metavar": {int: "INT", float: "FLOAT"}.get(kind, "TEXT")})
            value = preset.get(f.name, f.default)
            origin = f"; preset {preset_name}" if f.name in preset and preset_name else ""
            help_ = f"{docs.get(f.name, '')} (default: {_shown(value)}{origin})".strip().replace("%", "%%")
            group.add_argument(f"--{f.name}", type=kind, default=None, help=help_, **extra)
    return parser


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
) -> tuple:
    """Parse ``argv`` into one instance per dataclass: command line > preset > dataclass defaults.

    ``default_preset`` applies when ``argv`` names none. ``--help`` shows the values the run would use.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    name = (preset_in(argv) or default_preset) if family else None
    preset = load_preset(name, family) if name else {}
    parser = build_parser(classes, description, family, prog, preset, name, epilog)
    ns = vars(parser.parse_args(argv))
    ns.pop("preset", None)
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    unknown = set(preset) - known - {"description"}
    if unknown:
        raise SettingsError(f"preset has unknown keys {sorted(unknown)}; remove them or fix their names")
    values = {**{k: v for k, v in preset.items() if k in known}, **{k: v for k, v in ns.items() if v is not None}}
    out = []
    for cls in classes:
        names = {f.name for f in dataclasses.fields(cls)}
        out.append(cls(**{k: v for k, v in values.items() if k in names}))
    return tuple(out)


def to_dict(*settings) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for s in settings:
        merged.update(dataclasses.asdict(s))
    return merged
