"""Extension points, used as docs/extending.md shows them: a toy optimizer and a toy task (with its own model card)
registered from this file, and a sampler added as a maintainer adds one (a new file in hf_cgpu/flow/, one registry
line); each found where a user meets it: in ``--help``, in ``hf-cgpu budget``, in a short training run, in the model
card and, for the sampler, in a saved pipeline that loads without hf_cgpu."""

from __future__ import annotations

import ast
import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from sampler_checks import (check_evaluation_count, check_grid_and_calls, check_order, check_saved_pipeline,
                            check_scheduler_round_trip, remote_samples)

from hf_cgpu.cli import main as cli_main
from hf_cgpu.flow.samplers import SAMPLERS, evaluations_per_image, steps_within
from hf_cgpu.hub.cards import CARDS, CardSpec, read_config
from hf_cgpu.optim import OPTIMIZERS, OptimizerSpec
from hf_cgpu.recipes import RECIPES, Recipe
from hf_cgpu.settings import FIXED
from hf_cgpu.train import Task, TaskPlan


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------------------------------------------- an optimizer
@dataclass(frozen=True)
class ToySGDSettings:
    """Toy SGD's own settings."""

    sgd_momentum: float = 0.9
    """Heavy-ball momentum of the toy SGD."""


BUILT: list[torch.optim.Optimizer] = []


def build_toysgd(model, named, settings, fused):
    opt = torch.optim.SGD([p for _, p in named], lr=settings.learning_rate,
                          momentum=settings.optimizer_options.sgd_momentum)
    BUILT.append(opt)
    return opt


def toysgd_state_bytes(tensors, tier):
    return 4 * sum(n for n, _ in tensors), "toy SGD momentum fp32: 4 B/param"


@pytest.fixture
def toysgd():
    OPTIMIZERS.add("toysgd", OptimizerSpec("toysgd", "a toy SGD with momentum", build=build_toysgd,
                                           state_bytes=toysgd_state_bytes, settings=ToySGDSettings))
    BUILT.clear()
    yield
    OPTIMIZERS.remove("toysgd")


def test_a_toy_optimizer_registered_from_a_test_file(toysgd, tmp_path, capsys):
    text = _help(["train", "gpt", "--help"], capsys)
    assert "toysgd: a toy SGD with momentum" in text and "--sgd_momentum FLOAT Heavy-ball momentum" in text
    assert "ToySGDSettings: Toy SGD's own settings. (only with --optimizer toysgd)" in text

    assert cli_main(["budget", "--preset", "tiny", "--optimizer", "toysgd"]) == 0
    budget = capsys.readouterr().out
    row = next(line for line in budget.splitlines() if "optimizer state" in line)
    assert "toy SGD momentum fp32: 4 B/param" in row
    from hf_cgpu.commands.budget import preset_shape

    n = preset_shape("tiny").n_params
    assert f"{4 * n / 2**30:.2f}" == row.split()[2]  # 4 bytes per parameter, as the spec counts

    out = tmp_path / "run"
    assert cli_main(["train", "gpt", "--preset", "tiny", "--max_steps", "3", "--eval_steps", "0",
                     "--checkpointing_steps", "0", "--progress", "false", "--output_dir", str(out),
                     "--optimizer", "toysgd", "--sgd_momentum", "0.5", "--prompts", "a", "--max_new_tokens", "2"]) == 0
    assert len(BUILT) == 1 and BUILT[0].param_groups[0]["momentum"] == 0.5
    assert any(s.get("momentum_buffer") is not None for s in BUILT[0].state.values())  # it really stepped
    settings = json.loads((out / "all_results.json").read_text())["settings"]
    assert (settings["optimizer"], settings["sgd_momentum"]) == ("toysgd", 0.5)
    card = (out / "README.md").read_text()
    assert "| `optimizer` | toysgd |" in card and "| `sgd_momentum` | 0.5 |" in card


def test_a_toy_optimizers_settings_are_refused_without_it(toysgd, capsys):
    assert cli_main(["budget", "--preset", "tiny", "--sgd_momentum", "0.5"]) == 2
    assert "--sgd_momentum is a setting of --optimizer toysgd" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- a sampler
