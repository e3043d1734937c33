"""``hf-cgpu train gpt|flow|lora|classifier`` and ``hf-cgpu flow2d``: the recipes of ``recipes/`` as commands.

Each entry of ``RECIPES`` names what its recipe script names: the task's settings dataclass, the preset family,
the default preset and the function that trains. ``hf-cgpu train gpt --preset tiny`` parses the same flags with
the same presets and the same ``--help`` as ``recipes/train_gpt.py --preset tiny`` and trains the same way;
the recipes stay the short readable versions (a test compares their ``--help``).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from .errors import SettingsError


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
    """One training command: what its ``recipes/`` script parses and runs."""

    name: str
    script: str
    """The recipe file under recipes/ that does the same."""
    summary: str
    family: str
    """Preset folder under hf_cgpu/presets."""
    settings: str
    """``module:Class`` of the task's settings dataclass (parsed before TrainSettings)."""
    run: str
    """``module:function`` taking (task settings, TrainSettings) and returning the results."""
    default_preset: str | None = None

    def settings_class(self) -> type:
        module, name = self.settings.split(":")
        return getattr(importlib.import_module(module), name)

    def runner(self) -> Callable[[Any, Any], dict[str, Any]]:
        module, name = self.run.split(":")
        return getattr(importlib.import_module(module), name)

    def description(self) -> str:
        return f"{self.summary[0].upper()}{self.summary[1:]} (the settings of recipes/{self.script})."


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("gpt", "train_gpt.py", "pretrain the hf_cgpu GPT from scratch: tokenizer, packing, the one loop, "
           "continuations", "gpt", "hf_cgpu.tasks.settings:GPTSettings", "hf_cgpu.recipes:train_gpt"),
    Recipe("flow", "train_flow.py", "train a flow-matching UNet on CIFAR-10-style images; saves a FlowMatchPipeline",
           "flow", "hf_cgpu.tasks.settings:FlowSettings", "hf_cgpu.recipes:train_flow"),
    Recipe("lora", "finetune_lora.py", "LoRA / QLoRA (or full) fine-tuning of an open causal LM", "finetune",
           "hf_cgpu.tasks.settings:FinetuneSettings", "hf_cgpu.recipes:finetune", default_preset="lora"),
    Recipe("classifier", "train_classifier.py", "train the CIFAR-10 classifier whose features `hf-cgpu eval` scores "
           "images with", "classifier", "hf_cgpu.tasks.settings:ClassifierSettings", "hf_cgpu.recipes:train_classifier"),
)}
FLOW2D = Recipe("flow2d", "flow2d.py", "the 2D flow-matching toy on CPU: a table and a scatter plot", "flow2d",
                "hf_cgpu.tasks.settings:Toy2DSettings", "hf_cgpu.recipes:flow2d", default_preset="toy")


# ---------------------------------------------------------------------------------------------------- runners
def train_gpt(cfg, train) -> dict[str, Any]:
    from .tasks.causal_lm import CausalLMTask
    from .train import fit

    return fit(CausalLMTask(cfg), train)


def train_flow(cfg, train) -> dict[str, Any]:
    from .tasks.flow_images import FlowMatchingTask
    from .train import fit

    return fit(FlowMatchingTask(cfg), train)


def finetune(cfg, train) -> dict[str, Any]:
    from .tasks.finetune_lm import FinetuneTask
    from .train import fit

    return fit(FinetuneTask(cfg), train)


def train_classifier(cfg, train) -> dict[str, Any]:
    from .tasks.classifier import ClassifierTask
    from .train import fit

    return fit(ClassifierTask(cfg), train)


def flow2d(cfg, train) -> dict[str, Any]:
    from .tasks.flow_toy2d import run_flow2d

    results = run_flow2d(cfg, train)
    print(f"train {results['train_seconds']:.1f}s; best within 0.3 at <= 20 NFE: "
          f"{results['best_within_at_20_nfe_or_less']:.1%}; wrote {train.output_dir}/all_results.json")
    return results


# ---------------------------------------------------------------------------------------------------- commands
def parse(recipe: Recipe, argv: Sequence[str], prog: str, launch: bool = True) -> tuple:
    """(task settings, TrainSettings[, LaunchSettings]) from ``argv``, as the recipe script parses them."""
    from .settings import TrainSettings, parse_settings

    classes = (recipe.settings_class(), TrainSettings, *((LaunchSettings,) if launch else ()))
    return parse_settings(classes, list(argv), family=recipe.family, description=recipe.description(), prog=prog,
                          default_preset=recipe.default_preset)


def run_recipe(recipe: Recipe, argv: Sequence[str], prog: str) -> int:
    argv = list(argv)
    cfg, train, launch = parse(recipe, argv, prog)  # bad flags end here, before anything starts
    if launch.launched:
        return _launch(recipe, argv, launch)
    if launch.cpu:
        os.environ["ACCELERATE_USE_CPU"] = "true"  # what accelerate launch --cpu sets
    results = recipe.runner()(cfg, train)
    from .train.parallel import is_main_process

    if is_main_process():  # one copy of the figures, not one per process
        print(json.dumps(results, indent=2, ensure_ascii=False))
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
    command = ["train", recipe.name] if recipe.name in RECIPES else [recipe.name]
    cmd += ["-m", "hf_cgpu.cli", *command, *_launch_argv(argv)]
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
        lines = [f"  {r.name:<11} {r.summary} (recipes/{r.script})" for r in RECIPES.values()]
        print("usage: hf-cgpu train NAME [--preset P] [--FLAG VALUE ...]\n\ntrain a model with the one loop:\n"
              + "\n".join(lines) + "\n\n`hf-cgpu train NAME --help` lists every setting with its docs and default.")
        return 0
    name = argv[0]
    if name not in RECIPES:
        raise SettingsError(f"unknown model {name!r} for hf-cgpu train; choose one of {', '.join(RECIPES)}")
    return run_recipe(RECIPES[name], argv[1:], prog=f"hf-cgpu train {name}")


def flow2d_main(argv: Sequence[str] | None = None) -> int:
    """``hf-cgpu flow2d ...``."""
    return run_recipe(FLOW2D, list(sys.argv[1:] if argv is None else argv), prog="hf-cgpu flow2d")


main = train_main

__all__ = ["FLOW2D", "LaunchSettings", "RECIPES", "Recipe", "flow2d_main", "parse", "run_recipe", "train_main"]
