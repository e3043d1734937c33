"""Model cards and Hub upload: rendering every template, file filtering, and failing fast without network/token."""

from __future__ import annotations

import hashlib
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
        save_file({f"x.lora_{k}.weight": t for k, t in weights.items()}, str(d / "adapter_model.safetensors"))
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
    assert meta["library_name"] == hub.CARDS[kind].library_name
    assert meta["pipeline_tag"] == hub.CARDS[kind].pipeline_tag
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


@pytest.mark.parametrize("eval_batches", [0, 8])
def test_the_gpt_card_says_how_much_of_the_validation_split_was_scored(tmp_path, eval_batches):
    """--eval_batches N scores N micro-batches of the split, not all of it (the tiny preset sets 8)."""
    d = make_run(tmp_path, "gpt")
    text = hub.render_model_card("gpt", d, settings={"eval_batches": eval_batches, "micro_batch_size": 16})
    text = " ".join(text.split())
    assert ("on the whole held-out validation split (every token scored once)" in text) == (eval_batches == 0)
    if eval_batches:
        assert "on the first 8 micro-batches of the held-out validation split (`--eval_batches`" in text


def test_count_parameters_skips_checkpoints(tmp_path):
    assert hub.count_parameters(make_run(tmp_path, "gpt")) == 205


def test_card_counts_a_tied_gpt_as_num_parameters(tmp_path):
    """The card's count is the model's own, also where the tied head was saved beside the embedding."""
    from safetensors.torch import load_file

    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM

    torch.manual_seed(0)
    model = CgptForCausalLM(CgptConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=16))
    model.save_pretrained(tmp_path)
    expected = model.num_parameters()
    assert hub.count_parameters(tmp_path, "gpt") == expected
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["lm_head.weight"] = weights["transformer.wte.weight"].clone()  # a writer that keeps both tied tensors
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert hub.count_parameters(tmp_path, "gpt") == expected


def test_card_counts_the_adapters_tensors_as_peft_does(tmp_path, neox_dir):
    """Only the adapter's tensors: not the embedding copies peft saves beside them (save_embedding_layers)."""
    from transformers import AutoModelForCausalLM

    from hf_cgpu.tiers import apply_lora

    model = apply_lora(AutoModelForCausalLM.from_pretrained(neox_dir), r=4, alpha=8)
    trainable, _ = model.get_nb_trainable_parameters()
    model.save_pretrained(tmp_path, save_embedding_layers=True)
    assert hub.count_parameters(tmp_path, "lora") == trainable


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
    ])  # tokenizer/ is the run's training copy; the model folder holds the tokenizer the repo loads


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
        hub.push_to_hub(d, "someone/tiny-flow", token="hf_not_a_real_token", allow_unsealed=True)
    msg = str(e.value)
    assert msg.startswith("push to someone/tiny-flow failed") and "\n" not in msg
    assert ModelCard.load(d / "README.md").data.library_name == "diffusers"


def test_push_refuses_missing_directory(tmp_path):
    with pytest.raises(hub.HubError, match="not a directory"):
        hub.push_to_hub(tmp_path / "missing", "someone/x", token="hf_x")


def test_upload_list_is_regular_files_inside_the_folder_only(tmp_path):
    import os

    d = make_run(tmp_path, "gpt")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the Hub")
    (d / "host").symlink_to("/etc/hostname")  # a file link out of the folder
    (d / "inside_link.json").symlink_to(d / "config.json")  # a link inside is a link too: never followed
    (d / "etc").symlink_to("/etc", target_is_directory=True)  # a folder link: not walked
    (d / "secret").symlink_to(secret)
    os.mkfifo(d / "pipe")  # would block a reader
    for hidden in (".hf_cgpu.lock", ".tmp-model/model.safetensors", ".tokenizer.tmp-1/tokenizer.json"):
        (d / hidden).parent.mkdir(parents=True, exist_ok=True)
        (d / hidden).write_text("x")
    assert hub.upload_file_list(d) == ["all_results.json", "config.json", "model.safetensors"]


