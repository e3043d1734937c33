"""Closed-form and contract tests of the memory and time ledger (CPU only, no timing, no network)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from hf_cgpu import budget
from hf_cgpu.commands.budget import preset_shape
from hf_cgpu.budget import (
    GiB,
    LADDER,
    ModelShape,
    TrainSetup,
    autofit,
    flops_per_token,
    layer_activation_bytes_per_token,
    ledger,
    lora_trainable_params,
    parse_memory,
    training_hours,
)
from hf_cgpu.cli import main as cli_main
from hf_cgpu.errors import SettingsError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "memory"))
from peers import seed_activation_bytes, seed_model_state_bytes, stock_ledger  # noqa: E402  (the benchmark's peers)

GPT_PRESETS = ("tiny", "30m", "124m", "350m", "770m")


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


# ---- the seed's closed forms ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("params, gib", [(350e6, 5.2), (770e6, 11.5), (1.4e9, 20.9)])
def test_seed_16_bytes_per_param(params, gib):
    # bf16 weights 2 + bf16 grads 2 + fp32 master 4 + Adam m, v 8; the seed's "GB" is GiB
    assert round(seed_model_state_bytes(params) / GiB, 1) == gib


def test_full_tier_states_are_16_bytes_per_param():
    shape = preset_shape("124m")
    st = budget.model_state_bytes(shape, TrainSetup())
    assert st.weights + st.gradients + st.master + st.optimizer == 16 * shape.n_params
    # fp32 weights 4 + fp32 grads 4 + Adam 8, plus bf16 autocast copies of matmul weights
    assert (st.weights, st.gradients, st.master) == (4 * shape.n_params, 4 * shape.n_params, 0)
    assert st.autocast_copies == 2 * shape.n_matmul_params


@pytest.mark.parametrize(
    "layers, d, full, recomputed", [(12, 768, 2.4, 0.1), (24, 1024, 6.4, 0.4)]  # the seed's 124M and 350M rows
)
def test_seed_activation_rule(layers, d, full, recomputed):
    a_full = seed_activation_bytes(layers, d, 1024, 8, recompute=False)
    a_rc = seed_activation_bytes(layers, d, 1024, 8, recompute=True)
    assert a_full == layers * 1024 * 8 * 34 * d and a_rc == layers * 1024 * 8 * 2 * d
    assert (round(a_full / GiB, 1), round(a_rc / GiB, 1)) == (full, recomputed)
    assert a_full / a_rc == 17


@pytest.mark.parametrize("params, tflops, hours", [(30e6, 60, 0.5), (124e6, 90, 5.7), (350e6, 110, 37.1)])
def test_seed_time_table(params, tflops, hours):
    # the seed: Chinchilla 20 tokens/param, 6 Psi FLOPs/token, "effective" TFLOP/s (peak x MFU already applied)
    tokens = budget.chinchilla_tokens(params)
    assert round(training_hours(tokens, 6 * params, tflops, mfu=1.0), 1) == hours


# ---- parameter counts -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GPT_PRESETS)
def test_gpt_preset_count_closed_form(name):
    s = preset_shape(name)
    d, L, V, P = s.d_model, s.n_layer, s.vocab_size, s.n_positions
    # tied embeddings, learned positions, no biases, 4d MLP: per block 12 d^2 weights + two LayerNorm gains
    assert s.n_params == V * d + P * d + L * (12 * d * d + 2 * d) + d


@pytest.mark.parametrize("name", GPT_PRESETS)
def test_preset_shape_is_the_model_training_builds(name):
    from hf_cgpu.models.cgpt import CgptForCausalLM
    from hf_cgpu.settings import load_preset
    from hf_cgpu.tasks.causal_lm import GPTSettings

    preset = load_preset(name, "gpt")
    gpt = GPTSettings(**{k: v for k, v in preset.items() if k in GPTSettings.__dataclass_fields__})
    config = gpt.model_config(gpt.vocab_size, eos_token_id=0)
    with torch.device("meta"):
        model = CgptForCausalLM(config)
    shape = preset_shape(name)
    assert shape == ModelShape.from_config(config, name) and shape.n_params == count_params(model)
    assert (shape.n_layer, shape.d_model, shape.n_head, shape.vocab_size) == (
        preset["n_layer"], preset["n_embd"], preset["n_head"], preset["vocab_size"])


def test_tiny_matches_transformers_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    tiny = preset_shape("tiny")
    cfg = GPT2Config(n_layer=tiny.n_layer, n_embd=tiny.d_model, n_head=tiny.n_head, vocab_size=tiny.vocab_size,
                     n_positions=tiny.n_positions)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
    assert tiny.n_params == count_params(model) - biases  # GPT-2 has biases in every linear and LayerNorm
    with_bias = ModelShape.from_config(cfg.to_dict())
    assert with_bias.bias and with_bias.n_params == count_params(model)


def test_tiny_matches_hf_cgpu_gpt():
    cgpt = pytest.importorskip("hf_cgpu.models.cgpt")
    tiny = preset_shape("tiny")
    cfg = cgpt.CgptConfig(n_layer=tiny.n_layer, n_embd=tiny.d_model, n_head=tiny.n_head, vocab_size=tiny.vocab_size,
                          n_positions=tiny.n_positions)
    with torch.device("meta"):
        model = cgpt.CgptForCausalLM(cfg)
    assert tiny.n_params == count_params(model)
    assert ModelShape.from_config(cfg.to_dict()).n_params == count_params(model)


def _neox_config(**kw):
    from transformers import GPTNeoXConfig

    base = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, intermediate_size=8192,
                vocab_size=50304, tie_word_embeddings=False)
    return GPTNeoXConfig(**{**base, **kw})


def test_pythia_shape_matches_gptneox_on_meta():
    from transformers import GPTNeoXForCausalLM

    cfg = _neox_config()
    with torch.device("meta"):
        model = GPTNeoXForCausalLM(cfg)
    shape = preset_shape("pythia-1.4b")
    assert shape.n_params == count_params(model) == ModelShape.from_config(cfg.to_dict()).n_params
    assert 1.40e9 < shape.n_params < 1.42e9


@pytest.mark.parametrize("head_dim, kv_dim", [(None, 64), (48, 96)])  # 48: a head wider than d / heads (Qwen3)
def test_llama_config_with_gqa_matches_transformers(head_dim, kv_dim):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=688, vocab_size=1000, head_dim=head_dim)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    shape = ModelShape.from_config(cfg.to_dict())
    assert (shape.family, shape.kv_dim) == ("llama", kv_dim)
    assert shape.n_params == count_params(model)


# ---- LoRA counts against peft ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", ["all-linear", ["query_key_value"], ["dense", "dense_4h_to_h"]])
def test_lora_count_matches_peft_gptneox(targets):
    from peft import LoraConfig, get_peft_model
    from transformers import GPTNeoXForCausalLM

    cfg = _neox_config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                       vocab_size=512)
    model = get_peft_model(GPTNeoXForCausalLM(cfg), LoraConfig(r=16, target_modules=targets, task_type="CAUSAL_LM"))
    shape = ModelShape.from_config(cfg.to_dict())
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    assert lora_trainable_params(shape, 16, names) == model.get_nb_trainable_parameters()[0]


def test_lora_count_matches_peft_llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=176, vocab_size=256)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    shape = ModelShape.from_config(cfg.to_dict())
    assert lora_trainable_params(shape, 8) == model.get_nb_trainable_parameters()[0]


def test_lora_and_qlora_states():
    shape = preset_shape("pythia-1.4b")
    n_lora = lora_trainable_params(shape, 16)
    assert n_lora == 24 * 16 * ((2048 + 3 * 2048) + (2048 + 2048) + 2 * (2048 + 8192))  # 12.6M
    lora = budget.model_state_bytes(shape, TrainSetup(tier="lora"))
    assert lora.weights == 2 * shape.n_params + 4 * n_lora  # frozen bf16 base + fp32 adapters
    assert (lora.gradients, lora.optimizer, lora.master) == (4 * n_lora, 8 * n_lora, 0)
    q = shape.n_block_linear_params
    qlora = budget.model_state_bytes(shape, TrainSetup(tier="qlora"))
    # nf4 codes 0.5 B + double-quantized scales (8 bits per 64 weights + fp32 per 256 blocks), as the tier loads it
    assert qlora.weights == pytest.approx((0.5 + 1 / 64 + 4 / (64 * 256)) * q + 2 * (shape.n_params - q) + 4 * n_lora)
    assert budget.memory.nf4_bytes_per_param(False) == 0.5 + 4 / 64


def test_adamw8bit_keeps_small_tensors_in_32_bit():
    from hf_cgpu.optim.adamw import adamw8bit_state_bytes

    assert adamw8bit_state_bytes([4095]) == 8 * 4095
    assert adamw8bit_state_bytes([4096]) == 2 * 4096 + 2 * 4 * (4096 // 256)


# ---- activations ----------------------------------------------------------------------------------------------------


def test_structural_activations_per_layer():
    s = preset_shape("350m")
    d, H = s.d_model, s.n_head
    lse = 4 * H
    # AMP (fp32 residual): LayerNorm inputs 8 + linear inputs 12 + q, k, v, out 8 + GELU input 8 = 36 d
    assert layer_activation_bytes_per_token(s, TrainSetup()) == 36 * d + lse
    # eager attention saves the fp32 softmax and its bf16 copy per head and key
    eager = layer_activation_bytes_per_token(dataclasses.replace(s, attention="eager"), TrainSetup(seq_len=1024))
    assert eager - (36 * d + lse) == 6 * H * 1024 - lse


def test_mlp_width_scales_activations():
    narrow = ModelShape(4, 512, 8, 1000, n_positions=128)
    wide = ModelShape(4, 512, 8, 1000, n_positions=128, d_ff=8 * 512)
    # per extra unit of d_ff: fc_out's bf16 input (2) + the GELU input (2)
    per_token = layer_activation_bytes_per_token
    delta = per_token(wide, TrainSetup()) - per_token(narrow, TrainSetup())
    assert delta == 4 * (wide.d_ff - narrow.d_ff)


def test_recompute_keeps_block_inputs_and_one_block():
    s = preset_shape("350m")
    tokens = 8 * 1024
    led = ledger(s, micro_batch_size=8, recompute=True)
    outside = budget.outside_blocks_bytes_per_token(s, led.setup) * tokens
    assert led.row("activations") == s.n_layer * 4 * s.d_model * tokens + outside  # fp32 residual per block
    assert led.row("recompute_layer") == layer_activation_bytes_per_token(s, led.setup) * tokens
    assert led.row("overlap") == -min(led.row("logits"), led.row("recompute_layer"))


def test_chunked_loss_holds_one_chunk():
    s = preset_shape("124m")
    chunked = ledger(s, micro_batch_size=8, loss_chunk_size=1024).row("logits")
    full = ledger(s, micro_batch_size=8, loss_chunk_size=0).row("logits")
    assert chunked == budget.LOGITS_CHUNK_BYTES * 1024 * 32000
    assert full == budget.LOGITS_EAGER_BYTES * 8 * 1024 * 32000  # model(...).loss: the output object is dropped
    assert chunked <= full / 6  # 16 B x 1024 tokens vs 12 B x 8192 tokens


def test_held_logits_add_their_dtype():
    s = preset_shape("124m")
    held = ledger(s, micro_batch_size=8, loss_chunk_size=0, logits_held=True).row("logits")
    assert held == (budget.LOGITS_EAGER_BYTES + 2) * 8 * 1024 * 32000  # + the bf16 logits a kept output holds


# ---- the ledger -----------------------------------------------------------------------------------------------------


def test_rows_add_up_to_the_peak():
    s = preset_shape("350m")
    led = ledger(s, micro_batch_size=8, gradient_accumulation_steps=4, memory_cap=16 * GiB)
    assert led.peak_phase == "backward start"
    assert led.allocated == pytest.approx(sum(r.bytes for r in led.rows))
    assert led.total == pytest.approx(led.allocated * (1 + budget.FRAGMENTATION_FRACTION) + budget.CUDA_CONTEXT_BYTES)
    assert led.row("gradients") == 4 * s.n_params  # accumulation keeps them alive through forward and backward
    assert ledger(s, micro_batch_size=8, gradient_accumulation_steps=1).row("gradients") == 0
    d = led.as_dict()
    assert {"weights", "activations", "logits", "allocated", "reserved", "total"} <= set(d)


def test_ema_adds_an_fp32_copy_of_the_trainable_weights():
    """--ema_decay keeps an fp32 shadow of every trainable weight all run (measured on an H200, zh-poetry-modern:
    8.07 GiB allocated without it, 8.42 with it; benchmarks/RESULTS.md), on the preset's shape of then: no value
    embeddings or skips."""
    s = dataclasses.replace(preset_shape("zh-poetry-modern"), value_embeddings=0, unet_skips=False)
    plain, ema = ledger(s, micro_batch_size=32), ledger(s, micro_batch_size=32, ema_decay=0.999)
    assert plain.row("ema") == 0
    assert ema.row("ema") == 4 * s.n_params
    assert ema.allocated - plain.allocated == pytest.approx(4 * s.n_params)
    lora = ledger(preset_shape("pythia-1.4b"), tier="lora", ema_decay=0.999)  # adapters only are trainable
    assert lora.row("ema") == 4 * lora_trainable_params(preset_shape("pythia-1.4b"), 16)
    assert ema.row("ema") / GiB == pytest.approx(8.42 - 8.07, rel=0.05)


def test_small_micro_batch_peaks_at_the_optimizer_step():
    led = ledger(preset_shape("770m"), micro_batch_size=1, seq_len=256, recompute=True)
    st = budget.model_state_bytes(led.shape, led.setup)
    assert led.peak_phase == "optimizer step"
    assert led.allocated == st.weights + st.gradients + st.optimizer + budget.WORKSPACE_BYTES


@pytest.mark.parametrize(
    "name, measured, kw",
    [  # H200 anchors (docs/gpu.md): the constants must keep reproducing them within 10%
        ("350m", 12.8, dict(micro_batch_size=8, loss_chunk_size=0, compile=True)),
        ("770m", 15.6, dict(micro_batch_size=4, loss_chunk_size=0, compile=True)),
        ("pythia-1.4b", 20.9, dict(tier="adamw8bit", micro_batch_size=4, loss_chunk_size=0)),
    ],
)
def test_h200_anchors_within_10_percent(name, measured, kw):
    led = ledger(preset_shape(name), **kw)
    assert led.allocated / GiB == pytest.approx(measured, rel=0.10)


def test_770m_reserved_anchor():
    led = ledger(preset_shape("770m"), micro_batch_size=4, loss_chunk_size=0, compile=True)
    assert led.reserved / GiB == pytest.approx(16.2, rel=0.10)


def test_flops_per_token_matches_the_trainer():
    s = preset_shape("124m")
    setup = TrainSetup()
    assert flops_per_token(s, setup) == 6 * s.n_matmul_params + 12 * s.n_layer * 1024 * s.d_model
    lora = TrainSetup(tier="lora", recompute=True)
    n_lora = lora_trainable_params(s, 16)
    assert flops_per_token(s, lora) == (
        4 * s.n_matmul_params + 6 * n_lora + 12 * s.n_layer * 1024 * s.d_model  # no weight grads for a frozen base
        + 2 * (s.n_matmul_params + n_lora) + 4 * s.n_layer * 1024 * s.d_model  # the recompute forward
    )
    # the trainer's MFU counts the same FLOPs, without the recompute forward
    from hf_cgpu.settings import TrainSettings
    from hf_cgpu.tasks.causal_lm import GPTSettings
    from hf_cgpu.train.prepare import Run
    from hf_cgpu.train.task import TaskPlan

    shape = GPTSettings().run_shape()
    assert dataclasses.replace(shape.model, name=s.name) == s and shape.seq_len == 1024
    for settings, expected in ((TrainSettings(), flops_per_token(s, setup)),
                               (TrainSettings(recompute=True), flops_per_token(s, setup))):
        run = Run(settings, None, TaskPlan(torch.nn.Linear(1, 1), shape=shape), None, None, None, None)
        assert run.flops_per_unit == expected
    assert flops_per_token(s, TrainSetup(recompute=True), count_recompute=False) == flops_per_token(s, setup)


# ---- autofit --------------------------------------------------------------------------------------------------------


def _rung(reason: str) -> int:
    for i, key in enumerate(("micro-batch", "recompute", "sequence", "8-bit", "lora", "qlora")):
        if reason.lower().startswith(key):
            return i
    raise AssertionError(f"reason names no rung: {reason}")


@pytest.mark.parametrize("min_micro_batch", [1, 4])
def test_autofit_770m_fits_16gb_in_ladder_order(min_micro_batch):
    shape, cap = preset_shape("770m"), parse_memory("16GB")
    plan = autofit(shape, cap, seq_len=1024, micro_batch_size=8, gradient_accumulation_steps=16,
                   min_micro_batch=min_micro_batch)
    assert plan.fits and ledger(shape, plan.setup, cap).fits
    assert plan.setup.tokens_per_step >= 8 * 16 * 1024
    steps = [_rung(r) for r in plan.reasons[:-1]]
    assert steps == sorted(steps) and steps[0] == 0
    assert plan.reasons[-1].startswith("fits")
    assert len(LADDER) == 6
    if min_micro_batch == 4:  # the floor sends it to recompute, which then buys the micro-batch back
        assert plan.setup.recompute and plan.setup.micro_batch_size == 8


def test_autofit_reaches_lora_for_1_4b_and_reports_failure():
    shape = preset_shape("pythia-1.4b")
    plan = autofit(shape, parse_memory("16GB"), seq_len=1024, micro_batch_size=4, gradient_accumulation_steps=8)
    assert plan.fits and plan.setup.tier == "lora"
    steps = [_rung(r) for r in plan.reasons[:-1]]
    assert steps == sorted(steps)
    stuck = autofit(shape, parse_memory("4GB"), seq_len=1024, micro_batch_size=4,
                    rungs=("micro-batch", "recompute", "sequence", "adamw8bit"))
    assert not stuck.fits and "nothing on the ladder fits" in stuck.reasons[-1]


# ---- inputs and the command line ------------------------------------------------------------------------------------


def test_parse_memory():
    assert parse_memory("16GB") == parse_memory("16 GiB") == 16 * GiB
    assert parse_memory("15.5GiB") == int(15.5 * GiB)
    assert parse_memory("12000MB") == 12000 * 1024**2


def test_cli_prints_ledger_and_verdict(capsys):
    assert cli_main(["budget", "--preset", "350m", "--seq_len", "1024", "--micro_batch_size", "8", "--memory_cap",
                     "16GB", "--peak_tflops", "160"]) == 0
    out = capsys.readouterr().out
    for text in ("350m", "weights", "activations", "logits + loss", "CUDA context", "verdict vs 16.00 GiB cap: FITS",
                 "Chinchilla", "160 TFLOP/s"):
        assert text in out


def test_cli_next_rung_and_autofit(capsys):
    assert cli_main(["budget", "--preset", "770m", "--tier", "full", "--no_recompute", "--micro_batch_size", "8",
                     "--peak_tflops", "160"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "next rung: micro-batch 8 -> 4" in out
    assert cli_main(["budget", "--preset", "770m", "--tier", "full", "--no_recompute", "--autofit",
                     "--peak_tflops", "160"]) == 0
    out = capsys.readouterr().out
    assert "autofit" in out and "FITS" in out


def test_cli_reads_a_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_neox_config().to_dict()))
    assert cli_main(["budget", "--config", str(path), "--tier", "lora", "--recompute", "--micro_batch_size", "4",
                     "--peak_tflops", "160"]) == 0
    out = capsys.readouterr().out
    assert "gptneox, 24 x 2048" in out and "lora r=16" in out and "FITS" in out


@pytest.mark.parametrize(
    "argv, fix",
    [
        (["--preset", "13b"], "choose one of tiny, 30m"),
        (["--preset", "350m", "--tier", "turbo"], "choose one of full, adamw8bit, lora, qlora"),
        (["--preset", "350m", "--memory_cap", "16XB"], "e.g. 16GB"),
        (["--config", "/nonexistent/config.json"], "pass the file or the model directory"),
        (["--preset", "350m", "--micro_batch_size", "0"], "micro_batch_size must be >= 1"),
        (["--preset", "350m", "--config", "x.json"], "give one of --preset, --config or --model"),
    ],
)
def test_cli_errors_are_one_line_naming_the_fix(argv, fix, capsys):
    assert cli_main(["budget", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and fix in err and err.count("\n") == 1


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(SettingsError, match="download its config.json and pass --config PATH"):
        ModelShape.from_hub("EleutherAI/pythia-410m")
    assert ModelShape.from_hub("EleutherAI/pythia-1.4b") == ModelShape.reference("pythia-1.4b")  # known: no request


def test_an_unreachable_hub_id_is_one_request_not_a_minute_of_retries(monkeypatch):
    import huggingface_hub
    import transformers

    from hf_cgpu.hub.checks import HubError

    calls = []
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # CI runs offline; this case is online
    monkeypatch.setattr(huggingface_hub, "repo_info", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(
        ConnectionError("Name or service not known")))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: pytest.fail("retried"))
    with pytest.raises(HubError, match="the Hub cannot be reached"):
        ModelShape.from_hub("EleutherAI/pythia-410m")
    assert len(calls) == 1


# ---- regression against the H200 measurement ----------------------------------------------------------------------
# benchmarks/memory/bench_memory.py on one NVIDIA H200 (torch 2.11+cu130, transformers 5.17, peft 0.21, bitsandbytes 0.50.2),
# seq 1024, accumulation 2, eager, bf16 autocast: torch.cuda.max_memory_allocated() in GiB (benchmarks/RESULTS.md).
# (name, model, tier, recompute, micro-batch, stock peft, measured peak allocated GiB)
H200_MEASURED = [
    ("gpt-124m full", "124m", "full", False, 16, False, 7.55),
    ("gpt-124m full+recompute", "124m", "full", True, 16, False, 2.93),
    ("gpt-350m full", "350m", "full", False, 8, False, 12.99),
    ("gpt-350m full+recompute", "350m", "full", True, 8, False, 6.75),
    ("gpt-350m adamw8bit", "350m", "adamw8bit", False, 8, False, 11.14),
    ("gpt-770m full", "770m", "full", False, 4, False, 17.96),
    ("gpt-770m full+recompute", "770m", "full", True, 8, False, 13.81),
    ("gpt-770m adamw8bit+recompute", "770m", "adamw8bit", True, 8, False, 9.76),
    ("pythia-1.4b lora (ours)", "pythia-1.4b", "lora", True, 4, False, 3.93),  # re-measured, checkpoint made first
    ("pythia-1.4b qlora (ours)", "pythia-1.4b", "qlora", True, 4, False, 2.62),
    ("pythia-1.4b lora (stock peft)", "pythia-1.4b", "lora", True, 4, True, 5.60),
    ("pythia-1.4b qlora (stock peft)", "pythia-1.4b", "qlora", True, 4, True, 4.93),
]
def _bench_setup(tier: str, recompute: bool, mb: int) -> TrainSetup:
    """Exactly what bench_memory.measure passes to the ledger (the stock peer through peers.stock_ledger)."""
    return TrainSetup(seq_len=1024, micro_batch_size=mb, gradient_accumulation_steps=2, tier=tier,
                      recompute=recompute, loss_chunk_size=1024)


@pytest.mark.parametrize("row", H200_MEASURED, ids=[r[0] for r in H200_MEASURED])
def test_ledger_within_10pct_of_h200(row):
    name, model, tier, recompute, mb, stock, measured = row
    shape = preset_shape(model)
    predicted = (stock_ledger if stock else ledger)(shape, _bench_setup(tier, recompute, mb)).allocated
    assert abs(predicted / GiB - measured) / measured < 0.10, f"{name}: {predicted / GiB:.2f} vs {measured}"


def test_selective_recompute_ledger_sits_between_off_and_full():
    """Selective keeps each block's input and its projection and attention outputs: less than no recompute, more
    than full recompute, and it re-runs no matmul (the FLOPs of no recompute)."""
    shape = ModelShape.reference("pythia-1.4b")
    base = TrainSetup(seq_len=1024, micro_batch_size=4, tier="lora")
    off, full, sel = (ledger(shape, dataclasses.replace(base, recompute=r, recompute_policy=p))
                      for r, p in ((False, "full"), (True, "full"), (True, "selective")))
    assert full.total < sel.total < off.total
    assert sel.row("activations") < 0.6 * off.row("activations")
    assert sel.row("recompute_layer") < full.row("recompute_layer")
    assert flops_per_token(shape, dataclasses.replace(base, recompute=True, recompute_policy="selective")) == \
        flops_per_token(shape, base) < flops_per_token(shape, dataclasses.replace(base, recompute=True))
    with pytest.raises(SettingsError, match="full, selective"):
        TrainSetup(recompute=True, recompute_policy="some")


def test_soft_capped_logits_and_mixed_values_are_priced():
    """--logit_softcap saves a second copy of the logits; value embeddings a fresh v in each layer they feed
    (without recompute). Measured on zh-poetry-modern's shape: 9.81 GiB allocated with the soft-cap at 15, 9.07
    without it (RESULTS.md)."""
    plain = preset_shape("zh-poetry-modern")
    s = dataclasses.replace(plain, logit_softcap=15.0)
    run = {"micro_batch_size": 32, "seq_len": 512, "loss_chunk_size": 0, "compile": True}  # the preset's step
    full, capped = ledger(plain, **run), ledger(s, **run)
    assert capped.row("logits") - full.row("logits") == budget.memory.LOGITS_SOFTCAP_BYTES["compiled"] * (
        full.setup.tokens_per_micro_batch * s.vocab_size)
    chunked = ledger(s, **{**run, "loss_chunk_size": 1024})
    assert chunked.row("logits") == (budget.memory.LOGITS_CHUNK_BYTES + budget.memory.LOGITS_SOFTCAP_BYTES["eager"]) \
        * 1024 * s.vocab_size
    no_ve = dataclasses.replace(s, value_embeddings=0)
    t = full.setup.tokens_per_micro_batch
    grow = ledger(s, **run).row("activations") - ledger(no_ve, **run).row("activations")
    assert grow >= t * s.d_model * (4 * 3 + 2 * 2 * 3)  # fp32 lookups of 3 tables + bf16 mixed v in 6 layers
    assert ledger(s, **run, ema_decay=0.999).allocated / GiB == pytest.approx(9.81, rel=0.05)
    assert ledger(plain, **run, ema_decay=0.999).allocated / GiB == pytest.approx(9.07, rel=0.05)
