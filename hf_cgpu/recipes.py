"""The recipe registry: one row per model family, the only place a task is listed. ``hf-cgpu train NAME``,
``hf-cgpu flow2d`` and the scripts in ``recipes/`` all parse and run through it.

A row names the task's settings dataclass (its fields are the flags and the ``--help``), the Task class that plugs
the model into the one loop (``hf_cgpu.train.fit``), and the preset folder; the Task names its model card
(``hf_cgpu.hub.cards.CARDS``). One runner serves every row. ``docs/extending.md`` walks through adding one.

Launching: without ``--config_file`` (and with one process) the run trains in this process, so a bad input ends
in one line and exit code 2 as every other command. With an accelerate config file or ``--num_processes N`` the
command starts accelerate's launcher itself (``accelerate launch ... -m hf_cgpu.cli train NAME ...``), catches the
launcher's report of a failed child and returns the child's exit code: the child's one-line error is not followed
by the launcher's ``CalledProcessError`` traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from .errors import SettingsError, about
from .registry import Registry
from .settings import TrainSettings, parse_settings
from .tasks.settings import (ClassifierSettings, DPOSettings, FinetuneSettings, FlowDistillSettings, FlowSettings,
                             GPTSettings, Toy2DSettings)


@dataclass(frozen=True)
class LaunchSettings:
    """How the run is started; any other launch option: accelerate launch with the recipe script."""

    config_file: str = ""
    """An accelerate config file (e.g. recipes/accelerate/ddp.yaml): accelerate's launcher starts the run with it;
    empty = train in this process on the first GPU (or the CPU)."""
    num_processes: int = 1
    """Processes to launch (one per GPU); above 1 accelerate starts them (data parallel)."""
    cpu: bool = False
    """Train on the CPU even where a GPU is visible (accelerate launch --cpu)."""

    def __post_init__(self) -> None:
        if self.num_processes < 1:
            raise SettingsError(f"num_processes must be >= 1 (got {self.num_processes})")
        if self.config_file and not os.path.isfile(self.config_file):
            raise SettingsError(f"accelerate config {self.config_file!r} not found; pass an existing file, e.g. "
                                "accelerate_config.yaml")

    @property
    def launched(self) -> bool:
        return bool(self.config_file) or self.num_processes > 1


@dataclass(frozen=True)
class Recipe:
    """One model family as a training command."""

    name: str
    """``hf-cgpu train NAME``."""
    summary: str
    """One line for ``hf-cgpu train --help`` and the command's description."""
    settings: type
    """The task's settings dataclass (parsed before TrainSettings); torch-free, so ``--help`` stays quick."""
    task: type | str
    """The ``hf_cgpu.train.Task`` subclass, or the ``"module:Class"`` that holds it (imported when a run starts)."""
    presets: str = ""
    """Folder of presets under hf_cgpu/presets (empty: none)."""
    default_preset: str | None = None
    """Preset used when the command line names none."""
    script: str = ""
    """The script under recipes/ that runs this row, if any."""
    example: str = ""
    """One command line that runs this row, shown under the description in ``--help``."""

    def task_class(self) -> type:
        if isinstance(self.task, type):
            return self.task
        module, _, name = self.task.partition(":")
        return getattr(importlib.import_module(module), name)

    def description(self) -> str:
        where = f" (recipes/{self.script})" if self.script else ""
        what = f"{self.summary[0].upper()}{self.summary[1:]}{where}."
        return about(what, self.example) if self.example else what


RECIPES: Registry[Recipe] = Registry("recipe")
"""Every training command by name, in registration order."""


for _recipe in (
    Recipe("gpt", "pretrain the hf_cgpu GPT from scratch: tokenizer, packing, the one loop, continuations",
           GPTSettings, "hf_cgpu.tasks.causal_lm:CausalLMTask", presets="gpt", script="train_gpt.py",
           example="hf-cgpu train gpt --preset tiny --output_dir runs/tiny"),
    Recipe("flow", "train a flow-matching UNet on CIFAR-10-style images; saves a FlowMatchPipeline", FlowSettings,
           "hf_cgpu.tasks.flow_images:FlowMatchingTask", presets="flow", script="train_flow.py",
           example="hf-cgpu train flow --preset cifar10 --dataset ../shared/data/cifar10 --output_dir runs/flow"),
    Recipe("flow-distill", "distill a trained flow pipeline into a 1-2 step one (shortcut model, guidance baked in)",
           FlowDistillSettings, "hf_cgpu.tasks.flow_distill:FlowDistillTask", presets="flow-distill",
           script="train_flow_distill.py",
           example="hf-cgpu train flow-distill --preset cifar10 --teacher runs/flow --dataset ../shared/data/cifar10 "
                   "--output_dir runs/flow-1step"),
    Recipe("lora", "LoRA / QLoRA (or full) fine-tuning of an open causal LM", FinetuneSettings,
           "hf_cgpu.tasks.finetune_lm:FinetuneTask", presets="finetune", default_preset="lora",
           script="finetune_lora.py",
           example="hf-cgpu train lora --model EleutherAI/pythia-1.4b --dataset examples/instructions.jsonl "
                   "--output_dir runs/pythia-lora"),
    Recipe("dpo", "DPO preference tuning that continues an SFT LoRA adapter, the adapter as it was the reference",
           DPOSettings, "hf_cgpu.tasks.dpo:DPOTask", presets="dpo", default_preset="lora", script="train_dpo.py",
           example="hf-cgpu train dpo --model EleutherAI/pythia-1.4b --adapter runs/pythia-lora "
                   "--dataset prefs.jsonl --output_dir runs/pythia-dpo"),
    Recipe("classifier", "train the CIFAR-10 classifier whose features `hf-cgpu eval` scores images with",
           ClassifierSettings, "hf_cgpu.tasks.classifier:ClassifierTask", presets="classifier",
           script="train_classifier.py",
           example="hf-cgpu train classifier --preset cifar10 --dataset ../shared/data/cifar10 "
                   "--output_dir runs/classifier"),
    Recipe("flow2d", "the 2D flow-matching toy on CPU: a table and a scatter plot", Toy2DSettings,
           "hf_cgpu.tasks.flow_toy2d:Toy2DTask", presets="flow2d", default_preset="toy", script="flow2d.py",
           example="hf-cgpu flow2d --output_dir runs/toy2d"),
):
    RECIPES.add(_recipe.name, _recipe)


