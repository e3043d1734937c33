"""The kill matrix of test_faults on the real paths: a distillation (``train flow-distill``), a LoRA fine-tune on
packed instruction rows, a GGUF export and ``sample --save_pipeline``, each killed at a few planted moments
(``os._exit`` in a forked child: no ``finally``, no flush, like SIGKILL) and run again.

A killed training resumed with ``--resume_from_checkpoint latest`` ends bit-identical to its uninterrupted reference
(the bytes of the final model's and best/'s files, the checkpoints kept, history and results but for measured times)
and ``hf-cgpu verify`` passes; a killed export or pipeline save never leaves a half file or folder at its name, and the
next run writes exactly what an uninterrupted one writes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import accelerate
import pytest
import safetensors.torch

import hf_cgpu.gguf_export as gguf_export
import hf_cgpu.integrity as integrity
import hf_cgpu.train.artifacts as artifacts
from hf_cgpu.cli import main as cli_main
from hf_cgpu.integrity import MANIFEST, read_manifest
from hf_cgpu.tasks.finetune_lm import FinetuneTask
from hf_cgpu.tasks.flow_distill import FlowDistillTask
from hf_cgpu.train import checkpoint as ckpt_io
from hf_cgpu.train.artifacts import STAGING
from test_faults import KILLED, _ckpt_path_arg, _in_ckpt, die_when, half, in_child, nth_call, snapshot
from test_seal_checks import lora_run  # noqa: F401  (a fixture: a sealed LoRA run over a tiny llama, what export reads)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

UNET = "unet/diffusion_pytorch_model.safetensors"


def cli(*argv) -> None:
    assert cli_main([str(a) for a in argv]) == 0, argv


def kill_moving_staged_file(n: int):
    """Kill after the ``n``-th file of a final save left its staging folder."""
    count = nth_call(n)
    die_when(os, "replace", lambda src, dst: STAGING in str(src) and STAGING not in str(dst) and count(), after=True)


def in_training(pred):
    """``pred`` counting only the calls of a task's ``loss`` on a model in training mode."""
    return lambda self, model, *a, **k: model.training and pred()


# ---------------------------------------------------------------------------------------------------- runs


MEASURED = ("_per_s", "seconds", "peak_rss", "mfu", "recompiles", "ledger")  # timings, memory: differ run to run
NOT_THE_MODEL = {"all_results.json", "history.json", "training_curves.png"}  # compared without what is measured


def unmeasured(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if not any(word in k for word in MEASURED)}


def run_outcome(out: Path) -> dict:
    """What an uninterrupted run and a killed-then-resumed one share: the bytes of every file the final model's
    and best/'s manifests seal (but those of ``NOT_THE_MODEL``), the checkpoints kept, and history and results
    without measured figures (nor the output folder and the resume flag among the settings)."""
    results = json.loads((out / "all_results.json").read_text())
    settings = {k: v for k, v in results.pop("settings").items() if k not in ("output_dir", "resume_from_checkpoint")}
    sealed = {}
    for name, folder in (("model", out), ("best", out / "best")):
        if (folder / MANIFEST).is_file():
            files = snapshot(folder)
            sealed[name] = {rel: files[rel] for rel in read_manifest(folder).files if rel not in NOT_THE_MODEL}
    return {"sealed": sealed,
            "checkpoints": [p.name for p in ckpt_io.list_checkpoints(out)],
            "history": [unmeasured(h) for h in json.loads((out / "history.json").read_text())],
            "results": {**unmeasured(results), "settings": settings}}


def assert_resumed_as_reference(out: Path, reference: dict) -> None:
    got = run_outcome(out)
    assert got["sealed"].keys() == reference["sealed"].keys()
    for folder, files in reference["sealed"].items():
        assert got["sealed"][folder] == files, folder
    for part in ("checkpoints", "history", "results"):
        assert got[part] == reference[part], part
    cli("verify", out)


def kill_then_resume(kill, resumes_at: set[int], train, out: Path, reference: dict, capsys) -> None:
    """Kill a run with ``kill`` planted, then resume it: from a checkpoint of a step in ``resumes_at`` (a resume,
    not a fresh start that happens to end alike), to the reference's outcome."""

    def child():
        kill()
        train(out)

    assert in_child(child) == KILLED, "the planted kill never fired"
    capsys.readouterr()
    train(out, "--resume_from_checkpoint", "latest")
    resumed = re.search(r"^resumed from .*step_\d+ at step (\d+)$", capsys.readouterr().out, re.M)
    assert resumed and int(resumed.group(1)) in resumes_at, resumed
    assert_resumed_as_reference(out, reference)


# ---------------------------------------------------------------------------------------------------- flow-distill


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, synthetic_data):
    """A tiny flow model (2 steps): the distillation's teacher and the pipeline ``sample --save_pipeline`` saves."""
    out = tmp_path_factory.mktemp("kill_teacher") / "teacher"
    cli("train", "flow", "--preset", "tiny", "--output_dir", out, "--progress", "false", "--dataset", synthetic_data,
        "--base_channels", 8, "--max_steps", 2, "--checkpointing_steps", 0, "--limit", 32)
    return out


