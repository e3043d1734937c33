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
