"""The 2D toy: a quick smoke run of its artifacts, and (slow) the full recipe meeting its quality target."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_cgpu.flow.toy2d import mode_centres, mode_stats
from hf_cgpu.settings import TrainSettings, load_preset
from hf_cgpu.tasks.flow_toy2d import Toy2DTask
from hf_cgpu.tasks.settings import Toy2DSettings
from hf_cgpu.train import fit

ROOT = Path(__file__).resolve().parents[1]


def test_mode_stats_closed_form():
    centres = mode_centres(8, 2.0)
    assert torch.allclose(centres[2], torch.tensor([0.0, 2.0]), atol=1e-6)
    samples = torch.cat([centres, centres + 0.5, torch.zeros(1, 2)])  # 8 hits, 9 misses
    stats = mode_stats(samples, centres, 0.3)
    assert abs(stats["within"] - 8 / 17) < 1e-6 and sum(stats["counts"]) == 17


def test_settings_errors():
    with pytest.raises(ValueError, match="comma-separated"):
        Toy2DSettings(nfe_budgets="2;5")
    with pytest.raises(ValueError, match="uniform"):
        Toy2DSettings(time_sampling="cosine")


def test_smoke_run_writes_table_json_and_plot(tmp_path, capsys):
    toy = Toy2DSettings(num_samples=200, nfe_budgets="2,3")
    preset = {k: v for k, v in load_preset("toy", "flow2d").items() if k != "description"}
    train = TrainSettings(**{**preset, "max_steps": 30, "micro_batch_size": 64, "output_dir": str(tmp_path),
                             "progress": False})
    results = fit(Toy2DTask(toy), train)
    assert "euler" in capsys.readouterr().out
    saved = json.loads((tmp_path / "all_results.json").read_text())
    assert [(r["method"], r["nfe"]) for r in saved["rows"]] == [("euler", 2), ("euler", 3), ("heun", 1), ("heun", 3)]
    assert sum(saved["rows"][0]["counts"]) == 200 and saved == json.loads(json.dumps(results))
    assert (tmp_path / "flow2d_samples.png").stat().st_size > 1000


@pytest.mark.slow
def test_recipe_meets_the_target(tmp_path):
    """Defaults: >= 90% within 0.3 at <= 20 network evaluations, every mode 200..300 of 2000 (about 30 s)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "flow2d.py"), "--output_dir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "all_results.json").read_text())["rows"]
    good = [r for r in rows if r["nfe"] <= 20 and r["within"] >= 0.9 and all(200 <= c <= 300 for c in r["counts"])]
    assert good, rows


def test_autoguidance_by_an_early_checkpoint_runs_end_to_end(tmp_path):
    """The run's own step-10 checkpoint guides its final model: "+ag" rows beside the plain ones, at the same budgets,
    a guided call counted twice; a checkpoint that does not exist is a one-line error."""
    early = tmp_path / "checkpoints" / "step_0000010"
    toy = Toy2DSettings(num_samples=200, nfe_budgets="2,5", guidance_model=str(early), guidance_scale=2.0)
    preset = {k: v for k, v in load_preset("toy", "flow2d").items() if k != "description"}
    train = TrainSettings(**{**preset, "max_steps": 40, "micro_batch_size": 64, "output_dir": str(tmp_path),
                             "progress": False, "checkpointing_steps": 10, "checkpoints_total_limit": 10})
    rows = fit(Toy2DTask(toy), train)["rows"]
    assert early.is_dir()
    plain = {(r["method"], r["budget"]): r for r in rows if not r["method"].endswith("+ag")}
    guided = {(r["method"].removesuffix("+ag"), r["budget"]): r for r in rows if r["method"].endswith("+ag")}
    assert guided.keys() == plain.keys()
    assert [(k, r["steps"], r["nfe"]) for k, r in guided.items()] == [
        (("euler", 2), 1, 2), (("euler", 5), 2, 4), (("heun", 2), 1, 2), (("heun", 5), 1, 2)]  # Heun 2 = 3 calls, 6 > 5
    assert all(sum(r["counts"]) == 200 for r in rows)
    assert any(guided[k]["within"] != plain[k]["within"] for k in (("euler", 5), ("heun", 5)))
    pruned = Toy2DSettings(guidance_model=str(tmp_path / "c" / "checkpoints" / "step_0000010"))
    with pytest.raises(ValueError, match="keeps only the checkpoints of steps .30, 40.*--checkpoints_total_limit 4"):
        fit(Toy2DTask(pruned), TrainSettings(**{**train.__dict__, "output_dir": str(tmp_path / "c"),
                                                "checkpoints_total_limit": 2}))  # refused before training
    with pytest.raises(FileNotFoundError, match="guidance_model .*nope does not exist"):  # before training
        fit(Toy2DTask(Toy2DSettings(num_samples=50, nfe_budgets="2", guidance_model=str(tmp_path / "nope"))),
            TrainSettings(**{**preset, "max_steps": 2, "micro_batch_size": 16, "output_dir": str(tmp_path / "b"),
                             "progress": False}))
