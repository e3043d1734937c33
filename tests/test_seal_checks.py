"""What reads a saved folder trusts only what its seal proves.

Every command that reads a folder (sample, eval, generate, export, a --teacher, a --guidance_model, a fine-tune's
--model) checks it against its manifest first (``verify.check_saved``): a folder whose final save a kill cut off while
its files moved, or with one flipped byte, is refused in one line; a folder hf_cgpu did not write is read as it is.
A manifest that lists paths outside its folder is refused wherever it is read (nothing outside is read or deleted),
an adapter refuses a base written over after training, ``sample --save_pipeline`` seals its folder like a run's, and a
closed stdout (``| head``) ends a command quietly. Kills are real: ``os._exit`` in a forked child (test_faults).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_cgpu.integrity as integrity
from hf_cgpu.cli import main as cli_main
from hf_cgpu.integrity import MANIFEST, FileEntry, Manifest, build_manifest, file_mode, sha256_file, write_manifest
from hf_cgpu.train import fit
from hf_cgpu.train.artifacts import STAGING
from test_faults import KILLED, die_when, flip_byte, in_child, nth_call
from test_loop import ToyTask, settings

pytestmark = pytest.mark.usefixtures("one_thread")

UNET = "unet/diffusion_pytorch_model.safetensors"


def run(capsys, *argv) -> tuple[int, str]:
    """``hf-cgpu ARGV``: its exit code and what it wrote on stderr."""
    capsys.readouterr()
    rc = cli_main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def kill_while_files_move(moved: int):
    """Plant a kill after the ``moved``-th file of a final save left its staging folder."""
    count = nth_call(moved)
    die_when(os, "replace", lambda src, dst: STAGING in str(src) and STAGING not in str(dst) and count(), after=True)


# ---------------------------------------------------------------------------------------------------- flow folders


def train(name, out, *argv):
    assert cli_main(["train", name, "--preset", "tiny", "--output_dir", str(out), "--progress", "false",
                     *map(str, argv)]) == 0


@pytest.fixture(scope="module")
def flow_runs(tmp_path_factory, synthetic_data):
    root = tmp_path_factory.mktemp("sealed_flow")
    train("flow", root / "teacher", "--dataset", synthetic_data, "--base_channels", 8, "--max_steps", 2,
          "--checkpointing_steps", 0, "--limit", 32)
    train("flow-distill", root / "student", "--teacher", root / "teacher", "--dataset", synthetic_data,
          "--max_steps", 2, "--checkpointing_steps", 2, "--limit", 32)
    return root


def test_sample_and_eval_refuse_a_resumed_distillation_killed_while_its_files_move(flow_runs, synthetic_data,
                                                                                    tmp_path, capsys):
    """all_results.json (first in the manifest) already says step 4 while the UNet is still step 2's: `sample`
    sampled the older UNet and exited 0. Now it refuses naming the resume that finishes the save, and so does eval;
    --verify off reads it anyway, saying so; the resume finishes the save and sample reads the new model."""
    out = tmp_path / "student"
    shutil.copytree(flow_runs / "student", out)
    resume = ["--teacher", flow_runs / "teacher", "--dataset", synthetic_data, "--limit", 32, "--max_steps", 4,
              "--checkpointing_steps", 2, "--resume_from_checkpoint", "latest"]

    def child():
        kill_while_files_move(2)
        train("flow-distill", out, *resume)

    assert in_child(child) == KILLED
    assert json.loads((out / "all_results.json").read_text())["steps"] == 4 and not (out / MANIFEST).exists()
    sample = ["sample", out, "--num_images", 1, "--output_dir", tmp_path / "png"]
    rc, err = run(capsys, *sample)
    line = one_line(err)
    assert rc == 2 and "cut off while its files moved" in line and "--resume_from_checkpoint latest" in line, err
    assert not (tmp_path / "png").exists()
    rc, err = run(capsys, "eval", out, "--classifier", tmp_path / "none", "--num_images", 8)
    assert rc == 2 and "cut off while its files moved" in one_line(err)
    rc, err = run(capsys, "verify", out)
    assert rc == 2
    rc, err = run(capsys, *sample, "--verify", "off")
    assert rc == 0 and "--verify off" in err
    train("flow-distill", out, *resume)  # the next run in the folder finishes the save
    rc, err = run(capsys, *sample)
    assert rc == 0 and (tmp_path / "png" / "grid.png").is_file(), err


def test_a_flipped_byte_in_a_unet_is_refused_by_sample_guidance_and_teacher(flow_runs, synthetic_data, tmp_path,
                                                                             capsys):
    """A small folder is hashed whole under --verify auto: one flipped byte in the UNet's weights sampled fine."""
    bad = tmp_path / "student"
    shutil.copytree(flow_runs / "student", bad)
    flip_byte(bad / UNET)
    rc, err = run(capsys, "sample", bad, "--num_images", 1, "--output_dir", tmp_path / "png")
    line = one_line(err)
    assert rc == 2 and f"{UNET} does not match its checksum" in line and "hf-cgpu verify" in line, err
    rc, err = run(capsys, "sample", bad, "--num_images", 1, "--output_dir", tmp_path / "png", "--verify", "sizes")
    assert rc == 0, err  # sizes alone cannot see a flipped byte: what --verify auto adds for a small folder
    teacher = tmp_path / "teacher"
    shutil.copytree(flow_runs / "teacher", teacher)
    flip_byte(teacher / UNET)
    rc, err = run(capsys, "sample", flow_runs / "teacher", "--num_images", 1, "--output_dir", tmp_path / "png",
                  "--class_labels", 1, "--guidance_scale", 2, "--guidance_model", teacher)
    assert rc == 2 and one_line(err).startswith(f"error: --guidance_model {teacher}: ") and UNET in err, err
    rc, err = run(capsys, "train", "flow-distill", "--preset", "tiny", "--output_dir", tmp_path / "d", "--progress",
                  "false", "--teacher", teacher, "--dataset", synthetic_data)
    assert rc == 2 and one_line(err).startswith(f"error: --teacher {teacher}: ") and UNET in err, err