class FakeApi:
    """Records what a push would send; no network."""

    calls: list = []

    def __init__(self, token=None):
        pass

    def create_repo(self, repo_id, **kw):
        FakeApi.calls.append(("create_repo", repo_id))

    def create_commit(self, repo_id, operations, commit_message, repo_type):
        FakeApi.calls.append(("create_commit", repo_id, operations))
        return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0"})()


def test_push_sends_only_listed_files_and_a_card_for_the_repo(tmp_path, monkeypatch):
    import huggingface_hub

    data = tmp_path / "data" / "zh-poetry"
    data.mkdir(parents=True)
    d = make_run(tmp_path, "gpt")
    results = {**RESULTS, "settings": {"output_dir": str(d), "dataset": str(data), "tokenizer": str(d / "tok"),
                                       "cache_dir": str(tmp_path / "cache"), "learning_rate": 3e-3}}
    (d / "all_results.json").write_text(json.dumps(results))
    hub.render_model_card("gpt", d)  # as training leaves it: loads from the local folder
    assert str(d) in (d / "README.md").read_text()
    (d / "host").symlink_to("/etc/hostname")
    FakeApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    url = hub.push_to_hub(d, "someone/tiny-model", token="hf_x", allow_unsealed=True)  # a folder made by hand
    assert url.endswith("/commit/0")
    (_, repo, operations), = [c for c in FakeApi.calls if c[0] == "create_commit"]
    sent = sorted(op.path_in_repo for op in operations)
    assert sent == ["README.md", "all_results.json", "config.json", "model.safetensors"]
    assert all(isinstance(op.path_or_fileobj, bytes) or Path(op.path_or_fileobj).resolve().is_relative_to(d.resolve())
               for op in operations)  # a file of the folder, or the public copy of one
    card = (d / "README.md").read_text()
    assert 'from_pretrained("someone/tiny-model"' in card and str(tmp_path) not in card
    assert "`output_dir`" not in card and "`cache_dir`" not in card
    assert "| `dataset` | zh-poetry |" in card and "| `tokenizer` | tok |" in card
    hub.push_to_hub(d, "someone/tiny-model", token="hf_x", render_card=False, allow_unsealed=True)  # --keep_card
    assert (d / "README.md").read_text() == card


def test_push_refuses_an_unsealed_folder_unless_told(tmp_path, monkeypatch, capsys):
    """A model folder without its manifest (a final save cut off before it) is never published by default."""
    import huggingface_hub

    from hf_cgpu.hub.push import main

    d = make_run(tmp_path, "gpt")
    FakeApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    with pytest.raises(hub.HubError, match="unsealed, no manifest.json.*--allow_unsealed"):
        hub.push_to_hub(d, "someone/tiny-model", token="hf_x")
    assert FakeApi.calls == []
    assert main([str(d), "someone/tiny-model", "--token", "hf_x", "--allow_unsealed"]) == 0
    assert "has no manifest.json" in capsys.readouterr().out


def test_push_refuses_a_folder_that_fails_its_manifest(tmp_path, monkeypatch):
    import huggingface_hub

    from hf_cgpu.integrity import build_manifest, write_manifest

    d = make_run(tmp_path, "gpt")
    write_manifest(d, build_manifest(d, "model", exclude=("checkpoints",)))
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(data))
    FakeApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    with pytest.raises(hub.HubError, match="refusing to push: .*model.safetensors does not match its checksum"):
        hub.push_to_hub(d, "someone/tiny-model", token="hf_x")
    assert FakeApi.calls == []


@pytest.mark.parametrize("classes", [10, None])
def test_flow_card_samples_as_the_folder_was_saved(tmp_path, classes):
    """The snippet calls the saved sampler (no step count overriding it) with the folder's own class count, and the
    grid's caption says "one row per class" only for a class-conditional model."""
    d = make_run(tmp_path, "flow")
    (d / "model_index.json").write_text(json.dumps({
        "_class_name": "FlowMatchPipeline", "unet": ["unet", "FlowUNet2DModel"], "num_inference_steps": 6,
        "guidance_scale": 2.5, "scheduler": ["hf_cgpu.flow.scheduling_flow_match", "FlowMatchHeunScheduler"]}))
    (d / "unet" / "config.json").write_text(json.dumps({"sample_size": 32, "num_classes": classes}))
    (d / "samples").mkdir()
    (d / "samples" / "step_0000400.png").write_bytes(b"\x89PNG")
    text = hub.render_model_card("flow", d, repo_id="someone/tiny-model")
    if classes:
        assert "pipe(class_labels=list(range(10))).images  # one per class; the saved sampler: " \
               "FlowMatchHeunScheduler, 6 steps, guidance 2.5" in text
        assert "(step 0000400), one row per class]" in text
    else:
        assert "pipe(batch_size=16).images  # the saved sampler: FlowMatchHeunScheduler, 6 steps\n" in text
        assert "(step 0000400)](samples/step_0000400.png)" in text and "class_labels" not in text


