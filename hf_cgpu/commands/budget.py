"""``hf-cgpu budget``: the memory ledger, the verdict against a cap, the next rung, and the hours of a run.

It reads the training command line itself: ``--preset``, the GPT's shape flags and every ``TrainSettings`` flag
mean what they mean to ``recipes/train_gpt.py``, so ``hf-cgpu budget --preset 350m --micro_batch_size 8`` describes
the run that ``train_gpt.py --preset 350m --micro_batch_size 8`` starts. ``--config`` or ``--model`` take any causal
LM instead (a local config.json, or a Hub id), as the fine-tuning recipe would train it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..budget.ladder import GRAPHS_RECOMPUTE_NOTE, RUNGS, autofit, next_rung
from ..budget.memory import (FRAGMENTATION_FRACTION, GiB, Ledger, fmt_gib, host_ledger, ledger, model_state_bytes,
                             parse_memory)
from ..budget.shape import REFERENCE_CONFIGS, ModelShape, RunShape, TrainSetup, fmt_count
from ..budget.card import CARDS, CPU, Card, find_card, resolve_card, with_peak
from ..budget.runs import image_run_time, lm_run_time, teacher_extra
from ..budget.time import RunTime, chinchilla_tokens, step_time
from ..errors import MissingPathError, SettingsError, about
from ..gguf import gguf_location
from ..settings import TrainSettings, list_presets, load_preset, parse_settings, preset_description
from ..tasks.settings import DPOSettings, FinetuneSettings, GPTSettings

REFERENCE_DESCRIPTIONS = {"pythia-1.4b": "the shape of EleutherAI/pythia-1.4b (24 x 2048, vocab 50304), for the "
                                          "ledger without a download; fine-tune it with hf-cgpu train lora"}
"""What the budget-only shapes are (``budget.shape.REFERENCE_CONFIGS``)."""

DEFAULT_PRESET = "124m"
DEFAULT_MEMORY_CAP = "16GB"
ALIASES = {"--accumulation": "--gradient_accumulation_steps", "--lora_rank": "--lora_r",
           "--lora_targets": "--lora_target_modules", "--loss_chunk": "--loss_chunk_size"}
"""The ledger's earlier flag names, read as the trainer's."""

DESCRIPTION = about("Print whether a training run fits in a GPU's memory (the ledger: every kind of memory one "
                    "step holds) and how long it takes.", "hf-cgpu budget --preset 350m --memory_cap 16GB --autofit",
                    "hf-cgpu budget --preset pythia-1.4b --tier qlora",
                    more=__doc__.split("\n\n", 1)[1])


@dataclass(frozen=True)
class BudgetSettings:
    """What the ledger asks besides the run (GB is read as GiB: a "16 GB" card has 16 GiB; --memory_cap: 16GB)."""

    config: str = ""
    """A local config.json of a transformers causal LM (or its directory), instead of --preset."""
    model: str = ""
    """A preset name, a local config path, a .gguf file or a Hub id (needs network), instead of --preset."""
    gguf_file: str = ""
    """With --model FOLDER or a Hub id: the GGUF checkpoint in it, as the fine-tuning command takes it."""
    effective_batch_tokens: int = 0
    """--autofit: tokens per optimizer step to keep (0 = micro_batch_size x gradient_accumulation_steps x seq_len)."""
    no_lora: bool = False
    """--autofit: never switch to LoRA/QLoRA."""
    min_micro_batch: int = 1
    """--autofit: smallest micro-batch of the first rung."""
    task: str = "gpt"
    """The command priced, whose flags the rest are: gpt, lora, dpo, flow, flow-distill or classifier (`hf-cgpu
    train TASK`), or sample (`hf-cgpu sample RUN`); a fine-tuning preset, --model or --config also mean lora."""
    card: str = ""
    """The GPU to price the run on by its public figures (e.g. "RTX 5070 Ti", "RTX 4090"; `hf-cgpu budget --card
    list` names them); empty = this machine's `hf-cgpu bench`, else an RTX 5070 Ti."""
    eval_micro_batches: int = 0
    """Micro-batches of one evaluation where --eval_batches is 0 (the whole validation split); with --dataset it is
    counted."""
    num_processes: int = 1
    """GPUs (one process each) the run is launched on: the ledger is per GPU, the micro-batch per process."""
    fsdp: bool = False
    """With --num_processes > 1: FSDP2 (recipes/accelerate/fsdp2.yaml, states sharded) instead of DDP (ddp.yaml)."""
    corpus_tokens: int = 0
    """With --preset auto (--auto): the training split's token count to choose the run for (a run prints it as
    "train N tokens"); the report shows the choice and prices the chosen run. 0 with --dataset: counted from it.
    With --teacher_top_k: the stream the teacher cache covers (its GPU memory and its one-off build)."""

    def __post_init__(self) -> None:
        if self.num_processes < 1:
            raise SettingsError(f"--num_processes must be >= 1, got {self.num_processes}")
        if self.card and self.card != "list":
            find_card(self.card)  # an unknown name: one line listing the known ones
        if self.config and self.model:
            raise SettingsError("give one of --preset, --config or --model")
        if self.corpus_tokens < 0:
            raise SettingsError(f"--corpus_tokens must be >= 0, got {self.corpus_tokens}")
        if self.gguf_file and not self.model:
            raise SettingsError("--gguf_file names a file inside --model FOLDER (or a Hub id): give --model too")