def test_save_pipeline_is_sealed_like_a_run(flow_runs, tmp_path, capsys):
    """It was written 0600 without a manifest, and push called it "unsealed ... a save cut off"."""
    from hf_cgpu.hub.push import check_before_push

    dest = tmp_path / "saved"
    rc, err = run(capsys, "sample", flow_runs / "teacher", "--num_images", 1, "--output_dir", tmp_path / "png",
                  "--save_pipeline", dest, "--num_inference_steps", 3)
    assert rc == 0, err
    manifest = integrity.read_manifest(dest)
    assert UNET in manifest.files and "model_index.json" in manifest.files and not (dest / STAGING).exists()
    assert {(dest / rel).stat().st_mode & 0o777 for rel in manifest.files} == {file_mode()}
    check_before_push(dest)  # sealed: no --allow_unsealed needed
    rc, err = run(capsys, "verify", dest)
    assert rc == 0, err
    rc, err = run(capsys, "sample", dest, "--num_images", 1, "--output_dir", tmp_path / "png2")
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------------- adapters


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run (2 steps, a checkpoint at each) over a tiny llama with a byte-level BPE: what export writes."""
    pytest.importorskip("gguf", reason="GGUF export needs `pip install gguf`")
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_gguf_export import bpe_tokenizer

    root = tmp_path_factory.mktemp("sealed_lora")
    tok = bpe_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 bos_token_id=0, eos_token_id=2)).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    train_lora(root / "base", root / "run", 2)
    return root


def train_lora(base: Path, out: Path, steps: int, *extra):
    assert cli_main(["train", "lora", "--model", str(base), "--dataset", "builtin", "--seq_len", "32",
                     "--micro_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_steps", str(steps),
                     "--warmup_steps", "1", "--eval_steps", "0", "--eval_batches", "1", "--checkpointing_steps", "1",
                     "--lora_r", "4", "--compile", "false", "--mixed_precision", "no", "--progress", "false",
                     "--output_dir", str(out), *extra]) == 0


def adapter_commands(run_dir: Path, tmp_path: Path) -> dict[str, list]:
    return {"generate": ["generate", run_dir, "hello", "--max_new_tokens", 2],
            "eval": ["eval", run_dir, "--dataset", "builtin", "--seq_len", 16, "--max_windows", 1],
            "export": ["export", run_dir, "--gguf", "--output", tmp_path / "x.gguf", "--check", "false"]}


def test_generate_eval_and_export_refuse_a_lora_run_killed_while_its_files_move(lora_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(lora_run / "run", out)

    def child():
        kill_while_files_move(1)
        train_lora(lora_run / "base", out, 3, "--resume_from_checkpoint", "latest")

    assert in_child(child) == KILLED
    for name, argv in adapter_commands(out, tmp_path).items():
        rc, err = run(capsys, *argv)
        assert rc == 2 and "cut off while its files moved" in one_line(err), (name, err)
    assert not (tmp_path / "x.gguf").exists()


def test_adapter_commands_refuse_a_base_written_over_after_training(lora_run, tmp_path, capsys):
    """The base's weights replaced by others of the same shapes (every size the same): generate, eval and export
    put the adapter on them and exited 0. The run recorded the base's digest beside the adapter; now each refuses
    naming the base and the file."""
    from transformers import LlamaForCausalLM

    base, out = tmp_path / "base", tmp_path / "run"
    shutil.copytree(lora_run / "base", base)
    train_lora(base, out, 1)
    record = json.loads((out / "base_model.json").read_text())["base_digest"]
    assert record["model.safetensors"]["sha256"] == sha256_file(base / "model.safetensors")
    size = (base / "model.safetensors").stat().st_size
    torch.manual_seed(1)
    other = LlamaForCausalLM(LlamaForCausalLM.config_class.from_pretrained(base))
    other.save_pretrained(base)
    assert (base / "model.safetensors").stat().st_size == size
    for name, argv in adapter_commands(out, tmp_path).items():
        rc, err = run(capsys, *argv)
        line = one_line(err)
        assert rc == 2 and f"the base {base} changed after" in line and "model.safetensors" in line, (name, err)
    assert not (tmp_path / "x.gguf").exists()
    rc, err = run(capsys, *adapter_commands(out, tmp_path)["generate"], "--verify", "off")
    assert rc == 0, err


def test_a_plain_folder_is_read_and_a_sealed_base_is_checked(tiny_base, tmp_path, capsys):
    """A transformers folder hf_cgpu did not write (no manifest, no trace of a run) is read as it is; sealed and then
    flipped, it is refused as a fine-tune's --model too; with only the lock of a run and no manifest, it is unsealed."""
    rc, err = run(capsys, "generate", tiny_base, "hello", "--max_new_tokens", 2)
    assert rc == 0, err
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    write_manifest(base, build_manifest(base, "model"))
    flip_byte(base / "model.safetensors")
    rc, err = run(capsys, "train", "lora", "--model", base, "--output_dir", tmp_path / "run", "--max_steps", 1)
    assert rc == 2 and one_line(err).startswith(f"error: --model {base}: ") and "model.safetensors" in err, err
    (base / MANIFEST).unlink()
    (base / ".hf_cgpu.lock").touch()
    rc, err = run(capsys, "generate", base, "hello")
    assert rc == 2 and "unsealed, no manifest.json" in one_line(err), err