def sent_files(operations) -> dict[str, bytes]:
    """What a commit's operations upload, path in the repo -> bytes."""
    return {op.path_in_repo: op.path_or_fileobj if isinstance(op.path_or_fileobj, bytes)
            else Path(op.path_or_fileobj).read_bytes() for op in operations}


def test_push_sends_the_manifests_files_and_the_card_and_names_what_stays(tmp_path, monkeypatch, capsys):
    """A sealed folder sends what its manifest lists, the manifest and the card; a pickle, notes and a GGUF put
    beside them stay local, named in one line; --include_gguf without a GGUF that export sealed is refused."""
    import pickle

    import huggingface_hub

    from hf_cgpu.hub.push import main
    from hf_cgpu.integrity import build_manifest, write_manifest

    d = make_run(tmp_path, "gpt")
    write_manifest(d, build_manifest(d, "model", exclude=("checkpoints",)))
    (d / "model.bin").write_bytes(pickle.dumps({"weights": [1.0]}))
    (d / "extra").mkdir()
    (d / "extra" / "notes.txt").write_text("to self")
    (d / "gguf").mkdir()
    (d / "gguf" / "run-bf16.gguf").write_bytes(b"GGUF")
    FakeApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    assert main([str(d), "someone/tiny-model", "--token", "hf_x"]) == 0
    (_, _, operations), = [c for c in FakeApi.calls if c[0] == "create_commit"]
    assert sorted(sent_files(operations)) == ["README.md", "all_results.json", "config.json", "manifest.json",
                                              "model.safetensors"]
    said = capsys.readouterr().out.splitlines()
    assert said[0] == ("left out: extra/notes.txt, model.bin (not in manifest.json); gguf/run-bf16.gguf "
                       "(--include_gguf uploads what hf-cgpu export wrote)")
    with pytest.raises(hub.HubError, match="--include_gguf: .*gguf holds no manifest.json, so no GGUF that "
                                           "`hf-cgpu export .* --gguf` wrote and checked"):
        hub.push_to_hub(d, "someone/tiny-model", token="hf_x", include_gguf=True)


