"""Nothing silently wrong at the edges of a run: weights that are not finite are never saved or sealed, a model
folder without its manifest never verifies, earlier work in an output folder is never overwritten by a fresh run,
and a run refused before its first step leaves nothing behind."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_cgpu.errors import OutputDirError, TrainingStopped
from hf_cgpu.integrity import MANIFEST
from hf_cgpu.train import checkpoint as ckpt_io
from hf_cgpu.train import fit
from hf_cgpu.cli import main as cli_main

from test_loop import ToyTask, settings


def verify(argv):
    return cli_main(["verify", *argv])


class PoisonLast(ToyTask):
    """A finite loss every step, but the weights turn NaN in the last one (a divergence the loss does not show)."""

    def __init__(self, at_call: int, **kw):
        super().__init__(**kw)
        self.at_call = at_call

    def loss(self, model, batch, generator):
        loss = super().loss(model, batch, generator)
        if self.calls == self.at_call:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        return loss


@pytest.mark.parametrize("ema", [0.0, 0.9])
def test_weights_that_are_not_finite_at_the_end_are_never_saved_or_sealed(tmp_path, ema, capsys):
    """Step 5 of 5 is no checkpoint step: its checkpoint is refused, and so is the final save (before: the model was
    evaluated, saved and sealed with NaN weights, and `hf-cgpu verify` passed it)."""
    with pytest.raises(TrainingStopped) as stop:
        fit(PoisonLast(at_call=2 * 5), settings(tmp_path, max_steps=5, checkpointing_steps=2, ema_decay=ema))
    message = str(stop.value)
    assert "no longer finite" in message and "step_0000004" in message and "\n" not in message
    assert "Nothing was evaluated, saved or sealed" in message
    assert not (tmp_path / MANIFEST).exists() and not (tmp_path / "toy.pt").exists()
    assert not (tmp_path / ".tmp-model").exists() and not (tmp_path / "all_results.json").exists()
    assert [c.name for c in ckpt_io.list_checkpoints(tmp_path)] == ["step_0000002", "step_0000004"]
    capsys.readouterr()
    assert verify([str(tmp_path)]) == 0  # what is there (the finite checkpoints) verifies; no model was written


def test_best_weights_are_never_written_from_weights_that_are_not_finite(tmp_path):
    class NanEvaluatesWell(PoisonLast):
        best_metric = "val_loss"

        def evaluate(self, model, settings, device):
            return {"val_loss": 0.0 if self.calls >= self.at_call else 1.0}  # "improves" exactly when NaN

    with pytest.raises(TrainingStopped):
        fit(NanEvaluatesWell(at_call=2 * 3), settings(tmp_path, max_steps=4, eval_steps=2, checkpointing_steps=2))
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["step"] == 2  # the evaluation at step 4 saw NaN weights: not kept as best


def test_verify_refuses_a_model_folder_without_its_manifest(tmp_path, capsys):
    """A final save cut off between moving the files and writing the manifest leaves exactly this."""
    run = tmp_path / "run"
    fit(ToyTask(), settings(run, max_steps=4, checkpointing_steps=2))
    (run / "config.json").write_text("{}")  # a model folder: its files are checked, or it is unsealed
    from hf_cgpu.integrity import build_manifest, write_manifest

    write_manifest(run, build_manifest(run, "model", exclude=("checkpoints",)))
    assert verify([str(run)]) == 0
    (run / MANIFEST).unlink()
    assert verify([str(run)]) == 2
    out = capsys.readouterr().out
    assert f"BAD  {run}: {run}: unsealed, no manifest.json" in out


def test_verify_covers_best_and_the_training_copy_of_the_tokenizer(tmp_path, capsys):
    from hf_cgpu.data.corpus import builtin_corpus
    from hf_cgpu.data.tokenizer import save_tokenizer, train_tokenizer

    run = tmp_path / "run"
    run.mkdir()
    save_tokenizer(train_tokenizer(builtin_corpus()[:5], vocab_size=300, show_progress=False), run / "tokenizer", {})
    assert verify([str(run)]) == 0 and "ok   " in capsys.readouterr().out
    data = bytearray((run / "tokenizer" / "tokenizer.json").read_bytes())
    data[100] ^= 0x01
    (run / "tokenizer" / "tokenizer.json").write_bytes(bytes(data))
    assert verify([str(run)]) == 2
    assert "tokenizer.json does not match its checksum" in capsys.readouterr().out
    (run / "best").mkdir()
    (run / "best" / "model.safetensors").write_bytes(b"x")
    assert verify([str(run)]) == 2
    assert "best: unsealed" in capsys.readouterr().out.replace(str(run / "best") + ": ", "best: ")


@pytest.mark.parametrize("left", ["model files", "best and tokenizer"])
def test_a_fresh_run_never_overwrites_an_unsealed_model_or_best_weights(tmp_path, left):
    run = tmp_path / "run"
    fit(ToyTask(), settings(run, max_steps=4, checkpointing_steps=2))
    shutil.rmtree(run / "checkpoints")
    (run / MANIFEST).unlink()
    (run / "all_results.json").unlink()
    if left == "model files":
        (run / "config.json").write_text("{}")
        (run / "model.safetensors").write_bytes(b"weights")
    else:  # what a run that kept its best weights leaves when its checkpoints and final model are gone
        for name in list(run.iterdir()):
            shutil.rmtree(name) if name.is_dir() else name.unlink()
        (run / "best").mkdir()
        (run / "best" / "model.safetensors").write_bytes(b"weights")
        (run / "tokenizer").mkdir()
    with pytest.raises(OutputDirError, match="holds (a model without manifest.json|the best weights)"):
        fit(ToyTask(), settings(run, max_steps=4))
    kept = run / ("model.safetensors" if left == "model files" else "best/model.safetensors")
    assert kept.read_bytes() == b"weights"


class BadData(ToyTask):
    def setup(self, settings, accelerator):
        (settings.output_dir and __import__("pathlib").Path(settings.output_dir) / "tokenizer").mkdir()
        from hf_cgpu.errors import DataError

        raise DataError("the data is bad")  # after the task wrote its start-up files


def test_a_run_refused_before_its_first_step_leaves_nothing_behind(tmp_path):
    from hf_cgpu.errors import DataError

    new = tmp_path / "new"
    with pytest.raises(DataError):
        fit(BadData(), settings(new))
    assert not new.exists()  # the folder it created, its lock and tokenizer/ included
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(DataError):
        fit(BadData(), settings(mine))
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]  # only what it added is taken back
