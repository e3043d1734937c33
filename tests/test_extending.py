"""Extension points, used as docs/extending.md shows them: a toy optimizer, a toy sampler and a toy task (with its own
model card) registered from this file, without editing the package, and each found where a user meets it: in
``--help``, in ``hf-cgpu budget``, in a short training run and in the model card."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_cgpu.cli import main as cli_main
from hf_cgpu.flow.samplers import SAMPLERS, evaluations_per_image, steps_within
from hf_cgpu.flow.scheduling_flow_match import FlowMatchEulerScheduler
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
class DoubleEuler(FlowMatchEulerScheduler):
    """Euler on a grid twice as fine as asked: N steps cost 2N network evaluations."""

    def set_timesteps(self, num_inference_steps, device=None):
        super().set_timesteps(2 * num_inference_steps, device)


@pytest.fixture
def double_euler():
    SAMPLERS.add("double-euler", DoubleEuler)
    yield
    SAMPLERS.remove("double-euler")


def test_a_toy_sampler_registered_from_a_test_file(double_euler, synthetic_data, tmp_path, capsys):
    assert evaluations_per_image("double-euler", 3) == 6 and evaluations_per_image("double-euler", 3, 2.0) == 12
    assert steps_within(10, "double-euler") == 5  # counted from the class, not from its name
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text("{}")  # hf-cgpu eval of a pipeline folder: the image evaluation
    for argv in (["sample", "--help"], ["eval", str(pipeline), "--help"], ["train", "flow", "--help"]):
        assert "Choices: euler, heun, double-euler." in _help(argv, capsys), argv

    out = tmp_path / "flow"
    assert cli_main(["train", "flow", "--preset", "tiny", "--dataset", str(synthetic_data), "--limit", "64",
                     "--max_steps", "2", "--checkpointing_steps", "0", "--progress", "false",
                     "--sampler", "double-euler", "--sample_steps", "2", "--output_dir", str(out)]) == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["scheduler"][1] == "DoubleEuler"  # the saved pipeline samples with it
    assert list((out / "samples").glob("step_*.png"))  # the run's sample grid was drawn with it
    assert "| `sampler` | double-euler |" in (out / "README.md").read_text()


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
