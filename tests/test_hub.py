"""Model cards and Hub upload: rendering every template, file filtering, and failing fast without network/token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import save_file

from hf_cgpu import hub

RESULTS = {"steps": 400, "toks_seen": 819_200, "train_loss": 3.2117, "val_loss": 3.4567, "tok_per_s": 12345.6,
           "mfu": None, "mixed_precision": "bf16"}


def make_run(tmp_path: Path, kind: str) -> Path:
    """A minimal finished output directory of each kind, with a checkpoint folder that must never be uploaded."""
    d = tmp_path / f"run-{kind}"
    d.mkdir()
    (d / "all_results.json").write_text(json.dumps(RESULTS))
    weights = {"a": torch.zeros(10, 20), "b": torch.zeros(5)}  # 205 parameters
    if kind == "gpt":
        (d / "config.json").write_text(json.dumps({"model_type": "cgpt", "n_layer": 4, "n_embd": 128,
                                                   "architectures": ["CgptForCausalLM"]}))
        save_file(weights, str(d / "model.safetensors"))
    elif kind == "flow":
        (d / "model_index.json").write_text(json.dumps({"_class_name": "FlowMatchPipeline",
                                                        "unet": ["unet", "FlowUNet2DModel"]}))
        (d / "unet").mkdir()
        (d / "unet" / "config.json").write_text(json.dumps({"base_channels": 64, "sample_size": 32}))
        save_file(weights, str(d / "unet" / "diffusion_pytorch_model.safetensors"))
    else:
        (d / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "EleutherAI/pythia-1.4b",
                                                          "r": 16, "lora_alpha": 32, "peft_type": "LORA"}))
        save_file(weights, str(d / "adapter_model.safetensors"))
    (d / "checkpoints" / "step_100").mkdir(parents=True)
    save_file({"big": torch.zeros(1000)}, str(d / "checkpoints" / "step_100" / "model.safetensors"))
    return d


@pytest.mark.parametrize("kind", ["gpt", "flow", "lora"])
def test_every_template_renders_with_valid_front_matter_and_numbers(tmp_path, kind):
    d = make_run(tmp_path, kind)
    text = hub.render_model_card(kind, d, repo_id="someone/tiny-model", dataset="uoft-cs/cifar10",
                                 settings={"learning_rate": 3e-3, "seq_len": 128})
    assert (d / "README.md").read_text(encoding="utf-8") == text
    card = ModelCard.load(d / "README.md")
    meta = card.data.to_dict()
    assert meta["library_name"] == hub.KINDS[kind]["library_name"]
    assert meta["pipeline_tag"] == hub.KINDS[kind]["pipeline_tag"]
    assert meta["tags"][:2] == ["hf_cgpu", kind] and meta["license"] == "apache-2.0"
    assert meta["datasets"] == ["uoft-cs/cifar10"]
    assert yaml.safe_load(text.split("---")[1]) == meta
    if kind == "lora":
        assert meta["base_model"] == "EleutherAI/pythia-1.4b" and "PeftModel.from_pretrained" in text
    else:
        assert "base_model" not in meta
    loader = {"gpt": "AutoModelForCausalLM.from_pretrained(\"someone/tiny-model\", trust_remote_code=True)",
              "flow": "FlowMatchPipeline.from_pretrained(\"someone/tiny-model\")",
              "lora": "PeftModel.from_pretrained(base, \"someone/tiny-model\")"}[kind]
    assert loader in text
    for number in ("400", "819,200", "3.212", "3.457", "12,346", "0.003", "bf16"):
        assert number in text
    assert ("205 adapter parameters" if kind == "lora" else "205 parameters") in text  # counted from the safetensors header, not checkpoints
    assert "## Limitations" in text and "{{" not in text


def test_card_without_results_or_hub_dataset(tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    (d / "config.json").write_text("{}")
    text = hub.render_model_card("gpt", d, dataset=str(tmp_path))
    assert "datasets" not in ModelCard.load(d / "README.md").data.to_dict()  # a local path is no Hub dataset
    assert "No `all_results.json`" in text


def test_count_parameters_skips_checkpoints(tmp_path):
    assert hub.count_parameters(make_run(tmp_path, "gpt")) == 205


def test_detect_kind(tmp_path):
    assert [hub.detect_kind(make_run(tmp_path, k)) for k in ("gpt", "flow", "lora")] == ["gpt", "flow", "lora"]
    with pytest.raises(hub.HubError, match="output_dir"):
        hub.detect_kind(tmp_path)


def test_templates_found_in_checkout_and_by_env(tmp_path, monkeypatch):
    repo_cards = Path(__file__).resolve().parents[1] / "model_cards"
    assert hub.template_dir() == repo_cards
    assert {p.name for p in repo_cards.glob("*.md")} >= {"gpt.md", "flow.md", "lora.md"}
    (tmp_path / "gpt.md").write_text("---\n{{ card_data }}\n---\ncustom {{ summary }}")
    monkeypatch.setenv("HF_CGPU_MODEL_CARDS", str(tmp_path))
    assert hub.template_dir() == tmp_path


def test_upload_file_list_skips_checkpoints_and_caches(tmp_path):
    d = make_run(tmp_path, "gpt")
    for rel in ("sub/checkpoints/x.bin", "__pycache__/m.cpython-311.pyc", "runs/events.out", "checkpoints_notes.txt",
                "tokenizer/tokenizer.json", "model.safetensors.tmp"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text("x")
    assert hub.upload_file_list(d) == sorted([
        "all_results.json", "checkpoints_notes.txt", "config.json", "model.safetensors", "runs/events.out",
        "tokenizer/tokenizer.json",
    ])


def test_push_without_token_fails_at_once_with_one_line(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # as on a machine never logged in
    d = make_run(tmp_path, "gpt")
    with pytest.raises(hub.HubError) as e:
        hub.push_to_hub(d, "someone/tiny-model")
    assert "hf auth login" in str(e.value) and "\n" not in str(e.value)
    from hf_cgpu.cli import main

    assert main(["push", str(d), "someone/tiny-model", "--private"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "hf auth login" in err and err.count("\n") == 1


def test_push_without_network_fails_with_one_line_after_rendering_the_card(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no request leaves the machine
    d = make_run(tmp_path, "flow")
    with pytest.raises(hub.HubError) as e:
        hub.push_to_hub(d, "someone/tiny-flow", token="hf_not_a_real_token")
    msg = str(e.value)
    assert msg.startswith("push to someone/tiny-flow failed") and "\n" not in msg
    assert ModelCard.load(d / "README.md").data.library_name == "diffusers"


def test_push_refuses_missing_directory(tmp_path):
    with pytest.raises(hub.HubError, match="not a directory"):
        hub.push_to_hub(tmp_path / "missing", "someone/x", token="hf_x")
