"""--push_to_hub end to end through huggingface_hub's real client against a loopback Hub (HF_ENDPOINT), which records
every request; then what was uploaded is loaded back through the Hub client in a fresh process where hf_cgpu cannot
be imported: the GPT with its tokenizer and remote code, the flow pipeline with its pipeline file, the LoRA adapter
on its base."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hub_server import HubServer

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_test_token"

pytestmark = pytest.mark.slow


def env(hub: HubServer, tmp: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN,
            "HF_HOME": str(tmp / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0",
            "HF_CGPU_CACHE": str(tmp / "cache"), "TOKENIZERS_PARALLELISM": "false", **extra}


def train(hub: HubServer, tmp: Path, *argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hf_cgpu.cli", "train", *argv, "--progress", "false"], cwd=tmp,
                          env=env(hub, tmp), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def hub():
    with HubServer(TOKEN) as server:
        yield server


@pytest.fixture(scope="module")
def pushed(hub, tmp_path_factory, synthetic_data, tiny_base):
    tmp = tmp_path_factory.mktemp("push")
    logs = {
        "gpt": train(hub, tmp, "gpt", "--preset", "tiny", "--n_layer", "1", "--n_embd", "32", "--n_head", "2",
                     "--seq_len", "32", "--vocab_size", "300", "--max_steps", "4", "--eval_steps", "2",
                     "--eval_batches", "1", "--checkpointing_steps", "2", "--max_new_tokens", "8",
                     "--output_dir", str(tmp / "gpt"), "--push_to_hub", "--hub_model_id", "tiny-gpt",
                     "--hub_private", "--hub_strategy", "checkpoint"),
        "flow": train(hub, tmp, "flow", "--preset", "tiny", "--dataset", str(synthetic_data), "--max_steps", "2",
                      "--checkpointing_steps", "0", "--sample_steps", "2", "--output_dir", str(tmp / "flow"),
                      "--push_to_hub", "--hub_model_id", "someone/tiny-flow"),
        "lora": train(hub, tmp, "lora", "--model", str(tiny_base), "--base_model_name", "EleutherAI/pythia-14m",
                      "--dataset", "builtin", "--seq_len", "32", "--micro_batch_size", "4",
                      "--gradient_accumulation_steps", "1", "--max_steps", "2", "--eval_steps", "0",
                      "--eval_batches", "1", "--checkpointing_steps", "0", "--lora_r", "4", "--recompute", "false",
                      "--output_dir", str(tmp / "lora"), "--push_to_hub", "--hub_model_id", "tiny-lora"),
    }
    return tmp, logs


def test_push_went_through_the_client_with_the_token(hub, pushed):
    _, logs = pushed
    assert set(hub.repos) >= {"someone/tiny-gpt", "someone/tiny-flow", "someone/tiny-lora"}
    writes = [r for r in hub.requests if r[0] == "POST"]
    assert writes and all(auth == f"Bearer {TOKEN}" for _, _, auth in writes)
    assert [p for m, p, _ in hub.requests if p == "/api/repos/create"] and hub.private["someone/tiny-gpt"]
    assert not hub.private["someone/tiny-flow"]
    assert "push_to_hub: " in logs["gpt"] and "/commit/" in logs["gpt"]
    # created before training: the first request of the GPT run is the repo creation, the commits come after
    gpt_commits = [p for m, p, _ in hub.requests if p.startswith("/api/models/someone/tiny-gpt/commit/")]
    assert len(gpt_commits) >= 2 and len(hub.commits["someone/tiny-gpt"]) == len(gpt_commits)


def test_what_each_repo_holds(hub, pushed):
    gpt, flow, lora = (set(hub.repos[f"someone/tiny-{k}"]) for k in ("gpt", "flow", "lora"))
    assert {"config.json", "model.safetensors", "configuration_cgpt.py", "modeling_cgpt.py", "tokenizer.json",
            "tokenizer_config.json", "README.md", "all_results.json", "training_curves.png"} <= gpt
    assert not any(p.startswith(("checkpoints/", "best/", "tokenizer/")) for p in gpt)  # training state stays local...
    assert any(p.startswith("last-checkpoint/") for p in gpt)  # ...except the latest checkpoint (strategy checkpoint)
    assert {"model_index.json", "pipeline.py", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
            "scheduler/scheduler_config.json", "README.md"} <= flow
    assert any(p.startswith("samples/step_") for p in flow)
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= lora
    assert not any(p.startswith("last-checkpoint/") for p in flow | lora)


def test_cards_carry_metadata_figures_and_the_repo_id(hub, pushed, tmp_path):
    assert len(hub.valid_cards) >= 3 and not hub.invalid_cards  # every README's front matter was checked
    cards = {k: ModelCard(hub.repos[f"someone/tiny-{k}"]["README.md"].decode()) for k in ("gpt", "flow", "lora")}
    for kind, card in cards.items():
        meta = card.data
        assert meta.library_name == {"gpt": "transformers", "flow": "diffusers", "lora": "peft"}[kind]
        assert "hf_cgpu" in meta.tags and meta.license == "apache-2.0"
        results = json.loads(hub.repos[f"someone/tiny-{kind}"]["all_results.json"])
        # model-index: the run's own held-out figures, parsed back by huggingface_hub
        assert meta.eval_results and meta.eval_results[0].metric_value == pytest.approx(results["val_loss"])
        assert "CPU" in card.text and "consumer GPU" not in card.text  # the device it really ran on
        assert f"someone/tiny-{kind}" in card.text  # the loading snippet names the repo, not a local path
        assert "![Training curves" in card.text
    assert cards["lora"].data.base_model == "EleutherAI/pythia-14m"
    assert "kB)" in cards["lora"].text and "a few MB" not in cards["lora"].text  # the adapter's measured size
    assert "![Samples of the saved weights" in cards["flow"].text
    assert "## Continuations" in cards["gpt"].text


LOAD = r"""
import re, sys
class NoHfCgpu:
    def find_spec(self, name, path=None, target=None):
        if name == "hf_cgpu" or name.startswith("hf_cgpu."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
sys.meta_path.insert(0, NoHfCgpu())
try:
    import hf_cgpu
    raise SystemExit("hf_cgpu is importable")
except ModuleNotFoundError:
    pass
from huggingface_hub import hf_hub_download
def snippets(repo):  # the python blocks of the repo's own card, run as a reader would paste them
    text = open(hf_hub_download(repo, "README.md")).read()
    return re.findall(r"```python\s(.*?)```", text, flags=re.S)
exec(snippets("someone/tiny-gpt")[0])  # AutoModelForCausalLM + AutoTokenizer, generate, print
print("gpt", type(model).__name__, out.shape[1] > inputs["input_ids"].shape[1])
exec(snippets("someone/tiny-flow")[1])  # DiffusionPipeline with custom_pipeline, trust_remote_code
images = pipe(batch_size=1, num_inference_steps=2, class_labels=[1], output_type="np").images
print("flow", type(pipe).__name__, images.shape)
from peft import PeftModel
from transformers import AutoModelForCausalLM
base = AutoModelForCausalLM.from_pretrained(sys.argv[1])  # the card's base_model is a Hub id this loopback lacks
lora = PeftModel.from_pretrained(base, "someone/tiny-lora")
print("lora", type(lora).__name__, sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n) > 0)
print("hf_cgpu" in sys.modules)
"""


def test_uploaded_repos_load_in_a_fresh_process_without_hf_cgpu(hub, pushed, tiny_base, tmp_path):
    done = subprocess.run([sys.executable, "-c", LOAD, str(tiny_base)], cwd=tmp_path, stdin=subprocess.DEVNULL,
                          env={**env(hub, tmp_path), "PYTHONPATH": ""}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "[y/N]" not in done.stdout + done.stderr  # the card's snippet never waits for an answer
    lines = [line for line in done.stdout.strip().splitlines() if line.startswith(("gpt ", "flow ", "lora ", "False"))]
    assert lines[0] == "gpt CgptForCausalLM True"
    assert lines[1].startswith("flow FlowMatchPipeline (1, 32, 32, 3)")
    assert lines[2] == "lora PeftModelForCausalLM True"
    assert lines[3] == "False"
    downloads = [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert any(p.endswith("/modeling_cgpt.py") for p in downloads) and any(p.endswith("/pipeline.py") for p in downloads)


def test_push_without_a_token_fails_before_training(hub, tmp_path):
    done = subprocess.run([sys.executable, "-m", "hf_cgpu.cli", "train", "gpt", "--preset", "tiny", "--push_to_hub",
                           "--output_dir", str(tmp_path / "run")], cwd=tmp_path,
                          env={**env(hub, tmp_path), "HF_TOKEN": ""}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: --push_to_hub needs a Hugging Face token")
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


def test_flow2d_pushes_its_table_and_plot(hub, tmp_path):
    """flow2d writes its table and plot after the loop: the push comes after them, not with the loop's end."""
    done = subprocess.run([sys.executable, "-m", "hf_cgpu.cli", "flow2d", "--output_dir", str(tmp_path / "toy"),
                           "--max_steps", "40", "--num_samples", "200", "--nfe_budgets", "2,5", "--push_to_hub",
                           "--hub_model_id", "someone/tiny-flow2d", "--progress", "false"],
                          cwd=tmp_path, env=env(hub, tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    repo = hub.repos["someone/tiny-flow2d"]
    assert "flow2d_samples.png" in repo and "rows" in json.loads(repo["all_results.json"])


def cli(hub: HubServer, tmp: Path, *argv: str) -> str:
    """``hf-cgpu ARGV`` in a child process against the loopback Hub; its output (it must succeed)."""
    done = subprocess.run([sys.executable, "-m", "hf_cgpu.cli", *argv], cwd=tmp, env=env(hub, tmp),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def gguf_lora(hub, tmp_path_factory):
    """A LoRA run on a local GGUF base (a tiny llama written by `hf-cgpu export`, de-quantised by the run into
    hf_cgpu's cache), exported as q8_0 into its gguf/ folder, with a pickle and notes put beside it; pushed twice,
    without and with --include_gguf. Returns (the scratch folder, the run, the two pushes' output)."""
    pytest.importorskip("gguf", reason="a GGUF base needs `pip install gguf`")
    from test_gguf_export import llama_folder

    tmp = tmp_path_factory.mktemp("gguf_lora")
    llama_folder(tmp / "llama")
    cli(hub, tmp, "export", str(tmp / "llama"), "--gguf", "--outtype", "f16", "--output",
        str(tmp / "models" / "tiny.gguf"))
    run = tmp / "run"
    train(hub, tmp, "lora", "--model", str(tmp / "models" / "tiny.gguf"), "--base_model_name", "someone/tiny-llama",
          "--dataset", "builtin", "--seq_len", "32", "--micro_batch_size", "4", "--gradient_accumulation_steps", "1",
          "--max_steps", "2", "--eval_steps", "0", "--eval_batches", "1", "--checkpointing_steps", "0",
          "--lora_r", "4", "--recompute", "false", "--output_dir", str(run))
    cli(hub, tmp, "export", str(run), "--gguf", "--outtype", "q8_0")
    (run / "model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle
    (run / "extra").mkdir()
    (run / "extra" / "notes.txt").write_text("to self")
    said = [cli(hub, tmp, "push", str(run), "someone/tiny-gguf-lora"),
            cli(hub, tmp, "push", str(run), "someone/tiny-gguf-lora-q8", "--include_gguf")]
    return tmp, run, said


def test_a_pushed_gguf_lora_holds_its_sealed_files_and_no_local_path(hub, gguf_lora, tmp_path):
    """Exactly the manifest's files, the manifest and the card; the GGUF only when asked (and sealed by its export);
    no byte of any pushed file names the scratch folder (the run, the cache, the GGUF's folder) or the home folder;
    each repo verifies as uploaded; the adapter names its Hub base; the card says how the base was made."""
    from hf_cgpu.integrity import read_manifest, verify_folder

    tmp, run, said = gguf_lora
    plain, with_gguf = hub.repos["someone/tiny-gguf-lora"], hub.repos["someone/tiny-gguf-lora-q8"]
    sealed = set(read_manifest(run).files)
    assert set(plain) == sealed | {"manifest.json", "README.md"}
    assert set(with_gguf) == set(plain) | {"gguf/run-q8_0.gguf", "gguf/manifest.json"}
    assert with_gguf["gguf/run-q8_0.gguf"] == (run / "gguf" / "run-q8_0.gguf").read_bytes()
    assert ("left out: extra/notes.txt, model.bin (not in manifest.json); gguf/ (2 files) (--include_gguf uploads "
            "what hf-cgpu export wrote)") in said[0]
    assert "left out: extra/notes.txt, model.bin (not in manifest.json)\n" in said[1]
    roots = {str(tmp), str(tmp.resolve()), str(Path.home())}
    for repo in (plain, with_gguf):
        for rel, data in repo.items():
            assert not [root for root in roots if root.encode() in data], rel
    folder = hub.write_repo("someone/tiny-gguf-lora-q8", tmp_path / "repo")
    verify_folder(folder)
    verify_folder(folder / "gguf")
    assert json.loads(plain["adapter_config.json"])["base_model_name_or_path"] == "someone/tiny-llama"
    card = ModelCard(plain["README.md"].decode())
    assert card.data.base_model == "someone/tiny-llama"
    text = " ".join(card.text.split())
    assert "Trained on the weights of the GGUF checkpoint `tiny.gguf` (a file of the machine that trained it)" in text
    assert 'from_pretrained("someone/tiny-llama", dtype="auto")' in text