MIDPOINT = '''"""The explicit midpoint method: two model calls a step, second order."""

from __future__ import annotations

import torch

from .scheduling_flow_match import FlowMatchScheduler


class FlowMatchMidpointScheduler(FlowMatchScheduler):
    """x_{k+1} = x_k + h v(x_k + h/2 v(x_k, t_k), t_k + h/2): 2N model calls for N steps."""

    order = 2

    def set_timesteps(self, num_inference_steps, device=None):
        grid = self._make_grid(num_inference_steps, device)
        self.timesteps = torch.stack([grid[:-1], (grid[:-1] + grid[1:]) / 2], 1).flatten()  # t_k, t_k + h/2

    def _call_interval(self):
        return torch.arange(len(self.timesteps), device=self.t_grid.device) // 2

    def step(self, model_output, timestep, sample, return_dict=True):
        if self._step_index is None:
            self._init_step_index(timestep)
        k = self._step_index
        dt = self.t_grid[k // 2 + 1] - self.t_grid[k // 2]
        if k % 2 == 0:
            self._x = sample.float()
            prev = self._x + dt / 2 * model_output.float()
        else:
            prev = self._x + dt * model_output.float()
        self._step_index = k + 1
        return self._output(prev.to(model_output.dtype), return_dict)
'''


@pytest.fixture
def new_file(tmp_path_factory, monkeypatch):
    """``new_file(name, text)`` adds hf_cgpu/flow/NAME.py as a maintainer does (here in a folder put on
    hf_cgpu.flow's path, so the package stays as it is); the modules go again after the test."""
    import hf_cgpu.flow

    folder = tmp_path_factory.mktemp("hf_cgpu_flow")
    monkeypatch.setattr(hf_cgpu.flow, "__path__", [*hf_cgpu.flow.__path__, str(folder)])
    names = []

    def add(name: str, text: str) -> None:
        (folder / f"{name}.py").write_text(text)
        names.append(f"hf_cgpu.flow.{name}")

    yield add
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def midpoint(new_file):
    """A sampler added as docs/extending.md says: one new file that subclasses hf_cgpu's base, one registry line."""
    new_file("scheduling_midpoint", MIDPOINT)
    SAMPLERS.add("midpoint", "hf_cgpu.flow.scheduling_midpoint:FlowMatchMidpointScheduler")  # the line in samplers.py
    yield
    SAMPLERS.remove("midpoint")


@pytest.mark.slow
def test_a_sampler_in_a_new_file_gets_every_samplers_checks(midpoint, tmp_path):
    check_grid_and_calls("midpoint")
    check_order("midpoint")
    check_evaluation_count("midpoint")
    check_scheduler_round_trip("midpoint", tmp_path / "scheduler")
    check_saved_pipeline("midpoint", tmp_path / "saved")  # saved with hf_cgpu, loaded with its classes
    remote_samples([tmp_path / "saved"])  # and in a fresh interpreter without hf_cgpu: the same images


def test_a_sampler_in_a_new_file_is_found_everywhere(midpoint, synthetic_data, tmp_path, capsys):
    assert evaluations_per_image("midpoint", 3) == 6 and evaluations_per_image("midpoint", 3, 2.0) == 12
    assert steps_within(10, "midpoint") == 5  # counted from the class, not from its name
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text("{}")  # hf-cgpu eval of a pipeline folder: the image evaluation
    for argv in (["sample", "--help"], ["eval", str(pipeline), "--help"], ["train", "flow", "--help"]):
        assert "Choices: euler, heun, midpoint." in _help(argv, capsys), argv

    out = tmp_path / "flow"
    assert cli_main(["train", "flow", "--preset", "tiny", "--dataset", str(synthetic_data), "--limit", "64",
                     "--max_steps", "2", "--checkpointing_steps", "0", "--progress", "false",
                     "--sampler", "midpoint", "--sample_steps", "2", "--output_dir", str(out)]) == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["scheduler"] == ["hf_cgpu.flow.scheduling_midpoint", "FlowMatchMidpointScheduler"]
    assert list((out / "samples").glob("step_*.png"))  # the run's sample grid was drawn with it
    assert "| `sampler` | midpoint |" in (out / "README.md").read_text()
    # the saved folder samples through hf-cgpu with the sampler it was saved with, and saves again
    assert cli_main(["sample", str(out), "--num_images", "2", "--class_labels", "c0,c1", "--output_dir",
                     str(tmp_path / "drawn"), "--save_pipeline", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "model_index.json").read_text())
    assert again["scheduler"] == index["scheduler"]