@pytest.fixture(scope="module")
def distill(tmp_path_factory, teacher, synthetic_data):
    """(train(out, *more), the reference outcome): 6 steps of one micro-batch, checkpoints at 2, 4 and 6, EMA."""

    def train(out, *more):
        cli("train", "flow-distill", "--preset", "tiny", "--output_dir", out, "--progress", "false", "--teacher",
            teacher, "--dataset", synthetic_data, "--limit", 32, "--max_steps", 6, "--checkpointing_steps", 2, *more)

    out = tmp_path_factory.mktemp("kill_distill") / "reference"
    train(out)
    reference = run_outcome(out)
    assert reference["checkpoints"] == ["step_0000002", "step_0000004", "step_0000006"]
    assert UNET in reference["sealed"]["model"]
    return train, reference


# (the kill, the steps of the checkpoint the resume may start from); the final save starts once step 6's checkpoint
# is sealed, step 4's is sealed in the background while step 5 runs
DISTILL_KILLS = {
    # in step 5's loss (the evaluations call it too, on the model in eval mode)
    "mid_step": (lambda: die_when(FlowDistillTask, "loss", in_training(nth_call(5))), {2, 4}),
    # accelerate's save_state of step 4: optimizer.bin half written, nothing sealed
    "save_state": (lambda: die_when(accelerate.Accelerator, "save_state", _in_ckpt(4), after=True,
                                    before_dying=lambda self, d, **k: half(Path(d) / "optimizer.bin")), {2}),
    "before_checkpoint_rename": (lambda: die_when(ckpt_io, "write_manifest", _ckpt_path_arg(4), after=True), {2}),
    "moving_model_files": (lambda: kill_moving_staged_file(2), {6}),
    "before_model_manifest": (lambda: die_when(artifacts, "write_manifest"), {6}),
}


@pytest.mark.parametrize("point", list(DISTILL_KILLS))
def test_a_killed_distillation_resumes_bit_identical(point, distill, tmp_path, capsys):
    train, reference = distill
    kill_then_resume(*DISTILL_KILLS[point], train, tmp_path / "run", reference, capsys)


# ---------------------------------------------------------------------------------------------------- packed LoRA


