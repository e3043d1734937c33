"""LoRA and QLoRA tiers on tiny local models (CPU): dtypes, save/load, merge, a 4-bit training run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_cgpu.data.instruct import format_instruction_example
from hf_cgpu.finetune import merge_and_save, save_adapter
from hf_cgpu.models.causal_lm_loss import causal_lm_loss_from_hidden
from hf_cgpu.optim import build_optimizer
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tiers import apply_lora, apply_tiers, count_parameters, default_target_modules, load_base_model

from conftest import TINY_VOCAB as VOCAB


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def randomize_lora_b(model, std: float = 0.2) -> None:
    """LoRA B starts at zero (adapter = no-op); make it non-zero so equality tests can fail."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def ids(b: int = 2, t: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(input_ids=x).logits.float()


# --- target modules and dtypes ---------------------------------------------------------------------


def test_default_target_modules_per_architecture():
    assert default_target_modules("gpt_neox") == ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
    assert default_target_modules("llama")[-1] == "down_proj" and len(default_target_modules("qwen2")) == 7
    assert default_target_modules("gpt2") == ["c_attn", "c_proj", "c_fc"]
    assert default_target_modules("cgpt") == ["qkv", "proj", "fc", "fc_out"]
    assert default_target_modules("something_new") == "all-linear"


@pytest.mark.parametrize("fixture", ["neox_dir", "llama_dir"])
def test_lora_keeps_base_bf16_and_adapters_fp32(fixture, request):
    path = request.getfixturevalue(fixture)
    model = apply_lora(load_base_model(str(path), "lora"), r=4, alpha=8)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    assert all(p.dtype == torch.bfloat16 for p in frozen.values())  # no fp32 upcast of embeddings/head/norms
    n_layers = 2
    n_targets = len(default_target_modules(model.config.model_type))
    assert sum("lora_A" in n for n in trainable) == n_layers * n_targets


# --- save / load / merge ---------------------------------------------------------------------------


def test_adapter_round_trip_gives_identical_logits(neox_dir, tmp_path):
    from peft import PeftModel

    model = apply_lora(AutoModelForCausalLM.from_pretrained(neox_dir, dtype=torch.float32), r=4, alpha=8)
    randomize_lora_b(model)
    x = ids()
    expected = logits(model, x)

    out = save_adapter(model, tmp_path / "adapter")
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()  # adapter only, no base copy
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4

    base = AutoModelForCausalLM.from_pretrained(neox_dir, dtype=torch.float32)
    plain = logits(base, x)
    reloaded = PeftModel.from_pretrained(base, str(out))
    got = logits(reloaded, x)
    assert torch.equal(got, expected)
    assert not torch.allclose(plain, expected, atol=1e-3)  # the adapter does change the output


