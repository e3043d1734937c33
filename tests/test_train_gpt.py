"""recipes/train_gpt.py end to end on CPU: artifacts, generation CLI, SIGKILL + resume equals an uninterrupted run."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_cgpu  # noqa: F401  (registers the cgpt model type with the Auto classes)

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--preset", "tiny", "--n_layer", "2", "--n_embd", "64", "--n_head", "4", "--seq_len", "64",
         "--micro_batch_size", "8", "--warmup_steps", "5", "--log_steps", "1", "--eval_batches", "2",
         "--progress", "false", "--max_new_tokens", "12"]


def launch(args, cache, **popen):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--num_machines", "1",
           str(REPO / "recipes" / "train_gpt.py"), *SMALL, "--cache_dir", str(cache), *args]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


def run(args, cache, timeout=600):
    proc = launch(args, cache)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt")
    out = root / "run"
    log = run(["--vocab_size", "512", "--max_steps", "30", "--eval_steps", "15", "--checkpointing_steps", "10",
               "--output_dir", str(out)], root / "cache")
    return out, root / "cache", log


@pytest.mark.slow
def test_recipe_writes_model_results_and_samples(trained):
    out, _, log = trained
    results = json.loads((out / "all_results.json").read_text())
    assert results["steps"] == 30
    assert results["toks_seen"] == 30 * 8 * 64
    assert results["tok_per_s"] > 0 and results["val_loss"] > 0 and results["train_loss"] > 0
    assert len(results["samples"]) == 3 and "--- sample 1" in log
    card = (out / "README.md").read_text()
    assert "hf_cgpu" in card  # model card rendered, with the run's figures and its continuations
    assert f"| `val_bpc` | {results['val_bpc']:.4g} |" in card and results["samples"][0] in card
    assert results["val_tokens"] > 0 and results["best_step"] in (15, 30) and (out / "best" / "config.json").is_file()
    # loss went down from ~ln(512)
    hist = [h for h in json.loads((out / "history.json").read_text()) if "train/loss" in h]
    assert hist[0]["train/loss"] > hist[-1]["train/loss"] + 0.5
    # the gap of the saved weights: their validation loss against the training window that ended at their step
    window = [h for h in hist if h["step"] <= results["model_step"]][-1]
    assert results["train_loss_at_model_step"] == window["train/loss"]
    assert results["val_train_gap"] == pytest.approx(results["val_loss"] - window["train/loss"])
    assert "| `val_train_gap` |" in card
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(tok) and model.config.model_type == "cgpt"
    assert [p.name for p in (out / "checkpoints").iterdir()] and (out / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_saves_inside_the_loop_make_no_library_noise(trained):
    """Checkpoints every 10 steps and best weights at 15 and 30: no transformers shard bar, no accelerate warning
    about the tied head (it is tied on purpose; the loaded model above has it tied again)."""
    out, _, log = trained
    assert "Writing model shards" not in log and "Removed shared tensor" not in log
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


@pytest.mark.slow
def test_generate_cli(trained):
    out, _, _ = trained
    res = subprocess.run([sys.executable, "-m", "hf_cgpu.cli", "generate", str(out), "The", "--max_new_tokens", "8",
                          "--greedy"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("The")


def test_preset_and_cli_precedence():
    from hf_cgpu.settings import TrainSettings, parse_settings
    from hf_cgpu.tasks.causal_lm import GPTSettings

    gpt, train = parse_settings((GPTSettings, TrainSettings), ["--preset", "124m", "--n_layer", "3"], family="gpt")
    assert gpt.n_layer == 3 and gpt.n_embd == 768  # command line beats preset, preset beats default
    assert train.compile is True and train.micro_batch_size == 16
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of"):
        parse_settings((GPTSettings, TrainSettings), ["--preset", "huge"], family="gpt")
    with pytest.raises(ValueError, match="not divisible by n_head"):
        parse_settings((GPTSettings, TrainSettings), ["--n_embd", "100", "--n_head", "3"], family="gpt")


def _losses(out):
    return {h["step"]: h["train/loss"] for h in json.loads((out / "history.json").read_text()) if "train/loss" in h}


@pytest.fixture(scope="module")
def uninterrupted(trained, tmp_path_factory):
    """60 steps with checkpoints every 20, no interruption: what every interrupted run must end as."""
    _, cache, _ = trained
    common = ["--tokenizer", str(trained[0] / "tokenizer"), "--max_steps", "60", "--checkpointing_steps", "20",
              "--eval_steps", "0"]
    full = tmp_path_factory.mktemp("gpt60") / "full"
    run([*common, "--output_dir", str(full)], cache)
    return full, common, cache


def _wait_for(path, proc, seconds=300):
    deadline = time.time() + seconds
    while not path.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert path.exists(), f"the run never wrote {path}"


def _assert_same_run(full, cut):
    full_losses, cut_losses = _losses(full), _losses(cut)
    assert sorted(cut_losses) == list(range(1, 61))  # the history covers the whole run, not the last process
    for step in cut_losses:
        assert cut_losses[step] == full_losses[step], step
    a, b = load_file(str(full / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    results = json.loads((cut / "all_results.json").read_text())
    assert results["train_loss"] == json.loads((full / "all_results.json").read_text())["train_loss"]
    assert results["toks_seen"] == 60 * 8 * 64 and results["tok_per_s"] > 0


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(uninterrupted, tmp_path):
    full, common, cache = uninterrupted
    cut = tmp_path / "cut"
    proc = launch([*common, "--output_dir", str(cut)], cache, start_new_session=True)
    _wait_for(cut / "checkpoints" / "step_0000020" / "manifest.json", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # power cut: no handler runs
    proc.communicate()
    assert not (cut / "all_results.json").exists(), "the run finished before it could be killed"

    log = run([*common, "--output_dir", str(cut), "--resume_from_checkpoint", "latest"], cache)
    assert re.search(r"resumed from \S+step_00000[24]0 at step [24]0", log), log[-2000:]
    _assert_same_run(full, cut)


@pytest.mark.slow
def test_ctrl_c_under_accelerate_launch_names_a_resume_command_that_finishes_the_run(uninterrupted, tmp_path):
    """A terminal's Ctrl-C reaches the launcher and its child: the child ends its step, checkpoints and prints one
    line naming the checkpoint and the launcher's command with --resume_from_checkpoint latest; that command, run
    as printed, ends as the uninterrupted run."""
    full, common, cache = uninterrupted
    cut = tmp_path / "cut"
    proc = launch([*common, "--output_dir", str(cut)], cache, start_new_session=True,
                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for(cut / "checkpoints" / "step_0000020" / "manifest.json", proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    found = re.fullmatch(r"error: interrupted \(Ctrl-C\) at step (\d+); checkpoint (\S+) is kept: resume with: (.+)",
                         errors[0]) if len(errors) == 1 else None
    assert found, out[-3000:]
    step, again = int(found[1]), shlex.split(found[3])
    assert 20 <= step < 60 and Path(found[2]) == cut / "checkpoints" / f"step_{step:07d}"
    assert again[1:3] == ["-m", "accelerate.commands.launch"] and again[-2:] == ["--resume_from_checkpoint", "latest"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, *again[1:]], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and f"at step {step}" in done.stdout, (done.stdout + done.stderr)[-3000:]
    _assert_same_run(full, cut)


@pytest.mark.slow
def test_sigterm_to_the_launcher_reaches_training_which_checkpoints_and_resumes(uninterrupted, tmp_path):
    """`accelerate launch` does not forward SIGTERM; the training child gets it from the kernel when the launcher
    dies (PR_SET_PDEATHSIG), checkpoints, stops in one line, and never trains on orphaned."""
    import psutil

    full, common, cache = uninterrupted
    cut = tmp_path / "cut"
    proc = launch([*common, "--output_dir", str(cut)], cache)
    _wait_for(cut / "checkpoints" / "step_0000020" / "manifest.json", proc)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "accelerate launch runs the script as a child"
    proc.send_signal(signal.SIGTERM)  # to the launcher only, not its process group
    out, _ = proc.communicate(timeout=300)  # EOF once the child, which shares the pipe, has exited too
    for child in children:
        try:
            child.wait(timeout=60)  # raises TimeoutExpired while it still runs
        except psutil.NoSuchProcess:
            pass
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, "the child trains on, orphaned"
    stopped = re.search(r"error: stopped by SIGTERM at step (\d+); checkpoint saved", out)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    assert 20 <= step < 60 and (cut / "checkpoints" / f"step_{step:07d}" / "manifest.json").is_file()
    log = run([*common, "--output_dir", str(cut), "--resume_from_checkpoint", "latest"], cache)
    assert f"at step {step}" in log
    _assert_same_run(full, cut)