RENAMED = '''"""A sampler file that imports a re-exported class under another name, a type only for checkers, and a name
inside a method: the save carries what runs and nothing else."""

from typing import TYPE_CHECKING

from hf_cgpu.flow import FlowMatchEulerScheduler as Euler

if TYPE_CHECKING:
    from ..train import Task


class RenamedEuler(Euler):
    def step(self, model_output, timestep, sample, return_dict=True):
        from .scheduling_flow_match import FlowMatchSchedulerOutput

        return FlowMatchSchedulerOutput(super().step(model_output, timestep, sample).prev_sample)
'''


def test_the_save_carries_the_modules_a_file_imports_and_nothing_else(new_file):
    from hf_cgpu.flow.carry import carried_source
    from hf_cgpu.flow.unet import FlowUNet2DModel

    new_file("scheduling_renamed", RENAMED)
    text = carried_source(importlib.import_module("hf_cgpu.flow.scheduling_renamed").RenamedEuler, {"hf_cgpu"})
    imports = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [ast.unparse(n) for n in imports if getattr(n, "level", 0) or "hf_cgpu" in ast.unparse(n)]
    carried = [line[len("# ---- "):] for line in text.splitlines() if line.startswith("# ---- ")]
    assert carried == ["hf_cgpu.flow.scheduling_flow_match", "hf_cgpu.flow.scheduling_renamed"]  # where it is defined
    namespace = {"__name__": "carried"}
    exec(compile(text, "carried", "exec"), namespace)
    assert namespace["Euler"] is namespace["FlowMatchEulerScheduler"]
    sched = namespace["RenamedEuler"]()
    sched.set_timesteps(2)
    out = sched.step(torch.ones(1), sched.timesteps[0], torch.zeros(1))
    assert type(out).__name__ == "FlowMatchSchedulerOutput" and float(out.prev_sample) == 0.5
    unet = importlib.import_module(FlowUNet2DModel.__module__)
    assert carried_source(FlowUNet2DModel, {"hf_cgpu"}) == Path(unet.__file__).read_text()  # imports none of ours

    new_file("scheduling_clash", "from .scheduling_flow_match import FlowMatchEulerScheduler\n\n\n"
                                 "def time_grid():\n    return None\n\n\n"
                                 "class Clash(FlowMatchEulerScheduler):\n    pass\n")
    with pytest.raises(ValueError, match="scheduling_flow_match and hf_cgpu.flow.scheduling_clash both define "
                                         "'time_grid'"):
        carried_source(importlib.import_module("hf_cgpu.flow.scheduling_clash").Clash, {"hf_cgpu"})


def test_the_registry_refuses_a_sampler_it_cannot_use_or_save_in_one_line(new_file, capsys):
    new_file("scheduling_whole_module", MIDPOINT.replace(
        "from .scheduling_flow_match import FlowMatchScheduler",
        "import hf_cgpu.flow.scheduling_flow_match as base\n\nFlowMatchScheduler = base.FlowMatchScheduler"))
    SAMPLERS.add("whole-module", "hf_cgpu.flow.scheduling_whole_module:FlowMatchMidpointScheduler")
    SAMPLERS.add("not-ours", "diffusers:FlowMatchEulerDiscreteScheduler")
    try:
        for name, said in (("whole-module", "could not carry its code: hf_cgpu.flow.scheduling_whole_module line 7: "
                                            "`import hf_cgpu.flow.scheduling_flow_match` binds a module"),
                           ("not-ours", "not a scheduler in hf_cgpu's time convention; subclass "
                                        "hf_cgpu.flow.scheduling_flow_match.FlowMatchScheduler")):
            assert cli_main(["sample", "no-such-run", "--scheduler", name]) == 2
            err = capsys.readouterr().err
            assert said in err and len(err.strip().splitlines()) == 1, err
    finally:
        SAMPLERS.remove("whole-module")
        SAMPLERS.remove("not-ours")