def test_merge_and_unload_matches_adapter_logits(neox_dir, tmp_path):
    model = apply_lora(AutoModelForCausalLM.from_pretrained(neox_dir, dtype=torch.float32), r=4, alpha=8)
    randomize_lora_b(model)
    x = ids()
    expected = logits(model, x)
    save_adapter(model, tmp_path / "adapter")

    merged_dir = merge_and_save(str(neox_dir), tmp_path / "adapter", tmp_path / "merged", dtype=torch.float32)
    assert (merged_dir / "model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, x), expected, atol=1e-5, rtol=1e-5)


def test_merge_refuses_quantized_dtype(neox_dir, tmp_path):
    with pytest.raises(ValueError, match="not torch.uint8: merging into 4/8-bit"):
        merge_and_save(str(neox_dir), tmp_path, tmp_path / "m", dtype=torch.uint8)


def test_save_adapter_needs_peft_model(neox_dir, tmp_path):
    with pytest.raises(ValueError, match="PeftModel"):
        save_adapter(AutoModelForCausalLM.from_pretrained(neox_dir), tmp_path)


# --- QLoRA on CPU ----------------------------------------------------------------------------------


def test_qlora_trains_on_cpu(neox_dir, tmp_path):
    import bitsandbytes as bnb

    base = load_base_model(str(neox_dir), "qlora")
    linears = [m for m in base.modules() if isinstance(m, torch.nn.Linear)]
    four_bit = [m for m in linears if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 2 * 4 and all(m.weight.quant_state.quant_type == "nf4" for m in four_bit)
    assert base.get_output_embeddings().weight.dtype == torch.bfloat16  # head stays bf16, not 4-bit

    qlora = TrainSettings(tier="qlora", recompute=True, lora_r=8, lora_alpha=16, learning_rate=1e-2, weight_decay=0.0)
    model = apply_tiers(base, qlora)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert not any(p.dtype == torch.float32 for p in model.parameters() if not p.requires_grad)
    trainable, total = count_parameters(model)
    assert 0 < trainable < total

    opt = build_optimizer(model, qlora)
    x = ids(b=4, t=16)
    losses = []
    for _ in range(5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss_from_hidden(model, x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses

    adapter = save_adapter(model, tmp_path / "qlora_adapter")
    assert (adapter / "adapter_model.safetensors").is_file()


def test_qlora_merge_is_into_the_dequantised_nf4_weights_it_was_trained_on(neox_dir, tmp_path):
    """A QLoRA adapter merged into its de-quantised nf4 base computes what the adapter model computed (to bf16
    activation rounding); merged into the bf16 original instead, the nf4 quantisation error comes back."""
    model = apply_lora(load_base_model(str(neox_dir), "qlora"), r=4, alpha=8)
    randomize_lora_b(model)
    x = ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = logits(model, x)
    save_adapter(model, tmp_path / "adapter")
    lines: list[str] = []
    merged = merge_and_save(str(neox_dir), tmp_path / "adapter", tmp_path / "merged", dtype=torch.float32,
                            quantized=True, log=lines.append)
    assert lines == ["a QLoRA adapter: merging into the 4-bit weights it was trained against, de-quantised to float32"]
    merged = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert not any(type(m).__name__ == "Linear4bit" for m in merged.modules())
    naive = merge_and_save(str(neox_dir), tmp_path / "adapter", tmp_path / "naive", dtype=torch.float32)
    naive = AutoModelForCausalLM.from_pretrained(naive, dtype=torch.float32)
    err = (logits(merged, x) - expected).abs().max().item()
    naive_err = (logits(naive, x) - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err < 0.02 * scale and err < naive_err / 4, (err, naive_err, scale)


def test_a_merge_that_rounds_the_update_away_says_so(neox_dir, tmp_path):
    """An update far below bf16's spacing of the weights is lost entirely in a bf16 merge (rounding = 100%), kept
    in fp32; the bf16 merge prints one line naming --merge_dtype float32."""
    from hf_cgpu.finetune import merge_rounding

    model = apply_lora(AutoModelForCausalLM.from_pretrained(neox_dir, dtype=torch.bfloat16), r=4, alpha=8)
    randomize_lora_b(model, std=1e-6)
    assert merge_rounding(model, torch.bfloat16) > 0.99  # all but the updates of weights near zero
    assert merge_rounding(model, torch.float32) < 0.01
    save_adapter(model, tmp_path / "adapter")
    lines: list[str] = []
    merge_and_save(str(neox_dir), tmp_path / "adapter", tmp_path / "m16", dtype=torch.bfloat16, log=lines.append)
    assert lines == [("note: merging into bfloat16 weights rounds away 100% of the adapter's update (its norm); "
                      "--merge_dtype float32 keeps it")]
    lines.clear()
    merge_and_save(str(neox_dir), tmp_path / "adapter", tmp_path / "m32", dtype=torch.float32, log=lines.append)
    assert lines == []


# --- instruction formatting ------------------------------------------------------------------------


def test_format_instruction_example():
    row = format_instruction_example({"instruction": "Add.", "input": "2 3", "output": "5"})
    assert row["text"] == row["prompt"] + row["response"]
    assert "### Input:\n2 3" in row["prompt"] and row["prompt"].endswith("### Response:\n")
    assert row["response"] == "5"
    no_input = format_instruction_example({"instruction": "Say hi.", "input": "", "output": "hi"})
    assert "### Input" not in no_input["prompt"]
    pr = format_instruction_example({"prompt": "Why?", "response": "Because."})
    assert pr["text"].endswith("Because.") and "Why?" in pr["prompt"]
    with pytest.raises(ValueError, match="instruction/output"):
        format_instruction_example({"question": "?"})


# --- an adapter folder as a model: hf-cgpu eval / generate ----------------------------------------------


def test_eval_and_generate_load_an_adapter_folder_on_its_base(tiny_base, tmp_path):
    """A LoRA run's output_dir has adapter_config.json and no config.json: the loaders put the adapter on the base
    it names, so eval scores the adapted model (not the base, not a refusal) and reads the base's tokenizer where the
    folder has none; a base that is gone is a one-line error naming it."""
    from hf_cgpu.errors import MissingPathError
    from hf_cgpu.evaluation.text import evaluate_language_model
    from hf_cgpu.generate import load_causal_lm

    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32), r=4, alpha=8)
    randomize_lora_b(model)
    adapter = save_adapter(model, tmp_path / "adapter")
    assert not (adapter / "config.json").exists() and not (adapter / "tokenizer.json").exists()
    tok, loaded = load_causal_lm(str(adapter))
    x = ids()
    assert torch.equal(logits(loaded, x), logits(model, x))
    assert tok.get_vocab() == load_causal_lm(str(tiny_base))[0].get_vocab()

    merged = merge_and_save(str(tiny_base), adapter, tmp_path / "merged", dtype=torch.float32)
    tok.save_pretrained(merged)
    kw = dict(dataset="builtin", seq_len=32, max_windows=4, device="cpu", progress=False)
    got, want = evaluate_language_model(str(adapter), **kw), evaluate_language_model(str(merged), **kw)
    base = evaluate_language_model(str(tiny_base), **kw)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-4) and got["tokens"] == want["tokens"]
    assert abs(got["loss"] - base["loss"]) > 1e-3  # the adapter is applied, not skipped

    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "deleted_base")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(MissingPathError, match="base model .*deleted_base is gone"):
        load_causal_lm(str(adapter))
