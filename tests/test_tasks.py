"""What every task owes the loop: targets shifted against the inputs (no label leak), and evaluation on held-out
data, never the training set; the flow task's evaluation cadence as a declared value."""

from __future__ import annotations

import datasets
import pytest
import torch

from hf_cgpu.data.packing import pack_dataset
from hf_cgpu.data.tokenizer import train_tokenizer
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tasks.packed import PackedTokensTask


@pytest.fixture(scope="module")
def two_streams(tmp_path_factory):
    """Training text of a/b only, validation text of x/y only: a token id says which split it came from."""
    tok = train_tokenizer(["abxy"], vocab_size=257, show_progress=False)
    folder = tmp_path_factory.mktemp("pack")
    train = pack_dataset(datasets.Dataset.from_dict({"text": ["abab" * 30] * 4}), tok, 16, folder)
    val = pack_dataset(datasets.Dataset.from_dict({"text": ["xyxy" * 30] * 2}), tok, 16, folder)
    return tok, train, val


class Spy(PackedTokensTask):
    def __init__(self, train, val):
        self.train_data, self.val_data, self.seen = train, val, []

    def target_loss(self, model, inputs, targets):
        self.seen.append((inputs.clone(), targets.clone()))
        return torch.zeros(())


def test_targets_are_the_inputs_shifted_by_one(two_streams):
    _, train, val = two_streams
    task = Spy(train, val)
    batch = task.train_batch(task.sample_order(0).indices(0, 3), torch.device("cpu"), None)
    task.loss(None, batch, None)
    (inputs, targets), block = task.seen[0], batch["input_ids"]
    assert inputs.shape == targets.shape == (3, 16)
    assert torch.equal(inputs, block[:, :-1]) and torch.equal(targets, block[:, 1:])
    assert not torch.equal(inputs, targets)  # a label leak would pass the inputs as targets


def test_language_model_validation_reads_the_validation_split(two_streams):
    tok, train, val = two_streams
    task = Spy(train, val)
    task.evaluate(None, TrainSettings(micro_batch_size=2, eval_batches=0), torch.device("cpu"))
    seen = torch.cat([torch.cat([x.flatten(), y[y != -100]]) for x, y in task.seen])
    val_ids = set(torch.from_numpy(val.tokens.astype("int64")).tolist())
    train_only = set(torch.from_numpy(train.tokens.astype("int64")).tolist()) - val_ids
    assert set(seen.tolist()) <= val_ids and not set(seen.tolist()) & train_only


class ZeroVelocity(torch.nn.Module):
    class config:  # noqa: N801 - what the flow task reads of a UNet
        num_classes = None

    def forward(self, xt, t, labels=None):
        from types import SimpleNamespace

        return SimpleNamespace(sample=torch.zeros_like(xt))


def test_flow_validation_uses_the_held_out_images():
    """A zero velocity field scores E|x1 - x0|^2 = x1^2 + 1: 1 on grey (0) training images, 2 on white test ones."""
    from hf_cgpu.flow.matching import FlowMatcher
    from hf_cgpu.tasks.flow_images import FlowMatchingTask, FlowSettings

    task = FlowMatchingTask(FlowSettings(class_conditional=False))
    task.matcher, task.labels, task.val_labels = FlowMatcher(), None, None
    task.images = torch.full((64, 3, 8, 8), 128, dtype=torch.uint8)  # grey: x1 = 0
    task.val_images = torch.full((64, 3, 8, 8), 255, dtype=torch.uint8)  # white: x1 = 1
    val = task.evaluate(ZeroVelocity(), TrainSettings(micro_batch_size=16), torch.device("cpu"))["val_loss"]
    assert val == pytest.approx(2.0, abs=0.05)


def test_classifier_validation_uses_the_test_split():
    from hf_cgpu.tasks.classifier import ClassifierSettings, ClassifierTask

    class AlwaysOne(torch.nn.Module):
        def forward(self, x):
            return torch.tensor([[0.0, 5.0]]).expand(x.shape[0], 2)

    task = ClassifierTask(ClassifierSettings())
    task.images, task.labels = torch.zeros(20, 3, 8, 8, dtype=torch.uint8), torch.zeros(20, dtype=torch.long)
    task.test_images, task.test_labels = torch.zeros(7, 3, 8, 8, dtype=torch.uint8), torch.ones(7, dtype=torch.long)
    r = task.evaluate(AlwaysOne(), TrainSettings(micro_batch_size=4), torch.device("cpu"))
    assert r["accuracy"] == 1.0  # every test label is 1; on the training labels (0) it would be 0


def test_flow_task_declares_its_cadence_without_touching_the_settings(synthetic_data):
    from accelerate import Accelerator

    from hf_cgpu.tasks.flow_images import FlowMatchingTask, FlowSettings

    s = TrainSettings(micro_batch_size=16, eval_steps=200)
    task = FlowMatchingTask(FlowSettings(dataset=str(synthetic_data), base_channels=8, sample_every_epochs=2.0,
                                         limit=160))
    plan = task.setup(s, Accelerator())
    assert plan.eval_steps == 20 and s.eval_steps == 200  # 2 epochs of 160 images at 16 per step
    assert plan.flops_per_unit > 0 and plan.shape is None
    with pytest.raises(Exception, match="cannot assign"):
        s.eval_steps = 20  # frozen
