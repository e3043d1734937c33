"""recipes/train_flow.py on a 256-image slice of CIFAR-10 (CPU): a loadable pipeline, and exact resume."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_cgpu import FlowMatchPipeline
from hf_cgpu.train.checkpoint import list_checkpoints

CIFAR = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10"
pytestmark = pytest.mark.skipif(not CIFAR.is_dir(), reason="../shared/data/cifar10 is not beside the repository")


def run(out: Path, *extra: str) -> None:
    import runpy
    import sys

    argv = ["train_flow.py", "--preset", "tiny", "--dataset", str(CIFAR), "--output_dir", str(out),
            "--max_steps", "12", "--checkpointing_steps", "6", "--log_steps", "1", "--progress", "false", *extra]
    old, sys.argv = sys.argv, argv
    try:
        runpy.run_path(str(Path(__file__).resolve().parents[1] / "recipes" / "train_flow.py"), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None)
    finally:
        sys.argv = old


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    run(root / "full")
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


def test_resume_from_mid_run_checkpoint_matches(flow_run, tmp_path):
    full = flow_run / "full"
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for p in list_checkpoints(cut)[1:]:
        shutil.rmtree(p)  # keep only step 6: as if the run had died after it
    for name in ("all_results.json", "history.json", "diffusion_pytorch_model.safetensors"):
        (cut / name).unlink(missing_ok=True)
    run(cut, "--resume_from_checkpoint", "latest")
    a = {h["step"]: h["train/loss"] for h in json.loads((full / "history.json").read_text()) if "train/loss" in h}
    b = {h["step"]: h["train/loss"] for h in json.loads((cut / "history.json").read_text()) if "train/loss" in h}
    assert sorted(b) == list(range(7, 13))
    assert all(a[k] == b[k] for k in b)
    wa = load_file(str(full / "unet" / "diffusion_pytorch_model.safetensors"))
    wb = load_file(str(cut / "unet" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # EMA weights, bit for bit