# ---------------------------------------------------------------------------------------------------- which model


def gpt_preset_names() -> list[str]:
    return list_presets("gpt")


def gpt_run_shape(preset: str, **overrides: Any) -> RunShape:
    """The run shape of a GPT preset: its ``GPTSettings`` (with ``overrides``) -> the ``CgptConfig`` training builds."""
    names = {f.name for f in dataclasses.fields(GPTSettings)}
    values = {k: v for k, v in load_preset(preset, "gpt").items() if k in names}
    return GPTSettings(**{**values, **overrides}).run_shape(name=preset)


def preset_shape(name: str) -> ModelShape:
    """A GPT preset (``hf_cgpu/presets/gpt/<name>.json``) through the config training builds, or a reference model."""
    if name in REFERENCE_CONFIGS:
        return ModelShape.reference(name)
    if name not in gpt_preset_names():
        raise SettingsError(f"unknown preset {name!r}: choose one of {', '.join(preset_names())} or pass --config PATH")
    return gpt_run_shape(name).model


def preset_names() -> list[str]:
    """GPT presets plus reference shapes, smallest first, then the fine-tuning presets."""
    shapes = sorted([*gpt_preset_names(), *REFERENCE_CONFIGS], key=lambda n: (preset_shape(n).n_params, n))
    return [*shapes, *finetune_preset_names()]


def resolve_model(spec: str, gguf_file: str = "") -> ModelShape:
    """A preset name, a GGUF checkpoint (a ``.gguf`` file, or a folder/Hub id with ``gguf_file``), a local config.json
    (or its directory), or a Hub id, in that order."""
    if gguf_file or Path(spec).suffix.lower() == ".gguf":
        return ModelShape.from_gguf(spec, gguf_file)
    if spec in REFERENCE_CONFIGS or spec in gpt_preset_names():
        return preset_shape(spec)
    p = Path(spec)
    if p.is_file() or (p.is_dir() and (p / "config.json").is_file()):
        return ModelShape.from_config_file(p)
    if p.is_dir():
        gguf_location(spec)  # a folder of GGUF files: names the --gguf_file to add
        raise MissingPathError(f"folder {spec!r} holds no config.json: pass a model's folder or its config.json")
    if p.suffix == ".json" or spec.startswith((".", "/")):
        raise MissingPathError(f"no config.json at {spec!r}: pass an existing file, a preset ({', '.join(preset_names())})")
    return ModelShape.from_hub(spec)


# ---------------------------------------------------------------------------------------------------- the command line


def _rewrite(argv: Sequence[str]) -> list[str]:
    """Old spellings: --accumulation & co., --tier recompute (= full + --recompute), --no_recompute."""
    out: list[str] = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        flag = ALIASES.get(flag, flag)
        if flag == "--no_recompute":
            out += ["--recompute", "false"]
        elif out and out[-1] == "--tier" and arg == "recompute":
            out += ["full", "--recompute", "true"]
        else:
            out.append(flag + eq + value)
    return out


GPT_SHAPE_FLAGS = frozenset(f"--{n}" for n in ("n_layer", "n_embd", "n_head", "mlp_ratio", "bias", "vocab_size",
                                                 "position_embedding", "qk_norm", "activation", "norm",
                                                 "tie_word_embeddings", "value_embeddings", "logit_softcap",
                                                 "unet_skips", "zero_init_head", "layer_loops"))
