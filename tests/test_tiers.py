"""Memory tiers on tiny local models (CPU): loss equivalence, recompute, optimizers, validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hf_cgpu.models.causal_lm_loss import causal_lm_loss_from_hidden, chunked_causal_lm_loss
from hf_cgpu.optim import build_optimizer
from hf_cgpu.options import TIERS
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tiers import apply_compile, apply_lora, apply_recompute, apply_tiers, count_parameters, load_base_model

from conftest import TINY_VOCAB as VOCAB


def load_fp32(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def batch(b: int = 2, t: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # prompt tokens masked
    return ids, labels


# --- tier validation (once, by the settings) ------------------------------------------------------


def test_validate_tier_accepts_sensible_combinations():
    for tier in TIERS:
        TrainSettings(tier=tier, recompute=True, train_mode="finetune")
    TrainSettings(tier="full", recompute=False, train_mode="pretrain")
    TrainSettings(tier="adamw8bit", recompute=True, train_mode="pretrain")


@pytest.mark.parametrize(
    "tier, recompute, mode, fix",
    [
        ("qlora", True, "pretrain", "use --tier full or --tier adamw8bit for pretraining"),
        ("lora", False, "pretrain", "use --tier full or --tier adamw8bit for pretraining"),
        ("int4", False, "finetune", "full, adamw8bit, lora, qlora"),
        ("full", False, "sft", "pretrain, finetune"),
        ("full", "yes", "finetune", "True or False"),
    ],
)
def test_validate_tier_rejects_with_one_line_fix(tier, recompute, mode, fix):
    with pytest.raises(ValueError) as err:
        TrainSettings(tier=tier, recompute=recompute, train_mode=mode)
    assert fix in str(err.value)
    assert "\n" not in str(err.value)


# --- chunked loss ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("chunk_size", [7, 1024])
def test_chunked_loss_matches_full_cross_entropy(shift, chunk_size):
    torch.manual_seed(0)
    b, t, d = 3, 20, 32
    hidden = torch.randn(b, t, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(VOCAB, d, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (b, t))
    labels[0, :6] = -100
    labels[2, 11:] = -100

    loss = chunked_causal_lm_loss(hidden, weight, labels, chunk_size=chunk_size, shift=shift)
    g_hidden, g_weight = torch.autograd.grad(loss, (hidden, weight))

    logits = (hidden @ weight.T).float()  # (B, T, V) fp32, the reference the chunks must reproduce
    if shift:
        ref = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    else:
        ref = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    r_hidden, r_weight = torch.autograd.grad(ref, (hidden, weight))

    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_hidden.float(), r_hidden.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g_weight.float(), r_weight.float(), atol=1e-6, rtol=1e-5)


def test_chunked_loss_with_head_bias():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(VOCAB, 16, dtype=torch.float64)
    bias = torch.randn(VOCAB, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 9))
    loss = chunked_causal_lm_loss(hidden, weight, labels, chunk_size=4, lm_head_bias=bias)
    ref = F.cross_entropy((hidden[:, :-1] @ weight.T + bias).reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, ref.float(), atol=1e-6, rtol=1e-6)
    g, r = torch.autograd.grad(loss, bias), torch.autograd.grad(ref, bias)
    torch.testing.assert_close(g[0], r[0], atol=1e-6, rtol=1e-5)


def test_chunked_loss_bf16_close_to_fp32_reference():
    torch.manual_seed(0)
    hidden = torch.randn(2, 33, 64)
    weight = torch.randn(VOCAB, 64) * 0.1
    labels = torch.randint(0, VOCAB, (2, 33))
    ref = F.cross_entropy((hidden[:, :-1] @ weight.T).reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    loss = chunked_causal_lm_loss(hidden.bfloat16(), weight.bfloat16(), labels, chunk_size=16)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, atol=2e-2, rtol=1e-2)


def test_chunked_loss_keeps_one_chunk_of_logits_alive():
    """Autograd saves only the chunk inputs: no (tokens, vocab) tensor survives the forward."""
    b, t, d, chunk = 2, 64, 16, 32
    hidden = torch.randn(b, t, d, requires_grad=True)
    weight = torch.randn(VOCAB, d, requires_grad=True)
    labels = torch.randint(0, VOCAB, (b, t))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        loss = chunked_causal_lm_loss(hidden, weight, labels, chunk_size=chunk)
    assert max(saved) <= max(b * t * d, VOCAB * d) < b * t * VOCAB
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None


def test_chunked_loss_num_items_in_batch_sums():
    hidden = torch.randn(2, 8, 16)
    weight = torch.randn(VOCAB, 16)
    labels = torch.randint(0, VOCAB, (2, 8))
    mean = chunked_causal_lm_loss(hidden, weight, labels, chunk_size=5)
    summed = chunked_causal_lm_loss(hidden, weight, labels, chunk_size=5, num_items_in_batch=1)
    torch.testing.assert_close(summed, mean * 14)  # 2 rows x 7 predicted tokens


# --- loss from hidden states on a real transformers model -----------------------------------------


def test_loss_from_hidden_matches_model_loss(neox_dir):
    model = load_fp32(neox_dir)
    ids, labels = batch()
    ref = model(input_ids=ids, labels=labels).loss
    loss = causal_lm_loss_from_hidden(model, ids, labels, chunk_size=5)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)


def test_loss_from_hidden_matches_model_loss_with_lora(neox_dir):
    torch.manual_seed(0)
    model = apply_lora(load_fp32(neox_dir), r=4, alpha=8)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # B = 0 at init would make LoRA a no-op
    ids, labels = batch()
    attention_mask = torch.ones_like(ids)
    attention_mask[1, -3:] = 0
    labels[1, -3:] = -100
    ref = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
    loss = causal_lm_loss_from_hidden(model, ids, labels, attention_mask=attention_mask, chunk_size=8)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)

    g_ref = torch.autograd.grad(ref, [p for p in model.parameters() if p.requires_grad])
    g = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    for a, r in zip(g, g_ref):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)


# --- recompute -------------------------------------------------------------------------------------


def test_recompute_gives_same_gradients(neox_dir):
    ids, labels = batch()
    grads = []
    for recompute in (False, True):
        model = load_fp32(neox_dir)
        model.train()
        if recompute:
            apply_recompute(model)
            assert model.config.use_cache is False
            assert all(layer.gradient_checkpointing for layer in model.gpt_neox.layers)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_recompute_runs_the_checkpoint(neox_dir):
    """from_pretrained returns eval mode; apply_recompute must switch training on or checkpointing is a no-op."""
    model = load_fp32(neox_dir)
    assert not model.training
    apply_recompute(model)
    assert model.training
    ids, labels = batch()
    calls = []
    # A pre-hook on a submodule: the checkpoint replays the layer's forward (not its hooks) and stops
    # early once the last saved tensor is rebuilt, before the last submodule returns.
    mlp = model.gpt_neox.layers[0].mlp
    handle = mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    model(input_ids=ids, labels=labels).loss.backward()
    handle.remove()
    assert len(calls) == 2  # forward + recomputation in backward


def test_apply_tiers_lora_recompute_trains(neox_dir):
    model = AutoModelForCausalLM.from_pretrained(neox_dir, dtype=torch.bfloat16)
    model = apply_tiers(model, TrainSettings(tier="lora", recompute=True, lora_r=4, lora_alpha=8))
    trainable, total = count_parameters(model)
    assert 0 < trainable < total
    ids, labels = batch()
    loss = causal_lm_loss_from_hidden(model, ids, labels)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_apply_compile_in_place_keeps_names(neox_dir):
    model = load_fp32(neox_dir)
    names = list(model.state_dict())
    assert apply_compile(model, enabled=False) is model
    assert apply_compile(model, enabled=True) is model
    assert list(model.state_dict()) == names
    assert model._compiled_call_impl is not None  # a plain model compiles whole: head and loss fuse too
    lora = apply_lora(load_fp32(neox_dir), r=4)
    apply_compile(lora, enabled=True)  # an adapter model compiles block by block
    assert all(layer._compiled_call_impl is not None for layer in lora.base_model.model.gpt_neox.layers)


# --- optimizers and parameter counts ---------------------------------------------------------------


def test_weight_decay_only_on_matrices(neox_dir):
    model = load_fp32(neox_dir)
    opt = build_optimizer(model, TrainSettings(learning_rate=1e-3, weight_decay=0.1))
    by_wd = {g["weight_decay"]: g["params"] for g in opt.param_groups}
    assert all(p.ndim >= 2 for p in by_wd[0.1])
    assert all(p.ndim < 2 for p in by_wd[0.0]) and len(by_wd[0.0]) > 0
    n_opt = sum(len(g["params"]) for g in opt.param_groups)
    assert n_opt == len(list(model.parameters()))
    assert isinstance(opt, torch.optim.AdamW)


def test_adamw8bit_step_on_cpu_changes_only_trainable(neox_dir):
    import bitsandbytes as bnb

    model = load_fp32(neox_dir)
    frozen = model.gpt_neox.embed_in.weight
    frozen.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, TrainSettings(tier="adamw8bit", learning_rate=1e-2))
    assert isinstance(opt, bnb.optim.AdamW8bit)
    ids, labels = batch()
    model(input_ids=ids, labels=labels).loss.backward()
    opt.step()
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == p.requires_grad, name
    big = model.gpt_neox.layers[0].mlp.dense_h_to_4h.weight  # 128 x 64 = 8192 >= 4096 elements
    assert opt.state[big]["state1"].dtype == torch.uint8
    small = model.gpt_neox.layers[0].mlp.dense_h_to_4h.bias  # 128 < 4096: bitsandbytes keeps fp32
    assert opt.state[small]["state1"].dtype == torch.float32


def test_optimizer_without_trainable_parameters_raises(neox_dir):
    model = load_fp32(neox_dir)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="8-bit optimizer got no trainable parameters.*apply LoRA"):
        build_optimizer(model, TrainSettings(tier="adamw8bit", learning_rate=1e-3))
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(model, TrainSettings(learning_rate=1e-3))


def test_count_parameters_counts_4bit_weights_logically(neox_dir):
    full = load_fp32(neox_dir)
    expected = sum(p.numel() for p in full.parameters())
    assert count_parameters(full) == (expected, expected)
    q = load_base_model(str(neox_dir), "qlora")
    trainable, total = count_parameters(q)
    assert (trainable, total) == (0, expected)
    assert sum(p.numel() for p in q.parameters()) < expected  # raw numel undercounts packed weights


def test_load_base_model_lora_is_frozen_bf16(neox_dir):
    model = load_base_model(str(neox_dir), "lora")
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    full = load_base_model(str(neox_dir), "full")
    assert all(p.dtype == torch.float32 and p.requires_grad for p in full.parameters())


def test_apply_tiers_qlora_needs_4bit_base(neox_dir):
    with pytest.raises(ValueError, match="load_base_model"):
        apply_tiers(load_fp32(neox_dir), TrainSettings(tier="qlora"))


def test_a_lora_base_on_a_cpu_without_bf16_arithmetic_is_fp32(neox_dir, monkeypatch):
    """bf16 where the device computes it (a GPU, a CPU with AVX512-BF16 or AMX); fp32 on other CPUs, where each bf16
    matmul is emulated. QLoRA and the full tiers keep their own dtypes."""
    from hf_cgpu.tiers.load import base_dtype

    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False)
    assert load_base_model(str(neox_dir), "lora", device="cpu").dtype == torch.float32
    assert base_dtype("lora", "cuda") == base_dtype("lora") == base_dtype("qlora", "cpu") == torch.bfloat16
    assert base_dtype("full", "cpu") == torch.float32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert load_base_model(str(neox_dir), "lora", device="cpu").dtype == torch.bfloat16
