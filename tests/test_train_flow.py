"""recipes/train_flow.py on the synthetic CIFAR-shaped set (CPU, no ../shared): a loadable pipeline saved with the
EMA weights, the EMA sample grid, and exact resume."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from hf_cgpu import FlowMatchPipeline
from hf_cgpu.train.checkpoint import list_checkpoints


def run(out: Path, data: Path, *extra: str) -> None:
    import runpy
    import sys

    argv = ["train_flow.py", "--preset", "tiny", "--dataset", str(data), "--output_dir", str(out),
            "--max_steps", "12", "--checkpointing_steps", "6", "--log_steps", "1", "--progress", "false", *extra]
    old, sys.argv = sys.argv, argv
    try:
        runpy.run_path(str(Path(__file__).resolve().parents[1] / "recipes" / "train_flow.py"), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None)
    finally:
        sys.argv = old


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory, synthetic_data):
    root = tmp_path_factory.mktemp("flow")
    run(root / "full", synthetic_data)
    return root


def test_tiny_run_writes_loadable_pipeline(flow_run):
    out = flow_run / "full"
    results = json.loads((out / "all_results.json").read_text())
    assert results["steps"] == 12 and results["imgs_seen"] == 12 * 16 and results["val_loss"] > 0
    assert (out / "README.md").is_file() and (out / "pipeline.py").is_file()
    pipe = FlowMatchPipeline.from_pretrained(out)
    assert pipe.unet.config.num_classes == 10
    images = pipe(batch_size=2, num_inference_steps=3, class_labels=[1, 2], guidance_scale=2.0,
                  generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (2, 32, 32, 3) and 0 <= images.min() and images.max() <= 1
    grid = Image.open(out / "samples" / "step_0000012.png")  # the final evaluation's grid: 10 classes x 8
    assert grid.size == (8 * 34 + 2, 10 * 34 + 2)
    from hf_cgpu.hub import upload_file_list
    from hf_cgpu.integrity import verify_folder

    assert results["sample_grid"] == "samples/step_0000012.png"  # the card's figure: sealed, so pushed
    assert "samples/step_0000012.png" in verify_folder(out).files and "samples/step_0000012.png" in upload_file_list(
        out)


def test_pipeline_holds_the_ema_weights(flow_run):
    """The saved UNet is the EMA of the weights (tiny preset: ema_decay 0.99), not the last live weights."""
    out = flow_run / "full"
    saved = load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors"))
    last = list_checkpoints(out)[-1]
    ema = load_file(str(last / "ema.safetensors"))
    live = load_file(str(last / "model.safetensors"))
    assert ema.keys() <= saved.keys()
    assert all(torch.equal(saved[k], ema[k]) for k in ema)
    assert any(not torch.equal(saved[k], live[k]) for k in ema)


@pytest.mark.slow
def test_resume_from_mid_run_checkpoint_matches(flow_run, synthetic_data, tmp_path):
    full = flow_run / "full"
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for p in list_checkpoints(cut)[1:]:
        shutil.rmtree(p)  # keep only step 6: as if the run had died after it
    for name in ("all_results.json", "history.json", "diffusion_pytorch_model.safetensors"):
        (cut / name).unlink(missing_ok=True)
    run(cut, synthetic_data, "--resume_from_checkpoint", "latest")
    a = {h["step"]: h["train/loss"] for h in json.loads((full / "history.json").read_text()) if "train/loss" in h}
    b = {h["step"]: h["train/loss"] for h in json.loads((cut / "history.json").read_text()) if "train/loss" in h}
    assert sorted(b) == list(range(1, 13))  # the whole run: steps 1-6 came back from the checkpoint's history
    assert all(a[k] == b[k] for k in b)
    wa = load_file(str(full / "unet" / "diffusion_pytorch_model.safetensors"))
    wb = load_file(str(cut / "unet" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # EMA weights, bit for bit


@pytest.mark.slow
def test_a_flipped_byte_in_the_ema_falls_back_and_ends_identical(flow_run, synthetic_data, tmp_path, capsys):
    """Before issue 10 this resumed silently and published a UNet with a corrupted EMA tensor."""
    full = flow_run / "full"
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    ema = cut / "checkpoints" / "step_0000012" / "ema.safetensors"
    data = bytearray(ema.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, headers intact: only the checksum can tell
    ema.write_bytes(bytes(data))
    run(cut, synthetic_data, "--resume_from_checkpoint", "latest")
    log = capsys.readouterr().out
    assert "step_0000012: ema.safetensors does not match its checksum" in log and "at step 6" in log
    wa = load_file(str(full / "unet" / "diffusion_pytorch_model.safetensors"))
    wb = load_file(str(cut / "unet" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    from hf_cgpu.verify import main as verify

    assert verify([str(cut)]) == 0


def test_bad_sampling_settings_are_one_line_before_training(synthetic_data, tmp_path, capsys):
    """--sample_steps 0 would only fail at the first sample grid (after training), a negative guidance scale would
    be saved as the folder's default, and an interval holding none of the grids' steps would guide nothing: each is
    refused up front, one line, exit 2."""
    from hf_cgpu.cli import main as cli_main

    for flag, value in (("--sample_steps", "0"), ("--guidance_scale", "-1"), ("--guidance_scale", "0"),
                        ("--guidance_interval", "0.8:0.95")):  # no t of the preset's 4 Heun steps: a no-op
        rc = cli_main(["train", "flow", "--preset", "tiny", "--dataset", str(synthetic_data), "--max_steps", "1",
                       "--output_dir", str(tmp_path / "x"), "--progress", "false", flag, value])
        err = capsys.readouterr().err
        assert rc == 2 and flag in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "x" / "all_results.json").exists()