"""GPTSettings flags that shape our GPT only: another causal LM's shape is its config's."""


def finetune_preset_names() -> list[str]:
    return list_presets("finetune")


def describe_run(argv: Sequence[str] | None = None, task: str = ""):
    """Parse a training command line: (RunShape, TrainSettings, BudgetSettings). A GPT preset (the default: 124m)
    describes ``hf-cgpu train gpt``; a fine-tuning preset (lora, qlora), ``--model``, ``--config`` or a budget-only
    shape (pythia-1.4b) describe ``hf-cgpu train lora``, with its preset's settings (lora unless another is named);
    ``task`` dpo: ``hf-cgpu train dpo`` with its preset's."""
    return _describe(argv, task)[:3]


DPO_NOTE = ("DPO: a micro-batch of N pairs is 2N answers of --seq_len tokens, priced as N rows of 2 x --seq_len; the "
            "reference is one forward pass over every pair before the first step (no second copy of the base)")


def _describe(argv: Sequence[str] | None = None, task: str = ""):
    """``describe_run``'s three and the lines said on the way (--auto's choice, DPO's note)."""
    args = _rewrite(argv or [])
    preset = _preset_name(args)
    other = [a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in ("--config", "--model")]
    if preset and other and preset not in finetune_preset_names():  # a fine-tuning preset's settings on a --model
        raise SettingsError("give one of --preset, --config or --model")
    if preset in REFERENCE_CONFIGS:  # a shape known without a download, priced as its fine-tuning
        args = [*_without_preset(args), "--model", preset]
        preset, other = "", ["--model"]
    if task == "dpo":
        cfg, train, opts = parse_settings((DPOSettings, TrainSettings, BudgetSettings), args, family="dpo",
                                          description=DESCRIPTION, prog="hf-cgpu budget --task dpo",
                                          default_preset="lora", fixed={"train_mode": "finetune"})
        model = ModelShape.from_config_file(opts.config) if opts.config else resolve_model(cfg.model, cfg.gguf_file)
        return (RunShape(model, 2 * cfg.seq_len, cfg.loss_chunk_size, loss_in_forward=False, packed=cfg.packing),
                train, opts, [DPO_NOTE])
    if preset and preset not in preset_names() and not preset.endswith(".json"):
        raise SettingsError(f"unknown preset {preset!r}: choose one of {', '.join(preset_names())} or pass "
                            "--config PATH")
    if not (other or preset in finetune_preset_names()):
        gpt, train, opts = parse_settings((GPTSettings, TrainSettings, BudgetSettings), args, family="gpt",
                                          description=DESCRIPTION, prog="hf-cgpu budget", default_preset=DEFAULT_PRESET,
                                          epilog=budget_epilog(), fixed={"train_mode": "pretrain"})
        notes = []
        if gpt.auto:
            gpt, train, notes = auto_budget(gpt, train, opts)
        elif opts.corpus_tokens and not gpt.teacher_top_k:
            raise SettingsError("--corpus_tokens is what --preset auto chooses the run for (and the size of a "
                                "--teacher_top_k cache): add --preset auto or drop it")
        return gpt.run_shape(name=preset or DEFAULT_PRESET, stream_tokens=opts.corpus_tokens), train, opts, notes
    shape_flags = [a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in GPT_SHAPE_FLAGS]
    if shape_flags:
        raise SettingsError(f"{', '.join(shape_flags)} shape a from-scratch GPT (--preset); with --model or "
                            "--config the model's own config sets the shape: drop them")
    cfg, train, opts = parse_settings((FinetuneSettings, TrainSettings, BudgetSettings), args, family="finetune",
                                      description=DESCRIPTION, prog="hf-cgpu budget", default_preset="lora",
                                      epilog=budget_epilog(), fixed={"train_mode": "finetune"})
    if opts.config:
        model = ModelShape.from_config_file(opts.config)
    else:
        model = resolve_model(cfg.model, cfg.gguf_file)
    # another causal LM: trained as the fine-tuning task does, its loss through the backbone
    return (RunShape(model, cfg.seq_len, cfg.loss_chunk_size, loss_in_forward=False, packed=cfg.packing), train, opts,
            [])