def lora_run_on_a_local_gguf(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A sealed LoRA run folder as a run on a GGUF base leaves it: adapter_config.json naming the de-quantised copy
    in the cache, base_model.json the GGUF file and that copy, all_results.json the run's settings; with the local
    roots a push must not publish."""
    from hf_cgpu.integrity import build_manifest, write_manifest

    d = make_run(tmp_path, "lora")
    cache = tmp_path / "cache" / "gguf" / "tiny-1234"
    gguf = tmp_path / "models" / "tiny.Q8_0.gguf"
    config = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(cache)}))
    (d / "base_model.json").write_text(json.dumps({"base_model": "someone/tiny-base", "load_from": str(cache),
                                                   "gguf_file": str(gguf), "dequantized_to": str(cache),
                                                   "tier": "lora"}))
    settings = {"model": str(gguf), "output_dir": str(d), "cache_dir": str(tmp_path / "cache"),
                "dataset": str(tmp_path / "data" / "chat"), "learning_rate": 1e-3}
    (d / "all_results.json").write_text(json.dumps({**RESULTS, "settings": settings}))
    (d / "tokenizer_config.json").write_text("{}")
    write_manifest(d, build_manifest(d, "model", exclude=("checkpoints",)))
    return d, [d, tmp_path]


def test_a_pushed_lora_names_no_local_path_and_its_card_says_how_the_base_was_made(tmp_path, monkeypatch):
    """adapter_config.json, base_model.json and all_results.json go up as public copies (the base by its Hub id,
    local-only settings dropped, paths cut to their names) sealed by the manifest that goes with them; the card says
    the base was a de-quantised local GGUF and that the snippet's Hub base is not those weights."""
    import huggingface_hub

    d, roots = lora_run_on_a_local_gguf(tmp_path)
    FakeApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    hub.push_to_hub(d, "someone/tiny-lora", token="hf_x", log=lambda line: None)
    (_, _, operations), = [c for c in FakeApi.calls if c[0] == "create_commit"]
    sent = sent_files(operations)
    for rel, data in sent.items():
        for root in roots:
            assert str(root).encode() not in data, (rel, root)
    assert json.loads(sent["adapter_config.json"])["base_model_name_or_path"] == "someone/tiny-base"
    assert json.loads(sent["base_model.json"]) == {"base_model": "someone/tiny-base", "gguf_file": "tiny.Q8_0.gguf",
                                                   "tier": "lora"}
    settings = json.loads(sent["all_results.json"])["settings"]
    assert settings == {"model": "tiny.Q8_0.gguf", "dataset": "chat", "learning_rate": 1e-3}
    manifest = json.loads(sent["manifest.json"])["files"]
    assert set(manifest) == set(sent) - {"README.md", "manifest.json"}
    for rel, entry in manifest.items():  # the repo verifies as uploaded
        assert entry == {"size": len(sent[rel]), "sha256": hashlib.sha256(sent[rel]).hexdigest()}, rel
    assert json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        tmp_path / "cache" / "gguf" / "tiny-1234")  # the local folder keeps what generate and export load
    card = " ".join(sent["README.md"].decode().split())
    assert ("Trained on the weights of the GGUF checkpoint `tiny.Q8_0.gguf` (a file of the machine that trained it), "
            "de-quantised by transformers. The snippet loads someone/tiny-base, named as the base by "
            "`--base_model_name`: its weights differ from the trained-on ones by the GGUF's quantisation.") in card
    assert 'from_pretrained("someone/tiny-base", dtype="auto")' in card
    assert 'PeftModel.from_pretrained(base, "someone/tiny-lora")' in card
    assert 'AutoTokenizer.from_pretrained("someone/tiny-lora")' in card


@pytest.mark.parametrize("base,snippet", [
    ("someone/tiny-base-GGUF/tiny.Q8_0.gguf",
     'from_pretrained( "someone/tiny-base-GGUF", gguf_file="tiny.Q8_0.gguf", dtype="float32")'),
    ("", 'from_pretrained( "FOLDER_HOLDING_THE_GGUF", gguf_file="tiny.Q8_0.gguf", dtype="float32")'),
])
def test_a_gguf_base_is_loaded_by_the_cards_snippet_as_training_loaded_it(tmp_path, base, snippet):
    """A GGUF of a Hub repo: the snippet de-quantises it from there; a local one with no Hub base given: from a
    folder the reader names."""
    d, _ = lora_run_on_a_local_gguf(tmp_path)
    recorded = json.loads((d / "base_model.json").read_text())
    if base:
        recorded.update(base_model="someone/tiny-base-GGUF", gguf_file=base)
    else:
        recorded["base_model"] = recorded["gguf_file"]  # no --base_model_name: --model, the file itself
    (d / "base_model.json").write_text(json.dumps(recorded))
    text = " ".join(hub.render_model_card("lora", d, repo_id="someone/tiny-lora").split())
    assert snippet in text and str(tmp_path) not in text


def test_push_refuses_a_text_file_that_names_a_local_path(tmp_path, monkeypatch):
    """A path of this machine in a file hf_cgpu does not rewrite (a config saved with its folder) stops the push
    before any request, naming the file."""
    import huggingface_hub

    from hf_cgpu.integrity import build_manifest, write_manifest

    d = make_run(tmp_path, "gpt")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "_name_or_path": str(d.resolve())}))
    write_manifest(d, build_manifest(d, "model", exclude=("checkpoints",)))
    FakeApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    with pytest.raises(hub.HubError, match=f"refusing to push: config.json names {d.resolve()}, a path of this "
                                           "machine"):
        hub.push_to_hub(d, "someone/tiny-model", token="hf_x")
    assert FakeApi.calls == []