@pytest.fixture(scope="module")
def packed_lora(tmp_path_factory, tiny_base):
    """(train(out, *more), the reference outcome): LoRA on 60 short instruction rows packed two to a row, 6 steps of
    two micro-batches, evaluations at 0, 3 and 6 (best/ written with the checkpoints at 2, 4 and 6)."""
    data = tmp_path_factory.mktemp("kill_lora_data")
    rows = [{"instruction": f"add {i % 7}", "output": f"{i % 7 + 1}"} for i in range(60)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def train(out, *more):
        cli("train", "lora", "--preset", "lora", "--model", tiny_base, "--dataset", data, "--seq_len", 63,
            "--micro_batch_size", 2, "--gradient_accumulation_steps", 2, "--max_steps", 6, "--warmup_steps", 1,
            "--eval_steps", 3, "--eval_batches", 1, "--log_steps", 1, "--checkpointing_steps", 2, "--lora_r", 4,
            "--compile", "false", "--progress", "false", "--output_dir", out, *more)

    out = tmp_path_factory.mktemp("kill_lora") / "reference"
    train(out)
    reference = run_outcome(out)
    results = reference["results"]
    assert results["settings"]["packing"] and results["toks_seen"] > 6 * 4 * 63 * 0.9  # rows full: packed
    assert reference["checkpoints"] == ["step_0000002", "step_0000004", "step_0000006"]
    assert "adapter_model.safetensors" in reference["sealed"]["best"]
    return train, reference


LORA_KILLS = {
    # step 5's second micro-batch, the first one's gradients accumulated
    "mid_step": (lambda: die_when(FinetuneTask, "train_batch", nth_call(2 * 4 + 2)), {2, 4}),
    "save_state": (lambda: die_when(accelerate.Accelerator, "save_state", _in_ckpt(4), after=True,
                                    before_dying=lambda self, d, **k: half(Path(d) / "optimizer.bin")), {2}),
    "before_checkpoint_rename": (lambda: die_when(ckpt_io, "write_manifest", _ckpt_path_arg(4), after=True), {2}),
    # best/ of step 3, written before step 4's checkpoint: its adapter half written
    "best_weights": (lambda: die_when(FinetuneTask, "save_best", nth_call(2), after=True,
                                      before_dying=lambda self, m, folder: half(folder / "adapter_model.safetensors")),
                     {2}),
    "moving_model_files": (lambda: kill_moving_staged_file(3), {6}),
}


@pytest.mark.parametrize("point", list(LORA_KILLS))
def test_a_killed_packed_lora_run_resumes_bit_identical(point, packed_lora, tmp_path, capsys):
    train, reference = packed_lora
    kill_then_resume(*LORA_KILLS[point], train, tmp_path / "run", reference, capsys)


# ---------------------------------------------------------------------------------------------------- export --gguf


@pytest.fixture(scope="module")
def exported(lora_run, tmp_path_factory):
    """(the run folder, the bytes of its uninterrupted export to run/gguf/run-bf16.gguf, checked)."""
    out = tmp_path_factory.mktemp("kill_export") / "run"
    shutil.copytree(lora_run / "run", out)
    cli("export", out, "--gguf")
    gguf = out / "gguf" / "run-bf16.gguf"
    assert sorted(p.name for p in gguf.parent.iterdir()) == [MANIFEST, gguf.name]
    return lora_run / "run", gguf.read_bytes()


EXPORT_KILLS = {
    # the tensors half on disk (the file under its hidden temporary name)
    "writing_tensors": lambda: die_when(pytest.importorskip("gguf").GGUFWriter, "write_tensors_to_file", after=True,
                                        before_dying=lambda self, **k: half(self.path)),
    "reading_back": lambda: die_when(gguf_export, "compare_logits"),
    "before_rename": lambda: die_when(os, "replace", lambda src, dst: str(dst).endswith("run-bf16.gguf")),
    "before_seal": lambda: die_when(gguf_export, "seal_export"),  # the file in place, its folder's manifest not
}


@pytest.mark.parametrize("point", list(EXPORT_KILLS))
def test_a_killed_export_leaves_no_partial_file_and_the_next_writes_the_same_bytes(point, exported, tmp_path):
    run, want = exported
    out = tmp_path / "run"
    shutil.copytree(run, out)
    gguf = out / "gguf" / "run-bf16.gguf"

    def child():
        EXPORT_KILLS[point]()
        cli("export", out, "--gguf")

    assert in_child(child) == KILLED, "the planted kill never fired"
    hidden = [p.name for p in gguf.parent.iterdir() if p.name.startswith(".")]
    if point == "before_seal":
        assert gguf.read_bytes() == want and not hidden  # whole, or not there at all
    else:
        assert not gguf.exists() and len(hidden) == 1 and hidden[0].startswith(".run-bf16.tmp-"), hidden
    cli("export", out, "--gguf")
    assert gguf.read_bytes() == want
    assert sorted(p.name for p in gguf.parent.iterdir()) == [MANIFEST, gguf.name]  # the killed one's temporary gone
    cli("verify", gguf.parent)


# ---------------------------------------------------------------------------------------------------- save_pipeline


def save_pipeline(teacher: Path, dest: Path, steps: int) -> None:
    cli("sample", teacher, "--num_images", 1, "--num_inference_steps", steps, "--output_dir", dest.parent / "png",
        "--save_pipeline", dest)


def sealed_files(folder: Path) -> dict[str, str]:
    """The SHA-256 of every file ``folder``'s manifest lists, after ``verify`` passed on it."""
    cli("verify", folder)
    files = snapshot(folder)
    return {rel: files[rel] for rel in read_manifest(folder).files}


@pytest.fixture(scope="module")
def pipelines(teacher, tmp_path_factory):
    """(an earlier save at 2 steps, the sealed files of an uninterrupted save at 3 steps): they differ."""
    root = tmp_path_factory.mktemp("kill_pipeline")
    save_pipeline(teacher, root / "old", 2)
    save_pipeline(teacher, root / "new", 3)
    old, new = sealed_files(root / "old"), sealed_files(root / "new")
    assert old.keys() == new.keys() and old != new and UNET in new
    return root / "old", new


SAVE_PIPELINE_KILLS = {
    # (the kill, what the destination holds after it: the earlier save, nothing, or the new one whole)
    "writing_weights": (lambda: die_when(safetensors.torch, "save_file", after=True,
                                         before_dying=lambda tensors, filename, **k: half(filename)), "old"),
    "sealing": (lambda: die_when(artifacts, "write_manifest", after=True), "old"),
    "moving_files": (lambda: kill_moving_staged_file(2), "old"),
    # the earlier folder set aside, the new one not yet in its place
    "between_renames": (lambda: die_when(os, "replace", lambda src, dst: Path(dst).name == "saved"), "absent"),
    "removing_the_old": (lambda: die_when(integrity.shutil, "rmtree", lambda p, *a, **k: str(p).endswith("-old")),
                         "new"),
}


@pytest.mark.parametrize("point", list(SAVE_PIPELINE_KILLS))
def test_a_killed_save_pipeline_leaves_the_old_folder_or_none_never_half(point, pipelines, teacher, tmp_path):
    old, new = pipelines
    dest = tmp_path / "saved"
    shutil.copytree(old, dest)
    before = sealed_files(dest)
    kill, expected = SAVE_PIPELINE_KILLS[point]

    def child():
        kill()
        save_pipeline(teacher, dest, 3)

    assert in_child(child) == KILLED, "the planted kill never fired"
    if expected == "absent":  # the earlier save whole beside it, under the hidden name the next save clears
        assert not dest.exists() and sealed_files(tmp_path / f".{dest.name}-old") == before
    else:
        assert sealed_files(dest) == (before if expected == "old" else new)
        assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == sorted(
            [*before, MANIFEST])  # nothing else: no staged or half file inside
    save_pipeline(teacher, dest, 3)
    assert sealed_files(dest) == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["png", "saved"]  # what the kill left beside it is gone