def auto_budget(gpt: GPTSettings, train: TrainSettings, opts: BudgetSettings):
    """--preset auto without training: the choice for --corpus_tokens on this card (the peak the time ledger uses)."""
    from ..tasks.auto import given, resolve

    gpt.check_with(train)
    tokens, vocab, counted = opts.corpus_tokens, None, ""
    if not tokens and "dataset" in given(gpt):  # counted as the run will pack them; the run reuses the caches
        from ..tasks.causal_lm import train_split_tokens

        tokens, vocab = train_split_tokens(gpt, log=lambda line: print(line, file=sys.stderr))
        counted = (f"corpus: {gpt.dataset}'s training split is {tokens:,} tokens of a {vocab:,}-token vocabulary "
                   "(counted as the run makes them)")
    if not tokens:
        raise SettingsError("--preset auto chooses the run for a corpus: add --corpus_tokens N (the training split's "
                            "tokens, as a run prints them) or --dataset PATH (counted as the run makes them)")
    gpt, train, line = resolve(gpt, dataclasses.replace(train, resume_from_checkpoint=""), tokens,
                               budget_card(opts, train), Path("."), vocab_size=vocab,
                               processes=opts.num_processes, save=False)
    return gpt, train, [counted, line] if counted else [line]


def budget_epilog() -> str:
    """The fine-tuning presets and the budget-only shapes, beside the GPT presets ``--help`` lists."""
    lines = [f"  {n:<18}{preset_description(n, 'finetune')}" for n in finetune_preset_names()]
    lines += [f"  {n:<18}{REFERENCE_DESCRIPTIONS.get(n, '')}" for n in REFERENCE_CONFIGS]
    return ("fine-tuning presets and shapes known without a download (--preset NAME; or --model / --config with the "
            "lora preset's settings):\n" + "\n".join(lines))


