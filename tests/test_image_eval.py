"""Image-generator evaluation: FD / precision-recall math, the classifier (task, save/load), `hf-cgpu eval` end to end.

Everything trains or samples at toy widths on the CPU; a synthetic parquet dataset (ten colour classes) stands in
for CIFAR-10 so the whole chain runs without ../shared, and the CIFAR variant runs when ../shared is there.
"""

import json
import math
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hf_cgpu.cli import main as cli_main
from hf_cgpu.data.images import load_image_dataset, random_crop_on_device
from hf_cgpu.errors import SettingsError
from hf_cgpu.evaluation.classifier import (CifarResNet, ClassifierConfig, file_hash, load_classifier,
                                           save_classifier, to_classifier_input)
from hf_cgpu.evaluation.images import (class_statistics, feature_statistics, frechet_distance,
                                       frechet_distance_of_features, image_features, precision_recall)
from hf_cgpu.evaluation.flow import ImageEvalSettings
from hf_cgpu.flow.samplers import evaluations_per_image, parse_interval, steps_within

ROOT = Path(__file__).resolve().parents[1]
CIFAR = ROOT.parent / "shared" / "data" / "cifar10"


def _run_recipe(name: str, argv: list[str]) -> None:
    main = runpy.run_path(str(ROOT / "recipes" / name))["main"]
    assert main(argv) == 0


def train_tiny_classifier(dataset: Path, out: Path, limit: int = 0, test_limit: int = 0, steps: int = 40) -> Path:
    _run_recipe("train_classifier.py", [
        "--preset", "tiny", "--dataset", str(dataset), "--output_dir", str(out), "--widths", "8,16,32,64",
        "--micro_batch_size", "32", "--max_steps", str(steps), "--limit", str(limit), "--test_limit", str(test_limit),
        "--warmup_steps", "3", "--progress", "false", "--log_steps", "10"])
    return out


@pytest.fixture(scope="module")
def synthetic_classifier(synthetic_data, tmp_path_factory) -> Path:
    return train_tiny_classifier(synthetic_data, tmp_path_factory.mktemp("clf"))


# ----------------------------------------------------------------------------- Fréchet distance
def _random_features(n: int, d: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) * scale
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ mix + torch.randn(d, generator=g, dtype=torch.float64)


def test_fd_of_a_set_with_itself_is_zero():
    for n, d in ((400, 16), (20, 64)):  # the second covariance is rank-deficient (n < d)
        a = _random_features(n, d, seed=n)
        fd = frechet_distance_of_features(a, a)
        assert math.isfinite(fd) and abs(fd) < 1e-6 * torch.trace(feature_statistics(a)[1]).item()


def test_fd_is_symmetric_and_positive():
    a, b = _random_features(300, 24, 1), _random_features(300, 24, 2, scale=2.0)
    ab, ba = frechet_distance_of_features(a, b), frechet_distance_of_features(b, a)
    assert ab > 1.0 and abs(ab - ba) < 1e-9 * ab