# ---------------------------------------------------------------------------------------------------- a task
@dataclass(frozen=True)
class ToyRegressionSettings:
    """A linear regression to learn."""

    width: int = field(default=4, metadata=FIXED)
    """Inputs of the regression (its shape: a resume must keep it)."""


class ToyRegressionTask(Task):
    unit = "sample"
    card = "toy-regression"

    def __init__(self, cfg: ToyRegressionSettings):
        self.cfg = cfg

    def setup(self, settings, accelerator):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(32, self.cfg.width, generator=g)
        self.y = self.x @ torch.randn(self.cfg.width, 1, generator=g)
        return TaskPlan(torch.nn.Linear(self.cfg.width, 1))

    def num_train_samples(self):
        return 32

    def train_batch(self, indices, device, generator):
        return {"x": self.x[indices].to(device), "y": self.y[indices].to(device)}

    def loss(self, model, batch, generator):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def units(self, batch):
        return batch["x"].shape[0]

    def evaluate(self, model, settings, device):
        return {"val_loss": ((model(self.x) - self.y) ** 2).mean().item()}

    def save_pretrained(self, model, output_dir: Path):
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(output_dir / "toy.safetensors"))
        (output_dir / "toy.json").write_text(json.dumps({"width": self.cfg.width}))


TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

A toy regression. {{ summary }}

{% for key, value in settings_rows %}| `{{ key }}` | {{ value }} |
{% endfor %}"""


@pytest.fixture
def toy_task(tmp_path):
    template = tmp_path / "toy-regression.md"
    template.write_text(TEMPLATE)
    CARDS.add("toy-regression", CardSpec("toy-regression", str(template), "pytorch", "tabular-regression", "toy.json",
                                         read_config("toy.json"), ("toy.safetensors",),
                                         (("val_loss", "mse", "validation MSE"),)))
    RECIPES.add("toyreg", Recipe("toyreg", "fit a toy linear regression", ToyRegressionSettings, ToyRegressionTask))
    yield
    RECIPES.remove("toyreg")
    CARDS.remove("toy-regression")


def test_a_toy_task_registered_from_a_test_file(toy_task, tmp_path, capsys):
    assert cli_main(["train", "--help"]) == 0
    assert "toyreg fit a toy linear regression" in " ".join(capsys.readouterr().out.split())
    text = _help(["train", "toyreg", "--help"], capsys)
    assert "--width INT Inputs of the regression" in text and "--learning_rate" in text

    out = tmp_path / "run"
    assert cli_main(["train", "toyreg", "--width", "3", "--max_steps", "4", "--micro_batch_size", "8",
                     "--eval_steps", "0", "--checkpointing_steps", "2", "--progress", "false",
                     "--output_dir", str(out)]) == 0
    results = json.loads((out / "all_results.json").read_text())
    assert results["card"] == "toy-regression" and results["settings"]["width"] == 3
    card = (out / "README.md").read_text()
    assert "library_name: pytorch" in card and "pipeline_tag: tabular-regression" in card
    assert "4 parameters" in card and "| `width` | 3 |" in card  # 3 weights + 1 bias, from toy.safetensors

    # its FIXED setting is in the resume fingerprint: another width is refused in one line naming both values
    assert cli_main(["train", "toyreg", "--width", "5", "--max_steps", "6", "--output_dir", str(out),
                     "--resume_from_checkpoint", "latest", "--progress", "false"]) == 2
    assert "'width': (3, 5)" in capsys.readouterr().err