def run(recipe: Recipe, cfg: Any, train: Any) -> dict[str, Any]:
    """Train ``recipe``'s task with its settings ``cfg`` and ``train`` through the one loop; the main process prints
    the final figures. Returns what all_results.json holds."""
    from .train import fit  # the command-line boundary: torch and accelerate load only when a run starts
    from .train.parallel import is_main_process

    results = fit(recipe.task_class()(cfg), train)
    if is_main_process():  # one copy of the figures, not one per process
        print(json.dumps({k: v for k, v in results.items() if k != "settings"}, indent=2, ensure_ascii=False))
    return results


# ---------------------------------------------------------------------------------------------------- commands
def parse(recipe: Recipe, argv: Sequence[str] | None = None, prog: str | None = None, launch: bool = False) -> tuple:
    """(task settings, TrainSettings[, LaunchSettings]) from ``argv``: command line > preset > defaults; the tier is
    checked against the task's train mode here, once."""
    classes = (recipe.settings, TrainSettings, *((LaunchSettings,) if launch else ()))
    parsed = parse_settings(classes, None if argv is None else list(argv), family=recipe.presets or None,
                            description=recipe.description(), prog=prog, default_preset=recipe.default_preset,
                            fixed={"train_mode": getattr(recipe.settings, "train_mode", "pretrain")})
    if hasattr(parsed[0], "check_with"):  # the task's settings against the loop's, before anything starts
        parsed[0].check_with(parsed[1])
    return parsed


def run_recipe(recipe: Recipe, argv: Sequence[str], prog: str) -> int:
    argv = list(argv)
    cfg, train, launch = parse(recipe, argv, prog, launch=True)  # bad flags end here, before anything starts
    if launch.launched:
        return _launch(recipe, argv, launch)
    if launch.cpu:
        os.environ["ACCELERATE_USE_CPU"] = "true"  # what accelerate launch --cpu sets
    run(recipe, cfg, train)
    return 0


def _launch_argv(argv: list[str]) -> list[str]:
    """``argv`` without the LaunchSettings flags (the launched processes must not launch again)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for f in fields(LaunchSettings):
        p.add_argument(f"--{f.name}", nargs="?" if f.type in (bool, "bool") else None)
    _, rest = p.parse_known_args(argv)
    return rest


def _launch(recipe: Recipe, argv: list[str], launch: LaunchSettings) -> int:
    """Start the run with accelerate's launcher (in this process) and return the exit code of the failed child."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    cmd = []
    if launch.config_file:
        cmd += ["--config_file", launch.config_file]
    if launch.num_processes > 1 or not launch.config_file:
        cmd += ["--num_processes", str(launch.num_processes)]
    if launch.num_processes > 1 and not launch.config_file:
        cmd += ["--multi_gpu"]  # torchrun's launcher (accelerate picks it by itself only where it sees 2+ GPUs)
    if launch.cpu and launch.num_processes > 1:
        os.environ["ACCELERATE_USE_CPU"] = "true"  # CPU processes over gloo (--cpu would start one process)
    elif launch.cpu:
        cmd += ["--cpu"]
    cmd += ["-m", "hf_cgpu.cli", "train", recipe.name, *_launch_argv(argv)]
    args = launch_command_parser().parse_args(cmd)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as e:  # one process: the child printed its own error already
        return e.returncode
    except Exception as e:  # torch.distributed.run's ChildFailedError: the first failed rank's code
        failures = getattr(e, "failures", None)
        if not failures:
            raise
        return next(iter(failures.values())).exitcode or 1
    return 0


def train_main(argv: Sequence[str] | None = None) -> int:
    """``hf-cgpu train NAME ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        lines = [f"  {r.name:<11} {r.summary}" + (f" (recipes/{r.script})" if r.script else "")
                 for r in RECIPES.values()]
        print("usage: hf-cgpu train NAME [--preset P] [--FLAG VALUE ...]\n\n"
              + about("Train a model of one of the families below with the one training loop.",
                      RECIPES["gpt"].example, more="models:\n" + "\n".join(lines))
              + "\n\n`hf-cgpu train NAME --help` lists every setting with its docs and default.")
        return 0
    name = argv[0]
    if name not in RECIPES:
        raise SettingsError(f"unknown model {name!r} for hf-cgpu train; choose one of {', '.join(RECIPES)}")
    return run_recipe(RECIPES[name], argv[1:], prog=f"hf-cgpu train {name}")


def flow2d_main(argv: Sequence[str] | None = None) -> int:
    """``hf-cgpu flow2d ...``: ``hf-cgpu train flow2d``."""
    return run_recipe(RECIPES["flow2d"], list(sys.argv[1:] if argv is None else argv), prog="hf-cgpu flow2d")


__all__ = ["LaunchSettings", "RECIPES", "Recipe", "flow2d_main", "parse", "run", "run_recipe", "train_main"]