def test_fd_matches_closed_forms_of_two_gaussians():
    # 2-D, non-commuting covariances: tr((S1 S2)^1/2) = sqrt(tr(S1 S2) + 2 sqrt(det S1 det S2)).
    mu1, mu2 = torch.tensor([0.5, -1.0]), torch.tensor([2.0, 1.0])
    s1 = torch.tensor([[2.0, 0.8], [0.8, 1.0]], dtype=torch.float64)
    s2 = torch.tensor([[0.5, -0.3], [-0.3, 3.0]], dtype=torch.float64)
    cross = math.sqrt(torch.trace(s1 @ s2) + 2 * math.sqrt(torch.det(s1) * torch.det(s2)))
    expected = float((mu1 - mu2).double().pow(2).sum() + torch.trace(s1) + torch.trace(s2) - 2 * cross)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-10)
    # Diagonal covariances in 50-D: sum (sqrt(a_i) - sqrt(b_i))^2 + |mu1 - mu2|^2.
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(50, generator=g, dtype=torch.float64) + 0.1, torch.rand(50, generator=g, dtype=torch.float64) * 3
    m = torch.randn(50, generator=g, dtype=torch.float64)
    expected = float(((a.sqrt() - b.sqrt()) ** 2).sum() + (m**2).sum())
    assert frechet_distance(m, torch.diag(a), torch.zeros(50), torch.diag(b)) == pytest.approx(expected, rel=1e-10)
    # From samples: the estimated statistics converge to the closed form.
    x = torch.randn(200_000, 2, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(s1).T + mu1
    y = torch.randn(200_000, 2, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(s2).T + mu2
    assert frechet_distance_of_features(x, y) == pytest.approx(frechet_distance(mu1, s1, mu2, s2), rel=0.03)


# ----------------------------------------------------------------------------- precision / recall
def test_precision_recall_identical_far_and_half():
    real = _random_features(200, 8, 3)
    assert precision_recall(real, real.clone(), k=3) == (1.0, 1.0)
    assert precision_recall(real, real + 1e4, k=3) == (0.0, 0.0)
    # Fake = every real point plus as many far ones: half the fakes are on the real manifold (precision 0.5) and
    # every real point has a fake copy (recall 1). Swapping the two definitions would give (1, 0.5).
    precision, recall = precision_recall(real, torch.cat([real, real + 1e4]), k=3)
    assert precision == 0.5 and recall == 1.0


# ----------------------------------------------------------------------------- classes
def test_class_statistics_hand_made():
    out = class_statistics(torch.tensor([0, 0, 1, 2, 2, 2]), 4, requested=torch.tensor([0, 1, 1, 2, 2, 0]))
    assert out["class_histogram"] == [2, 1, 3, 0]
    assert out["class_share_max"] == 0.5 and out["class_share_min"] == 0.0 and out["class_share_uniform"] == 0.25
    assert out["label_accuracy"] == pytest.approx(4 / 6)
    assert class_statistics(torch.tensor([1, 1]), 2)["label_accuracy"] is None


# ----------------------------------------------------------------------------- classifier
def test_input_ranges_are_explicit():
    u8 = torch.tensor([0, 255], dtype=torch.uint8).reshape(1, 1, 1, 2).expand(1, 3, 1, 2)
    assert to_classifier_input(u8).flatten().tolist()[:2] == [-1.0, 1.0]
    unit = u8.float() / 255
    assert torch.equal(to_classifier_input(unit, value_range=(0.0, 1.0)), to_classifier_input(u8))
    with pytest.raises(ValueError, match="value_range"):
        to_classifier_input(u8.float())  # 0..255 floats read as [-1, 1]


def test_classifier_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = CifarResNet(ClassifierConfig(widths=[8, 16, 32, 64], class_names=[f"c{k}" for k in range(10)]))
    for _ in range(3):  # move the BatchNorm statistics away from their initial values
        model(torch.randn(16, 3, 32, 32))
    model.eval().to(memory_format=torch.channels_last)  # as load_classifier returns it: the same conv kernels
    save_classifier(model, tmp_path)
    loaded = load_classifier(tmp_path)
    x = to_classifier_input(torch.rand(5, 3, 32, 32) * 2 - 1)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    assert loaded.config == model.config and not loaded.training
    before = file_hash(tmp_path)
    with torch.no_grad():
        model.head.weight[0, 0] += 1.0
    save_classifier(model, tmp_path)
    assert file_hash(tmp_path) != before
    with pytest.raises(FileNotFoundError, match="train_classifier.py"):
        load_classifier(tmp_path / "missing")


def test_random_crop_is_a_shifted_window_of_the_padded_image():
    x = torch.rand(64, 3, 8, 8)
    out = random_crop_on_device(x, 2, torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(x, (2,) * 4, mode="reflect")
    offsets = []
    for i in range(len(x)):
        found = [(a, b) for a in range(5) for b in range(5) if torch.equal(padded[i, :, a : a + 8, b : b + 8], out[i])]
        assert found, f"image {i} is not a window of its padded self"
        offsets.append(found[0])
    assert len(set(offsets)) > 5
    assert torch.equal(random_crop_on_device(x, 0), x)


def test_classifier_task_learns_and_scores_the_whole_test_split(synthetic_data, synthetic_classifier):
    results = json.loads((synthetic_classifier / "all_results.json").read_text())
    test = load_image_dataset(str(synthetic_data), split="test")
    model = load_classifier(synthetic_classifier)
    _, logits = image_features(model, test.images)
    assert len(test) == 105  # not a multiple of the micro-batch: the padded last batch must count exactly 9 images
    assert results["accuracy"] == (logits.argmax(1) == test.labels).double().mean().item()
    assert results["accuracy"] > 0.5  # ten colours: chance is 0.1


# ----------------------------------------------------------------------------- FD on real/synthetic features
def _fd_same_vs_noise(dataset: Path, classifier_dir: Path) -> tuple[float, float, float, float]:
    model = load_classifier(classifier_dir)
    train = load_image_dataset(str(dataset), split="train", limit=256).images
    test = load_image_dataset(str(dataset), split="test", limit=256).images
    noise = torch.randint(0, 256, test.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    f_train, f_test, f_noise = (image_features(model, x)[0] for x in (train, test, noise))
    p_test, _ = precision_recall(f_train, f_test)
    p_noise, _ = precision_recall(f_train, f_noise)
    return frechet_distance_of_features(f_train, f_test), frechet_distance_of_features(f_train, f_noise), p_test, p_noise


def test_fd_small_for_held_out_images_large_for_noise_synthetic(synthetic_data, synthetic_classifier):
    same, noise, p_same, p_noise = _fd_same_vs_noise(synthetic_data, synthetic_classifier)
    assert 10 * same < noise and p_same > 0.5 > p_noise


@pytest.mark.skipif(not (CIFAR / "train.parquet").is_file(), reason=f"{CIFAR} is not beside the repository")
def test_fd_small_for_held_out_images_large_for_noise_cifar10(tmp_path):
    clf = train_tiny_classifier(CIFAR, tmp_path / "clf", limit=384, test_limit=256, steps=12)
    same, noise, p_same, p_noise = _fd_same_vs_noise(CIFAR, clf)
    assert 10 * same < noise and p_same > p_noise


# ----------------------------------------------------------------------------- hf-cgpu eval end to end
def _tiny_pipeline(folder: Path, num_classes: int | None) -> Path:
    from hf_cgpu.flow.pipeline_flow_match import FlowMatchPipeline
    from hf_cgpu.flow.scheduling_flow_match import FlowMatchEulerScheduler
    from hf_cgpu.flow.unet import FlowUNet2DModel

    torch.manual_seed(0)
    unet = FlowUNet2DModel(sample_size=32, base_channels=8, time_embed_dim=16, num_classes=num_classes)
    FlowMatchPipeline(unet=unet, scheduler=FlowMatchEulerScheduler()).save_pretrained(folder)
    return folder


def _eval(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main(["eval", *argv, "--progress", "false"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_single_evaluation_writes_json_and_grid(tmp_path, synthetic_data, synthetic_classifier, capsys):
    run = _tiny_pipeline(tmp_path / "pipe", num_classes=10)
    common = [str(run), "--classifier", str(synthetic_classifier), "--dataset", str(synthetic_data),
              "--num_images", "20", "--batch_size", "8", "--scheduler", "heun", "--num_inference_steps", "2",
              "--guidance_scale", "1.5", "--cache_dir", str(tmp_path / "feat")]
    victim = tmp_path / "victim.txt"  # the JSON and the grid replace links there, never write through them
    victim.write_text("keep me")
    (run / "eval").mkdir()
    for link in (tmp_path / "a.json", run / "eval" / "grid_saved_heun2_w1.5.png"):
        link.symlink_to(victim)
    rc, out, _ = _eval([*common, "--output_json", str(tmp_path / "a.json")], capsys)
    assert rc == 0 and "FD" in out
    assert victim.read_bytes() == b"keep me" and not (tmp_path / "a.json").is_symlink()
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["weights"] == "saved" and a["num_real"] == 105 and a["split"] == "test"
    assert a["nfe_per_image"] == 2 * (2 * 2 - 1)  # Heun 2 steps = 3 calls, guided = 2 rows each
    assert math.isfinite(a["fd"]) and a["fd"] >= 0 and 0 <= a["precision"] <= 1 and 0 <= a["recall"] <= 1
    assert sum(a["class_histogram"]) == 20 and len(a["class_histogram"]) == 10
    assert f"classes {'/'.join(map(str, a['class_histogram']))} (6 evaluations/image" in out  # the report says it
    assert 0 <= a["label_accuracy"] <= 1 and a["inception_fid"] is None and any("FID" in n for n in a["notes"])
    grid = Image.open(a["grid"])
    assert grid.size == (10 * 34 + 2, 2 * 34 + 2)  # one column per class, 20 images
    cache = Path(a["real_features_cache"])
    stamp = cache.stat().st_mtime_ns

    rc, out, _ = _eval([*common, "--output_json", str(tmp_path / "b.json")], capsys)
    b = json.loads((tmp_path / "b.json").read_text())
    assert rc == 0 and "(cached)" in out and cache.stat().st_mtime_ns == stamp
    assert b["fd"] == a["fd"] and b["class_histogram"] == a["class_histogram"]  # same seed, same result

    rc, _, _ = _eval([*common, "--output_json", str(tmp_path / "c.json"), "--seed", "1"], capsys)
    assert rc == 0 and json.loads((tmp_path / "c.json").read_text())["fd"] != a["fd"]


def test_noise_does_not_depend_on_the_batch_size(tmp_path):
    from hf_cgpu.evaluation.flow import generate_images
    from hf_cgpu.flow.pipeline_flow_match import FlowMatchPipeline

    pipe = FlowMatchPipeline.from_pretrained(_tiny_pipeline(tmp_path / "pipe", num_classes=10))
    kw = dict(num_images=12, scheduler="euler", num_inference_steps=2, guidance_scale=2.0, progress=False)
    a, b = generate_images(pipe, batch_size=12, **kw), generate_images(pipe, batch_size=5, **kw)
    assert (a["images"].int() - b["images"].int()).abs().max() <= 1  # equal up to a rounding flip
    assert a["labels"].tolist() == [i % 10 for i in range(12)] and a["nfe_per_image"] == 4


@pytest.mark.slow
def test_cli_sweep_over_ema_and_raw_weights(tmp_path, synthetic_data, synthetic_classifier, capsys):
    run = tmp_path / "flow"
    _run_recipe("train_flow.py", ["--preset", "tiny", "--dataset", str(synthetic_data), "--output_dir", str(run),
                                  "--base_channels", "8", "--max_steps", "2", "--checkpointing_steps", "1",
                                  "--limit", "64", "--sample_steps", "1", "--progress", "false"])
    rc, out, _ = _eval([str(run), "--classifier", str(synthetic_classifier), "--dataset", str(synthetic_data),
                        "--num_images", "20", "--batch_size", "20", "--sweep", "--sweep_schedulers", "euler,heun",
                        "--sweep_steps", "1,2", "--sweep_guidance", "1,2", "--cache_dir", str(tmp_path / "feat")],
                       capsys)
    assert rc == 0
    rows = json.loads((run / "eval" / "sweep.json").read_text())
    assert len(rows) == 16 and {r["weights"] for r in rows} == {"ema", "raw"}
    for r in rows:  # the UNet rows counted while sampling, against the closed form the sweep plans with
        assert r["nfe_per_image"] == evaluations_per_image(r["scheduler"], r["num_inference_steps"],
                                                           r["guidance_scale"])
    key = lambda r: (r["scheduler"], r["num_inference_steps"], r["guidance_scale"])  # noqa: E731
    ema = {key(r): r["fd"] for r in rows if r["weights"] == "ema"}
    raw = {key(r): r["fd"] for r in rows if r["weights"] == "raw"}
    assert ema.keys() == raw.keys() and all(ema[k] != raw[k] for k in ema)  # two different sets of weights
    table = (run / "eval" / "sweep.md").read_text().splitlines()
    assert len(table) == 2 + 16 and "class_histogram" in table[0]
    for r, line in zip(rows, table[2:]):  # every sampler's row reports its class histogram, on screen and in the table
        assert f"| {'/'.join(map(str, r['class_histogram']))} |" in line and sum(r["class_histogram"]) == 20
        assert f"classes {'/'.join(map(str, r['class_histogram']))} ({r['nfe_per_image']:g} evaluations/image" in out
    assert Image.open(run / "eval" / "sweep.png").size[0] > 100


def test_cli_unconditional_pipeline(tmp_path, synthetic_data, synthetic_classifier, capsys):
    run = _tiny_pipeline(tmp_path / "pipe", num_classes=None)
    common = [str(run), "--classifier", str(synthetic_classifier), "--dataset", str(synthetic_data),
              "--num_images", "10", "--num_inference_steps", "1", "--cache_dir", str(tmp_path / "feat")]
    rc, _, _ = _eval([*common, "--guidance_scale", "1", "--output_json", str(tmp_path / "u.json")], capsys)
    u = json.loads((tmp_path / "u.json").read_text())
    assert rc == 0 and u["label_accuracy"] is None and sum(u["class_histogram"]) == 10
    rc, _, err = _eval([*common, "--guidance_scale", "2"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--guidance_scale 1" in err


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, synthetic_data, synthetic_classifier, capsys):
    run = _tiny_pipeline(tmp_path / "pipe", num_classes=10)
    rc, _, err = _eval([str(run), "--classifier", str(tmp_path / "nope"), "--dataset", str(synthetic_data)], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "train_classifier.py" in err
    rc, _, err = _eval([str(run), "--classifier", str(synthetic_classifier), "--dataset", str(tmp_path / "nodata")],
                       capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--dataset" in err


def test_an_interval_holding_no_call_is_refused_before_anything_is_computed(tmp_path, synthetic_data,
                                                                           synthetic_classifier, capsys):
    """--guidance_interval 0.8:0.95 at 4 Euler steps (t = 0, 0.25, 0.5, 0.75) guided nothing while the report said
    w=2: one line naming the t and the flags, exit 2, before the real features or any file; in a sweep the same for
    the row whose steps miss the interval."""
    run = _tiny_pipeline(tmp_path / "pipe", num_classes=10)
    common = [str(run), "--classifier", str(synthetic_classifier), "--dataset", str(synthetic_data),
              "--num_images", "10", "--scheduler", "euler", "--cache_dir", str(tmp_path / "feat"),
              "--output_dir", str(tmp_path / "eval")]
    rc, _, err = _eval([*common, "--num_inference_steps", "4", "--guidance_scale", "2", "--guidance_interval",
                        "0.8:0.95"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "(t = 0, 0.25, 0.5, 0.75)" in err and "--guidance_interval" in err and "--num_inference_steps" in err
    rc, _, err = _eval([*common, "--sweep", "--sweep_schedulers", "euler", "--sweep_steps", "8,4",
                        "--sweep_guidance", "1,2", "--sweep_guidance_intervals", "0.8:0.95"], capsys)
    assert rc == 2 and "of 4 FlowMatchEulerScheduler steps" in err and "--sweep_steps" in err, err
    assert not (tmp_path / "feat").exists() and not (tmp_path / "eval").exists()


def test_sweep_evaluations_give_each_sampler_the_most_steps_that_fit():
    for scheduler in ("euler", "heun"):
        for scale in (1.0, 2.0):
            for budget in range(1, 61):
                n = steps_within(budget, scheduler, scale)
                fits = [k for k in range(1, 61) if evaluations_per_image(scheduler, k, scale) <= budget]
                assert n == (max(fits) if fits else 1), (scheduler, scale, budget)
    s = ImageEvalSettings(classifier="y", sweep=True, sweep_evaluations="5,10,20,50",
                          sweep_guidance="1,3")
    assert ("heun", 3, 1.0, None) in s.grid and ("heun", 3, 3.0, None) in s.grid  # 5 and 10: 2x3-1, guided x2
    assert ("euler", 50, 1.0, None) in s.grid and ("euler", 25, 3.0, None) in s.grid
    assert ("heun", 13, 3.0, None) in s.grid
    assert len(s.grid) == len(set(s.grid)) == 2 * 4 * 2
    # an interval: Euler 11 steps calls t = k / 11, guided only for k = 3..8 (t in 0.2..0.8): 11 + 6 = 17 evaluations
    # (12 steps: 12 + 7); guidance everywhere: 8 steps, 16
    s = ImageEvalSettings(classifier="y", sweep=True, sweep_schedulers="euler", sweep_evaluations="17",
                          sweep_guidance="1,3", sweep_guidance_intervals="full,0.2:0.8")
    assert s.grid == [("euler", 17, 1.0, None), ("euler", 8, 3.0, None), ("euler", 11, 3.0, (0.2, 0.8))]
    with pytest.raises(SettingsError, match="--sweep_evaluations"):
        ImageEvalSettings(classifier="y", sweep_evaluations="0,5")


@pytest.mark.slow
def test_cli_autoguidance_by_raw_weights_and_an_early_checkpoint(tmp_path, synthetic_data, synthetic_classifier,
                                                                  capsys):
    """`hf-cgpu eval` and `hf-cgpu sample` guided by the run's raw weights and by its step-1 checkpoint: evaluations
    counted from the sampler (a guided call twice), the guide named in the rows; `sample --save_pipeline` writes a
    folder that samples the same images with no flags; a wrong guide is one line and exit 2."""
    run = tmp_path / "flow"
    _run_recipe("train_flow.py", ["--preset", "tiny", "--dataset", str(synthetic_data), "--output_dir", str(run),
                                  "--base_channels", "8", "--max_steps", "3", "--checkpointing_steps", "1",
                                  "--limit", "64", "--sample_steps", "1", "--progress", "false"])
    early = run / "checkpoints" / "step_0000001"
    common = [str(run), "--classifier", str(synthetic_classifier), "--dataset", str(synthetic_data),
              "--num_images", "20", "--batch_size", "20", "--cache_dir", str(tmp_path / "feat")]
    rc, _, _ = _eval([*common, "--sweep", "--sweep_schedulers", "heun", "--sweep_steps", "2",
                      "--sweep_guidance", "1,2", "--sweep_guidance_intervals", "full,0.3:0.8", "--weights", "ema",
                      "--guidance_model", str(early)], capsys)
    rows = json.loads((run / "eval" / "sweep.json").read_text())
    assert rc == 0 and len(rows) == 3
    for r in rows:
        assert r["nfe_per_image"] == evaluations_per_image("heun", 2, r["guidance_scale"],
                                                           parse_interval(r["guidance_interval"]))
        assert r["guidance_model"] == (str(early) if r["guidance_scale"] != 1 else None)  # w = 1: unguided
    assert [r["nfe_per_image"] for r in rows] == [3, 6, 5]  # Heun 2 steps: 3 calls, all or 2 of them guided
    rc, out, _ = _eval([*common, "--scheduler", "euler", "--num_inference_steps", "2", "--guidance_scale", "2",
                        "--guidance_model", "raw", "--output_json", str(tmp_path / "raw.json")], capsys)
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert rc == 0 and raw["guidance_model"] == "raw (step_0000003)" and raw["nfe_per_image"] == 4
    assert "guided by raw" in out
    # the raw weights guided by themselves would be no guidance at twice the cost: a sweep leaves them out, and
    # asking for them is one line
    rc, _, _ = _eval([*common, "--sweep", "--sweep_schedulers", "euler", "--sweep_steps", "1",
                      "--sweep_guidance", "1,2", "--guidance_model", "raw"], capsys)
    rows = json.loads((run / "eval" / "sweep.json").read_text())
    assert rc == 0 and [r["weights"] for r in rows] == ["ema", "ema"]
    assert any("raw weights not scored" in n for n in json.loads((run / "eval" / "sweep_notes.json").read_text())
               ["notes"])
    rc, _, err = _eval([*common, "--weights", "raw", "--guidance_model", "raw"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--weights ema" in err, err
    no_ema = tmp_path / "no_ema"
    _run_recipe("train_flow.py", ["--preset", "tiny", "--dataset", str(synthetic_data), "--output_dir", str(no_ema),
                                  "--base_channels", "8", "--max_steps", "1", "--ema_decay", "0", "--limit", "32",
                                  "--progress", "false"])
    for extra in (["--guidance_scale", "2"], ["--sweep", "--sweep_steps", "1", "--sweep_schedulers", "euler"]):
        rc, _, err = _eval([str(no_ema), *common[1:], "--guidance_model", "raw", *extra], capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "not an EMA" in err, err

    sample = ["sample", str(run), "--num_images", "4", "--class_labels", "0,1", "--num_inference_steps", "2",
              "--guidance_scale", "2", "--guidance_model", "raw"]
    assert cli_main([*sample, "--output_dir", str(tmp_path / "a"), "--save_pipeline", str(tmp_path / "saved")]) == 0
    assert cli_main(["sample", str(tmp_path / "saved"), "--num_images", "4", "--class_labels", "0,1",
                     "--output_dir", str(tmp_path / "b")]) == 0
    assert np.array_equal(np.asarray(Image.open(tmp_path / "a" / "grid.png")),
                          np.asarray(Image.open(tmp_path / "b" / "grid.png")))
    assert cli_main(["sample", str(tmp_path / "saved"), "--num_images", "4", "--class_labels", "0,1",
                     "--guidance_model", "none", "--output_dir", str(tmp_path / "c")]) == 0
    assert not np.array_equal(np.asarray(Image.open(tmp_path / "a" / "grid.png")),
                              np.asarray(Image.open(tmp_path / "c" / "grid.png")))

    other = _tiny_pipeline(tmp_path / "five", num_classes=5)
    unconditional = _tiny_pipeline(tmp_path / "uncond", num_classes=None)
    for guide, words in [(other, "num_classes 5 vs 10"), (tmp_path / "nope", "does not exist"),
                         (unconditional, "num_classes None vs 10")]:
        rc, _, err = _eval([*common, "--guidance_model", str(guide)], capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    rc, _, err = _eval([str(other), *common[1:], "--guidance_model", "raw"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "checkpoint" in err, err
    capsys.readouterr()
    assert cli_main([*sample, "--save_pipeline", str(run)]) == 2
    assert "MODEL_DIR itself" in capsys.readouterr().err


def test_a_guide_loads_quietly_and_a_file_that_is_no_weights_file_is_one_line(tmp_path):
    """A guide folder loads without diffusers' dtype-cast warning (it would sit above a one-line error), and a
    --guidance_model file that is not safetensors weights is a SettingsError naming what to pass, not a traceback."""
    import logging

    from hf_cgpu.flow.guide import guidance_model
    from hf_cgpu.flow.pipeline_flow_match import FlowMatchPipeline

    pipe = FlowMatchPipeline.from_pretrained(_tiny_pipeline(tmp_path / "pipe", num_classes=10))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("diffusers").addHandler(handler)
    try:
        weak, name = guidance_model(str(tmp_path / "pipe"), tmp_path / "pipe", pipe.unet)
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    assert name == str(tmp_path / "pipe") and weak.dtype == pipe.unet.dtype
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
    for bad in (tmp_path / "pipe" / "unet" / "config.json", tmp_path / "pipe" / "model_index.json"):
        with pytest.raises(SettingsError, match="not a safetensors weights file"):
            guidance_model(str(bad), tmp_path / "pipe", pipe.unet)


def test_cli_scores_a_folder_saved_with_a_diffusers_scheduler(tmp_path, synthetic_data, synthetic_classifier, capsys):
    """The pipeline samples with diffusers' flow-match schedulers too; eval takes the folder's own one (it named it
    as if --scheduler had been given, and refused it) and counts the UNet rows it ran."""
    from diffusers import FlowMatchHeunDiscreteScheduler

    from hf_cgpu.flow.pipeline_flow_match import FlowMatchPipeline

    folder = _tiny_pipeline(tmp_path / "pipe", num_classes=10)
    pipe = FlowMatchPipeline.from_pretrained(folder)
    pipe.scheduler = FlowMatchHeunDiscreteScheduler()
    pipe.save_pretrained(folder)
    rc, out, err = _eval([str(folder), "--classifier", str(synthetic_classifier), "--dataset", str(synthetic_data),
                          "--num_images", "10", "--num_inference_steps", "2", "--guidance_scale", "2",
                          "--cache_dir", str(tmp_path / "feat"), "--output_json", str(tmp_path / "d.json")], capsys)
    assert rc == 0, err
    row = json.loads((tmp_path / "d.json").read_text())
    assert row["scheduler"] == "FlowMatchHeunDiscreteScheduler" and row["nfe_per_image"] == 2 * 3  # 2N - 1, guided
