"""A resume must rebuild the model and the math its checkpoint was written for. The fingerprint is derived (every field
of the saved model config, the data's hashes, the settings marked FIXED), so each model option and each optimizer
setting below is refused in one line naming it and both values; a test per option fails if its refusal goes.
LayerNorm without bias and RMSNorm both save only ``.weight``, and ReLU^2 has no weights at all: without the
fingerprint those resumes loaded and trained another model."""

from __future__ import annotations

import dataclasses

import pytest

from hf_cgpu.data.corpus import builtin_corpus
from hf_cgpu.data.tokenizer import train_tokenizer
from hf_cgpu.errors import CheckpointError
from hf_cgpu.optim.muon import MuonSettings
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings
from hf_cgpu.train import fit

GPT = dict(n_layer=1, n_embd=32, n_head=2, seq_len=32, loss_chunk_size=0, prompts="a", max_new_tokens=2)
TRAIN = dict(max_steps=2, micro_batch_size=2, warmup_steps=1, eval_steps=0, eval_batches=1, checkpointing_steps=1,
             progress=False, mixed_precision="no")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One finished run with its checkpoints (plain GPT-2 options, AdamW) and Muon's, on a shared tokenizer."""
    root = tmp_path_factory.mktemp("fingerprint")
    tok = train_tokenizer(builtin_corpus()[:40], vocab_size=300, show_progress=False)
    tok.save_pretrained(root / "tok")
    gpt = GPTSettings(**GPT, tokenizer=str(root / "tok"))
    fit(CausalLMTask(gpt), TrainSettings(**TRAIN, output_dir=str(root / "adamw")))
    muon = TrainSettings(**TRAIN, output_dir=str(root / "muon"), optimizer="muon")
    fit(CausalLMTask(gpt), muon)
    return root, gpt


def resume(root, gpt, run="adamw", **changed):
    model = {k: v for k, v in changed.items() if k in {f.name for f in dataclasses.fields(GPTSettings)}}
    train = {k: v for k, v in changed.items() if k not in model}
    base = {"optimizer": "muon"} if run == "muon" else {}
    return fit(CausalLMTask(dataclasses.replace(gpt, **model)),
               TrainSettings(**{**TRAIN, **base, **train, "max_steps": 3, "output_dir": str(root / run),
                                "resume_from_checkpoint": "latest"}))


@pytest.mark.parametrize("option, value, named", [
    ("norm", "rmsnorm", "'model.norm': ('layernorm', 'rmsnorm')"),
    ("activation", "relu2", "'model.activation': ('gelu', 'relu2')"),
    ("position_embedding", "rotary", "'model.position_embedding': ('learned', 'rotary')"),
    ("qk_norm", True, "'model.qk_norm': (False, True)"),
    ("rope_theta", 500.0, "'model.rope_theta': (10000.0, 500.0)"),
    ("tie_word_embeddings", False, "'model.tie_word_embeddings': (True, False)"),
    ("n_layer", 2, "'model.n_layer': (1, 2)"),
    ("n_embd", 64, "'model.n_embd': (32, 64)"),
    ("mlp_ratio", 2, "'model.mlp_ratio': (4, 2)"),
    ("seq_len", 16, "'model.n_positions': (32, 16)"),
    ("bias", True, "'model.bias': (False, True)"),
    ("dropout", 0.1, "'model.dropout': (0.0, 0.1)"),
])
def test_another_model_option_is_refused_naming_both_values(written, option, value, named):
    root, gpt = written
    with pytest.raises(CheckpointError) as err:
        resume(root, gpt, **{option: value})
    message = str(err.value)
    assert named in message and "\n" not in message, message


@pytest.mark.parametrize("changed, named", [
    ({"n_layer": 2, "value_embeddings": 1}, "'model.value_embeddings': (0, 1)"),
    ({"logit_softcap": 15.0}, "'model.logit_softcap': (0.0, 15.0)"),
    ({"n_layer": 2, "unet_skips": True}, "'model.unet_skips': (False, True)"),
    ({"zero_init_head": True, "tie_word_embeddings": False}, "'model.zero_init_head': (False, True)"),
    ({"layer_loops": 2}, "'model.layer_loops': (1, 2)"),
])
def test_another_speedrun_option_is_refused_naming_both_values(written, changed, named):
    """modded-nanogpt's options (some need another option to be valid: both are named)."""
    root, gpt = written
    with pytest.raises(CheckpointError) as err:
        resume(root, gpt, **changed)
    message = str(err.value)
    assert named in message and "\n" not in message, message


@pytest.mark.parametrize("setting, value, named", [
    ("weight_decay", 2.0, "'weight_decay': (0.1, 2.0)"),
    ("adam_beta1", 0.8, "'adam_beta1': (0.9, 0.8)"),
    ("adam_beta2", 0.5, "'adam_beta2': (0.95, 0.5)"),
    ("adam_eps", 1e-6, "'adam_eps': (1e-08, 1e-06)"),
    ("optimizer", "muon", "'optimizer': ('adamw', 'muon')"),
    ("ema_decay", 0.99, "'ema_decay': (0.0, 0.99)"),
    ("seed", 1, "'seed': (0, 1)"),
    ("data_order", "fixed", "'data_order': ('shifted', 'fixed')"),
])
def test_another_optimizer_or_data_setting_is_refused_naming_both_values(written, setting, value, named):
    root, gpt = written
    with pytest.raises(CheckpointError) as err:
        resume(root, gpt, **{setting: value})
    assert named in str(err.value), str(err.value)


def test_muons_own_settings_are_part_of_it(written):
    root, gpt = written
    with pytest.raises(CheckpointError, match=r"'muon_weight_decay': \(0.0, 0.5\)"):
        resume(root, gpt, run="muon", optimizer_options=MuonSettings(muon_weight_decay=0.5))


def test_what_applies_from_the_next_step_may_change(written, capsys):
    """The schedule's length, the learning rate, evaluation and logging are not in the fingerprint: applied on."""
    root, gpt = written
    results = resume(root, gpt, learning_rate=1e-3, log_steps=1, max_grad_norm=0.5)
    assert results["steps"] == 3 and "resumed from" in capsys.readouterr().out


@pytest.mark.parametrize("setting", ["document_masking", "weight_decay", "model.logit_softcap"])
def test_a_checkpoint_older_than_a_setting_resumes_at_its_default_only(written, setting, tmp_path):
    """A checkpoint written before a setting or a model option existed (missing from its fingerprint) was trained as
    its default does: a resume at the default goes on, another value is refused naming it."""
    import json
    import shutil

    root, gpt = written
    copy = tmp_path / "old"
    shutil.copytree(root / "adamw", copy)
    for state_file in copy.glob("checkpoints/*/trainer_state.json"):
        state = json.loads(state_file.read_text())
        del state["fingerprint"][setting]
        state_file.write_text(json.dumps(state))
    for manifest in copy.glob("checkpoints/*/manifest.json"):  # the edit is ours: reseal the checkpoints
        from hf_cgpu.integrity import build_manifest, read_manifest, write_manifest
        old = read_manifest(manifest.parent)
        write_manifest(manifest.parent, build_manifest(manifest.parent, old.kind, **old.meta))
    other = {"document_masking": True, "weight_decay": 0.5, "model.logit_softcap": 15.0}[setting]
    with pytest.raises(CheckpointError, match=f"'{setting}': \\(.*, {other}\\)"):
        resume(tmp_path, gpt, run="old", **{setting.removeprefix("model."): other})
    assert resume(tmp_path, gpt, run="old")["steps"] == 3