# ---------------------------------------------------------------------------------------------------- manifests


def outside_entry(tmp_path: Path, run_dir: Path, kind: str) -> str:
    """A file outside ``run_dir`` and the manifest entry that reaches it: through '..', absolute, or through a
    linked folder inside the run."""
    victim = tmp_path / "outside" / "victim.txt"
    victim.parent.mkdir(exist_ok=True)
    victim.write_text("not the run's")
    if kind == "linked":
        (run_dir / "linked").symlink_to(victim.parent, target_is_directory=True)
        return "linked/victim.txt"
    return "../outside/victim.txt" if kind == "dotdot" else str(victim)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "linked"])
def test_a_manifest_listing_files_outside_its_folder_is_refused_and_nothing_outside_is_read_or_deleted(
        kind, tmp_path, capsys, monkeypatch):
    """A crafted manifest's outside entries were deleted by --overwrite_output_dir true and read by verify."""
    out = tmp_path / "run"
    fit(ToyTask(), settings(out, max_steps=2, checkpointing_steps=2))
    rel = outside_entry(tmp_path, out, kind)
    victim = tmp_path / "outside" / "victim.txt"
    manifest = integrity.read_manifest(out)
    manifest.files[rel] = FileEntry(victim.stat().st_size, sha256_file(victim))
    (out / MANIFEST).write_text(manifest.to_json())
    hashed = []
    real_hash = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p: hashed.append(Path(p)) or real_hash(p))
    rc, err = run(capsys, "verify", out)
    assert rc == 2 and "a path outside the folder" in one_line(err), err
    assert not [p for p in hashed if "outside" in str(p) or "linked" in str(p)]
    rc, err = run(capsys, "generate", out, "hello")
    assert rc == 2 and "a path outside the folder" in one_line(err), err
    capsys.readouterr()
    fit(ToyTask(), settings(out, max_steps=2, checkpointing_steps=2, overwrite_output_dir=True))
    assert "the files of the earlier model are left" in capsys.readouterr().out
    assert victim.read_text() == "not the run's"


def test_manifest_entries_must_name_a_place_inside_the_folder():
    good = Manifest("model", {"unet/w.safetensors": FileEntry(1, "0" * 64)})
    assert Manifest.from_json(good.to_json()).files == good.files
    for rel in ("../x", "/etc/passwd", "a/../../x", "", "a//b", "./a"):
        with pytest.raises(ValueError, match="outside the folder"):
            Manifest.from_json(Manifest("model", {rel: FileEntry(1, "0" * 64)}).to_json())


# ---------------------------------------------------------------------------------------------------- verify


def test_verify_fails_a_first_final_save_cut_off_before_any_model_file_moved(tmp_path, capsys):
    """Checkpoints sealed, the model sealed in its staging folder, nothing moved yet: verify said ok (exit 0)."""
    out = tmp_path / "run"

    def child():
        die_when(os, "replace", lambda src, dst: STAGING in str(src) and STAGING not in str(dst))
        fit(ToyTask(), settings(out, max_steps=4, checkpointing_steps=2))

    assert in_child(child) == KILLED
    assert (out / STAGING / MANIFEST).is_file() and not (out / MANIFEST).exists()
    rc, err = run(capsys, "verify", out)
    assert rc == 2 and "cut off while its files moved" in one_line(err), err


def test_a_closed_stdout_ends_a_command_quietly(tmp_path):
    """`hf-cgpu verify DIR | head -1`, `hf-cgpu --help | head`: a BrokenPipeError traceback on stderr."""
    out = tmp_path / "run"
    fit(ToyTask(), settings(out, max_steps=4, checkpointing_steps=2))
    for argv in (["--help"], ["verify", str(out)]):
        read, write = os.pipe()
        os.close(read)  # the reader has gone before the first line
        done = subprocess.run([sys.executable, "-m", "hf_cgpu.cli", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
        os.close(write)
        assert done.returncode == 141 and done.stderr == "", (argv, done.stderr)