def _without_preset(args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--preset":
            skip = True
        elif not arg.startswith("--preset="):
            out.append(arg)
    return out


def _preset_name(args: list[str]) -> str:
    for i, arg in enumerate(args):
        if arg.startswith("--preset="):
            return arg.split("=", 1)[1]
        if arg == "--preset" and i + 1 < len(args):
            return args[i + 1]
    return ""


# ---------------------------------------------------------------------------------------------------- formatting


def format_ledger(led: Ledger) -> str:
    """The aligned table: one row per kind of memory, the model-states subtotal, the totals, the verdict."""
    label_w = max(len(r.label) for r in led.rows) + 2
    lines = [f"  {'':<{label_w}}{'GiB':>8}   how"]
    for r in led.rows:
        lines.append(f"  {r.label:<{label_w}}{r.bytes / GiB:>8.2f}   {r.note}")
        if r.key == "master":
            lines.append(format_model_states(led, label_w))
    rule = f"  {'-' * (label_w + 8)}"
    lines.append(rule)
    phase = ("peak at the optimizer step: weights + all gradients + optimizer state"
             if led.peak_phase == "optimizer step" else f"peak at the {led.peak_phase}")
    lines.append(f"  {'= allocated':<{label_w}}{led.allocated / GiB:>8.2f}   {phase}; compare max_memory_allocated()")
    lines.append(f"  {'fragmentation':<{label_w}}{led.fragmentation / GiB:>8.2f}   "
                 f"reserved beyond the allocated peak ({led.fragmentation / led.allocated:.0%}): the allocator's "
                 "blocks that the peak's tensors cannot reuse")
    lines.append(f"  {'CUDA context':<{label_w}}{led.cuda_context / GiB:>8.2f}   outside the allocator")
    lines.append(f"  {'= total on the card':<{label_w}}{led.total / GiB:>8.2f}")
    if getattr(led, "host_pinned", 0.0):
        lines.append(f"  {'host memory':<{label_w}}{led.host_pinned / GiB:>8.2f}   pinned, not on the card: every "
                     "block's input (--recompute_policy offload)")
    if led.memory_cap is not None:
        spare = led.memory_cap - led.total
        verdict = f"FITS ({fmt_gib(spare)} spare)" if led.fits else f"DOES NOT FIT ({fmt_gib(-spare)} over)"
        lines.append(f"  verdict vs {fmt_gib(led.memory_cap)} cap: {verdict}")
    return "\n".join(lines)


def format_model_states(led: Ledger, label_w: int) -> str:
    """The model states: weights + all gradients + optimizer state (+ master), per parameter."""
    st = model_state_bytes(led.shape, led.setup)
    total = st.weights + st.gradients + st.optimizer + st.master
    per_param = total / led.shape.n_params
    sharded = led.setup.processes if led.setup.fsdp and led.setup.processes > 1 else 1
    where = f"; / {sharded} FSDP2 processes: {fmt_gib(total / sharded)} per GPU" if sharded > 1 else ""
    return (f"  {'= model states':<{label_w}}{total / GiB:>8.2f}   {per_param:.1f} B/param: weights + gradients + "
            f"optimizer state{where}")


def format_time(rt: RunTime, per_step: int, processes: int = 1, unit: str = "tokens", fitted: bool = True) -> str:
    """The time ledger: one row per kind of work in a step, the step, then the run's rows and its minutes."""
    step = rt.step
    label_w = max(len(r.label) for r in (*step.rows, *rt.rows)) + 2
    gpus = processes
    per_s = step.samples_per_second
    total = f"; {per_s * gpus:,.0f} in all on {gpus} GPUs" if gpus > 1 else ""
    lines = format_step(step, label_w, "s/step", "= step", f"{per_s:,.0f} {unit}/s per GPU{total}")
    lines += [f"  {r.label:<{label_w}}{r.seconds:>7.0f}s   {r.note}" for r in rt.rows]
    steps = f"{rt.steps:,} steps"
    if rt.limited_by_minutes:
        steps = (f"--max_minutes {rt.minutes:g} holds ~{rt.steps:,} of the {rt.max_steps:,} steps")
    elif rt.minutes > 0:
        steps += f", inside --max_minutes {rt.minutes:g}"
    lines.append(f"  this run         {steps} x {per_step * gpus:,} {unit} -> {fmt_duration(rt.seconds)}")
    if rt.limited_by_minutes and not fitted:
        lines.append("  the cosine is still high when the minutes end: add --fit_schedule_to_time true")
    return "\n".join(lines)


def format_step(step, label_w: int, column: str, total: str, rate: str) -> list[str]:
    """The card's line, one row per kind of work in ``step`` (a ``StepTime``), and its total."""
    card = step.card
    measure = "" if card.matmul_curve else "; run `hf-cgpu bench` on your card for its own figures"
    tflops = f"{card.matmul_tflops:,.0f}" if card.matmul_tflops >= 10 else f"{card.matmul_tflops:.2g}"
    kind = "fp32" if card.name == "CPU" else "bf16"
    lines = [f"time on {card.name} ({tflops} TFLOP/s {kind}, {card.bandwidth_gbs:,.0f} GB/s; "
             f"{card.source}{measure}):", f"  {'':<{label_w}}{column:>8}   how"]
    lines += [f"  {r.label:<{label_w}}{r.seconds:>8.3f}   {r.note}" for r in step.rows]
    lines.append(f"  {'-' * (label_w + 8)}")
    lines.append(f"  {total:<{label_w}}{step.seconds:>8.3f}   {step.bound}; {rate}, MFU {step.mfu:.2f}")
    return lines


def format_chinchilla(shape: ModelShape, setup: TrainSetup, step) -> str:
    """Compute-optimal tokens (20 per parameter) at this step's rate, in all GPUs' time."""
    tokens = chinchilla_tokens(shape.n_params)
    seconds = tokens / (step.samples_per_second * setup.processes)
    return f"  Chinchilla       {tokens / 1e9:.1f}B tokens (20/param) -> {fmt_duration(seconds)}"


def fmt_duration(seconds: float) -> str:
    """Seconds below two minutes, minutes below two hours, hours below two days, then days."""
    if seconds < 120:
        return f"{seconds:,.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:,.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 86400:,.1f} days"


# ---------------------------------------------------------------------------------------------------- the report


IMAGE_TASKS = ("flow", "flow-distill", "classifier")
"""``hf-cgpu train`` tasks the image ledger (``budget.images``) prices."""
TASKS = ("gpt", "lora", "dpo", *IMAGE_TASKS, "sample")
"""What ``--task`` names: a training command's task, or ``sample`` (``hf-cgpu sample MODEL_DIR``'s flags)."""


def split_task(argv: Sequence[str]) -> tuple[str, list[str]]:
    """(the task of ``--task NAME``, the other flags); no --task: gpt, or lora where the flags name a fine-tuning
    preset, a --model or a --config (``_describe`` tells them apart)."""
    args, task = list(argv), ""
    for i, arg in enumerate(args):
        if arg == "--task" and i + 1 < len(args):
            task = args[i + 1]
            del args[i:i + 2]
            break
        if arg.startswith("--task="):
            task = arg.split("=", 1)[1]
            del args[i]
            break
    if task and task not in TASKS:
        raise SettingsError(f"--task {task!r}: the ledger prices {', '.join(TASKS)} (the flags of hf-cgpu train "
                            "NAME, or of hf-cgpu sample)")
    if task == "lora" and not any(a.split("=", 1)[0] in ("--preset", "--model", "--config") for a in args):
        args = ["--preset", "lora", *args]
    return task or "gpt", args


def image_run(task: str, argv: Sequence[str]):
    """(the task's settings, TrainSettings, BudgetSettings, the image ledger's keyword arguments) of ``hf-cgpu budget
    --task TASK ARGV``: the flags of ``hf-cgpu train TASK``; flow-distill's teacher read from its folder."""
    from ..recipes import RECIPES

    recipe = RECIPES[task]
    cfg, train, opts = parse_settings((recipe.settings, TrainSettings, BudgetSettings), list(argv),
                                      family=recipe.presets or None, description=DESCRIPTION,
                                      prog=f"hf-cgpu budget --task {task}", default_preset=recipe.default_preset,
                                      fixed={"train_mode": getattr(recipe.settings, "train_mode", "pretrain")})
    return cfg, train, opts, teacher_extra(cfg)


def image_report(task: str, argv: Sequence[str]) -> str:
    from ..budget.images import image_ledger

    cfg, train, opts, extra = image_run(task, argv)
    cap = parse_memory(train.memory_cap or DEFAULT_MEMORY_CAP)
    led = image_ledger(task, cfg, train, cap, **extra)
    rt = image_run_time(task, cfg, train, budget_card(opts, train), extra)
    per_step = train.micro_batch_size * train.gradient_accumulation_steps
    out = [f"hf-cgpu budget: train {task}: {led.net.describe()}",
           f"  micro-batch {train.micro_batch_size} x accumulation {train.gradient_accumulation_steps} = {per_step} "
           f"images/step; {'compiled (' + train.compile_mode + ')' if train.compile else 'eager'}", "",
           format_ledger(led), "", format_time(rt, per_step, unit="images", fitted=train.fit_schedule_to_time)]
    return "\n".join(out)


def run(argv: Sequence[str] | None = None) -> str:
    """Parse ``argv`` (a training command line plus ``BudgetSettings``) and return the report text."""
    task, argv = split_task(argv or [])
    if task in IMAGE_TASKS:
        return image_report(task, argv)
    if task == "sample":
        return sample_report(argv)
    run_shape, train, opts, notes = _describe(argv, task)
    shape = run_shape.model
    positions = shape.positions_note(run_shape.seq_len)  # refused as training refuses it
    cap = parse_memory(train.memory_cap or DEFAULT_MEMORY_CAP)
    setup = run_shape.setup(train, processes=opts.num_processes, fsdp=opts.fsdp)  # a GPT preset: no adapter tier
    out = [f"hf-cgpu budget: {shape.describe()}", f"  {setup.describe()}", ""]
    family = "gpt" if run_shape.pretrain else "dpo" if task == "dpo" else "finetune"
    preset = _preset_name(_rewrite(argv or [])) or (DEFAULT_PRESET if run_shape.pretrain else "lora")
    described = [(f"preset {preset}", preset_description(preset, family)),
                 (f"shape {shape.name}", REFERENCE_DESCRIPTIONS.get(shape.name, ""))]
    out[1:1] = [f"  {what}: {text}" for what, text in described if text] + [f"  {n}" for n in notes]
    if positions:
        out.insert(len(out) - 1, f"  {positions}")
    if train.autofit:
        tokens = opts.effective_batch_tokens or None
        plan = autofit(
            shape, cap, seq_len=setup.seq_len, effective_batch_tokens=tokens,
            micro_batch_size=None if tokens else setup.micro_batch_size,
            gradient_accumulation_steps=setup.gradient_accumulation_steps, min_micro_batch=opts.min_micro_batch,
            rungs=[r for r in RUNGS if not ((opts.no_lora or run_shape.pretrain) and r in ("lora", "qlora"))],
            base=setup,
        )
        out.append("autofit (the memory ladder: micro-batch -> recompute -> sequence -> 8-bit AdamW -> LoRA -> QLoRA):")
        out += [f"  {i}. {r}" for i, r in enumerate(plan.reasons, 1)]
        out += ["", f"  plan: {plan.setup.describe()}", ""]
        setup, led = plan.setup, plan.ledger
    elif opts.card and find_card(opts.card) is CPU and setup.tier == "full":  # host memory: fp32 tensors
        led = dataclasses.replace(host_ledger(shape, setup), memory_cap=cap)
        out.append("host memory of a CPU run (fp32 tensors, no autocast copies; the process adds about 2 GiB):")
    else:
        led = ledger(shape, setup, cap)
    out.append(format_ledger(led))
    if setup.recompute and train.compile and train.compile_mode == "reduce-overhead":  # autofit never plans this
        out.append(f"  note: {GRAPHS_RECOMPUTE_NOTE}, so the card reserves more than this; add --compile_mode "
                   "default for the figure above")
    if not led.fits and not train.autofit:
        nxt = next_rung(shape, setup, cap)
        if nxt:
            label, nled = nxt
            verdict = "fits" if nled.fits else "still over"
            out.append(f"  next rung: {label}: {fmt_gib(nled.total)}, {verdict}; --autofit for a plan")
        else:
            out.append("  no rung left on the ladder: pick a smaller model")
    out.append("")
    card = budget_card(opts, train)
    rt = lm_run_time(shape, setup, train, card, opts.eval_micro_batches)
    out.append(format_time(rt, setup.tokens_per_step, setup.processes, fitted=train.fit_schedule_to_time))
    if task == "dpo":  # a forward is about a third of a training step's work
        pairs = setup.micro_batch_size * setup.gradient_accumulation_steps * setup.processes
        out.append(f"  reference pass: about {rt.step.seconds / pairs / 3 * 1000:,.0f} s per 1,000 training pairs, "
                   "once before the first step (and again on a resume)")
    if not setup.adapters:
        out.append(format_chinchilla(shape, setup, rt.step))
    return "\n".join(out)


def price_card(run_shape: RunShape, setup: TrainSetup, train, card: Card) -> dict[str, Any]:
    """The ledger's figures of one run on ``card``, as numbers: allocated / reserved / total GiB and whether the total
    fits the card's memory, step seconds and its rows, the steps the run does."""
    led = ledger(run_shape.model, setup, card.memory_gib * GiB if card.memory_gib else None)
    rt = lm_run_time(run_shape.model, setup, train, card)
    return {"allocated_gib": led.allocated / GiB, "reserved_gib": led.reserved / GiB, "total_gib": led.total / GiB,
            "fits": led.fits, "step_s": rt.step.seconds, "bound": rt.step.bound, "steps": rt.steps,
            "parts": "/".join(f"{r.seconds * 1e3:.1f}" for r in rt.step.rows)}


def price(task: str, argv: Sequence[str], card: Card) -> dict[str, Any]:
    """The ledger's figures for ``hf-cgpu train TASK ARGV`` on ``card``, as numbers (a benchmark puts them beside its
    measurements): allocated / reserved / total GiB, step seconds and its rows, steps the run does."""
    if task in IMAGE_TASKS:
        from ..budget.images import image_ledger

        cfg, train, opts, extra = image_run(task, argv)
        led = image_ledger(task, cfg, train, card.memory_gib * GiB if card.memory_gib else None, **extra)
        rt = image_run_time(task, cfg, train, card, extra)
        return {"allocated_gib": led.allocated / GiB, "reserved_gib": led.reserved / GiB,
                "total_gib": led.total / GiB, "fits": led.fits, "step_s": rt.step.seconds, "bound": rt.step.bound,
                "steps": rt.steps, "parts": "/".join(f"{r.seconds * 1e3:.1f}" for r in rt.step.rows)}
    run_shape, train, opts, _ = _describe(list(argv), task)
    return price_card(run_shape, run_shape.setup(train, processes=opts.num_processes, fsdp=opts.fsdp), train, card)


@dataclass(frozen=True)
class SamplePrice:
    """What the ledger asks besides ``hf-cgpu sample``'s flags."""

    card: str = ""
    """The GPU to price the sampling on by its public figures (as for a training run); empty = this machine's
    `hf-cgpu bench`, else an RTX 5070 Ti."""
    memory_cap: str = ""
    """The memory the job must fit (e.g. 16GB); empty = the card's memory, 16 GiB without --card."""

    def __post_init__(self) -> None:
        if self.card:
            find_card(self.card)
        if self.memory_cap:
            parse_memory(self.memory_cap)


def sample_job(argv: Sequence[str]):
    """(the ledger's keyword arguments for ``sample_memory`` / ``sample_work``, ``SamplePrice``) of ``hf-cgpu budget
    --task sample MODEL_DIR ARGV``: the steps, sampler, guidance and interval ``hf-cgpu sample`` would use, the
    folder's saved defaults where a flag leaves them open."""
    from ..budget.images import read_pipeline
    from ..flow.sample_settings import SampleSettings
    from ..settings import build_parser

    parser = build_parser((SampleSettings, SamplePrice), prog="hf-cgpu budget --task sample", description=DESCRIPTION)
    parser.add_argument("model_dir", help="a saved FlowMatchPipeline folder, as hf-cgpu sample takes it")
    ns = vars(parser.parse_args(list(argv)))
    folder = ns.pop("model_dir")
    given = {k: v for k, v in ns.items() if v is not None}
    names = {f.name for f in dataclasses.fields(SamplePrice)}
    price = SamplePrice(**{k: v for k, v in given.items() if k in names})
    s = SampleSettings(**{k: v for k, v in given.items() if k not in names})
    info = read_pipeline(folder)
    s.check_guided(bool(info.unet.get("guidance_embedding")))
    guide = info.guide if s.guidance_model == "" else s.guidance_model != "none"
    conditional = bool(info.unet.get("num_classes"))
    saved = {"num_inference_steps": info.steps, "guidance_scale": info.guidance_scale,
             "guidance_interval": info.guidance_interval}
    kw = s.sampling_of(saved, conditional, guide)
    sampler = s.scheduler or info.sampler
    if not sampler:
        raise SettingsError(f"{folder} saved a scheduler that is not one of hf_cgpu's samplers: pass --scheduler "
                            "heun or euler to price it")
    job = {"unet": info.unet, "num_images": s.num_images, "steps": kw["num_inference_steps"], "sampler": sampler,
           "guidance_scale": kw["guidance_scale"], "guidance_interval": kw["guidance_interval"],
           "guide": guide and kw["guidance_scale"] != 1.0}
    return job, price


def sample_report(argv: Sequence[str]) -> str:
    """``hf-cgpu budget --task sample MODEL_DIR ...``: the memory and seconds of that ``hf-cgpu sample`` call (fp32,
    every image in one batch)."""
    from ..budget.images import sample_memory, sample_work

    job, price = sample_job(argv)
    card = resolve_card(price.card)
    cap = parse_memory(price.memory_cap) if price.memory_cap else (card.memory_gib * GiB if card.memory_gib else
                                                                     parse_memory(DEFAULT_MEMORY_CAP))
    led = sample_memory(**job, memory_cap=cap)
    step = step_time(sample_work(**job), card)
    work = step.work
    out = [f"hf-cgpu budget: sample {job['num_images']:,} images: {led.net.describe()}",
           f"  {work.notes['calls']}", "", format_ledger(led), ""]
    label_w = max(len(r.label) for r in step.rows) + 2
    out += format_step(step, label_w, "seconds", "= sampling",
                       f"{step.samples_per_second:,.1f} images/s (model loading not counted)")
    return "\n".join(out)


def budget_card(opts: BudgetSettings, train) -> Card:
    """--card, else the run's --emulate_card, else this machine's bench, else the 16 GB card hf_cgpu is made for;
    --peak_tflops replaces the matmul rate."""
    return with_peak(resolve_card(opts.card or getattr(train, "emulate_card", "")), train.peak_tflops)


def main(argv: Sequence[str] | None = None) -> int:
    """``hf-cgpu budget``: print the ledger (bad input: a ``UserError``, one line and exit 2 via ``run_main``)."""
    print(run(argv))
    return 0

