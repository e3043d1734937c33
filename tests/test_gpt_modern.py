"""The GPT's modern options (rotary, qk_norm, relu2, rmsnorm): off by default, exact under caches, padding, reload."""

import json
import re

import pytest
from isolation import run_without_hf_cgpu
import torch
from transformers import AutoModelForCausalLM

from hf_cgpu.budget.memory import model_state_bytes
from hf_cgpu.budget.shape import ModelShape
from hf_cgpu.errors import SettingsError
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.models.cgpt.modeling_cgpt import apply_rotary, rotary_cos_sin
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tasks.settings import GPTSettings

MODERN = dict(position_embedding="rotary", qk_norm=True, activation="relu2")


def modern_model(seed=1, **kw):
    torch.manual_seed(seed)
    # a wide init: attention far from uniform, so a wrong position moves the logits visibly
    base = dict(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4, loss_chunk_size=0,
                initializer_range=0.2, **MODERN)
    return CgptForCausalLM(CgptConfig(**{**base, **kw})).eval()


def test_defaults_are_the_plain_gpt2():
    cfg = CgptConfig(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    assert (cfg.position_embedding, cfg.qk_norm, cfg.activation, cfg.norm) == ("learned", False, "gelu", "layernorm")
    model = CgptForCausalLM(cfg)
    names = {n for n, _ in model.named_parameters()}
    assert "transformer.wpe.weight" in names and not any("q_norm" in n for n in names)
    assert isinstance(model.transformer.h[0].mlp.act, torch.nn.GELU)
    assert isinstance(model.transformer.ln_f, torch.nn.LayerNorm)


def test_rotary_score_depends_only_on_the_offset():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(m, n):
        cos, sin = rotary_cos_sin(torch.tensor([[m, n]]), 16, 10000.0)
        qm = apply_rotary(q, cos[:, :1].double(), sin[:, :1].double())
        kn = apply_rotary(k, cos[:, 1:].double(), sin[:, 1:].double())
        return (qm * kn).sum().item()

    for m, n in ((3, 1), (7, 7), (2, 9)):
        for shift in (1, 5, 40):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), rel=1e-5, abs=1e-5)
    assert score(3, 1) != pytest.approx(score(4, 1), rel=1e-3)  # and it does depend on the offset
    cos, sin = rotary_cos_sin(torch.tensor([[0]]), 16, 10000.0)
    torch.testing.assert_close(apply_rotary(q, cos.double(), sin.double()), q)  # position 0: the identity


def test_rotary_table_holds_the_angles_of_every_position_and_is_not_saved():
    model = modern_model()
    table = model.transformer.rotary
    assert table.cos.dtype == torch.float32 and table.cos.shape == (64, 8)
    pos = torch.tensor([[0, 0, 1, 2], [5, 17, 40, 63]])  # a left-padded row and arbitrary packed positions
    for got, want in zip(table(pos), rotary_cos_sin(pos, 8, model.config.rope_theta)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not any("rotary" in k for k in model.state_dict())  # rebuilt on load, never in a checkpoint
    fp32 = table.cos.clone()
    model.to(torch.bfloat16)  # the angles stay fp32, as exact as before the cast
    assert table.cos.dtype == torch.float32 and torch.equal(table.cos, fp32)
    assert model.transformer.wte.weight.dtype == torch.bfloat16


def test_compiled_rotary_model_computes_no_angles():
    """The traced forward looks cos/sin up; computing them there let inductor inline pow/sin/cos into every q and k
    kernel (forward and backward), once per batch row and head: ~31 ms of a 139 ms step on an H200."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = modern_model().train()
    ids = torch.randint(0, 97, (2, 16))
    torch.compile(model, backend=capture, fullgraph=True)(input_ids=ids, labels=ids).loss.backward()
    torch._dynamo.reset()
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert targets and not [t for t in targets if re.search(r"\b(sin|cos|pow)\b", t)], targets


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_cached_greedy_equals_uncached_and_forward_loop(norm):
    model = modern_model(norm=norm)
    prompt = torch.randint(1, 97, (1, 7))
    kw = dict(max_new_tokens=25, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
              output_logits=True)
    with torch.no_grad():
        uncached = model.generate(prompt, use_cache=False, **kw)
        seq, logits = prompt, []
        for _ in range(25):
            logits.append(model(seq, use_cache=False).logits[:, -1])
            seq = torch.cat([seq, logits[-1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(seq, uncached.sequences) and len(set(seq[0, 7:].tolist())) > 3  # not one repeated token
        for cached in (model.generate(prompt, use_cache=True, **kw),
                       model.generate(prompt, cache_implementation="static", **kw)):
            assert torch.equal(cached.sequences, uncached.sequences)
            for got, want in zip(cached.logits, logits):  # the values too: argmax alone hides small shifts
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_left_padded_batch_matches_single():
    model = modern_model(seed=2)
    a, b = torch.randint(1, 97, (1, 9)), torch.randint(1, 97, (1, 5))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    both = model.generate(batch, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **kw)
    single = model.generate(b, return_dict_in_generate=True, output_logits=True, **kw)
    assert torch.equal(both.sequences[1, 4:], single.sequences[0])
    assert torch.equal(both.sequences[0], model.generate(a, **kw)[0])
    for got, want in zip(both.logits, single.logits):
        torch.testing.assert_close(got[1], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_attention_backends_agree():
    model = modern_model()
    ids = torch.randint(1, 97, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
        for impl in ("eager", "flex_attention"):
            model.set_attn_implementation(impl)
            torch.testing.assert_close(model(ids).logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_save_load_round_trip_and_trust_remote_code_without_hf_cgpu(tmp_path):
    model = modern_model(norm="rmsnorm")
    model.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["position_embedding"] == "rotary" and cfg["qk_norm"] and cfg["activation"] == "relu2"
    ids = torch.randint(1, 97, (1, 10))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    torch.save({"ids": ids, "want": want}, tmp_path / "io.pt")
    run_without_hf_cgpu(f"""
        import torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path / "m")!r}, trust_remote_code=True).eval()
        assert type(m).__module__.startswith('transformers_modules'), type(m).__module__
        io = torch.load({str(tmp_path / "io.pt")!r})
        out = m.generate(io['ids'], max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert torch.equal(out, io['want']), (out, io['want'])
        print('OK')
        """, tmp_path)


@pytest.mark.parametrize("options", [{}, MODERN, {**MODERN, "norm": "rmsnorm", "tie_word_embeddings": False}])
def test_ledger_counts_the_model_and_muon_state(options):
    gpt = GPTSettings(n_layer=2, n_embd=32, n_head=4, seq_len=64, vocab_size=97, **options)
    model = CgptForCausalLM(gpt.model_config(97, 0))
    shape = gpt.run_shape()
    assert shape.model.n_params == sum(p.numel() for p in model.parameters())
    setup = shape.setup(TrainSettings(optimizer="muon"))
    blocks = sum(p.numel() for n, p in model.named_parameters() if ".h." in n and p.ndim == 2)
    rest = shape.model.n_params - blocks
    assert model_state_bytes(shape.model, setup).optimizer == 4 * blocks + 8 * rest
    assert model_state_bytes(shape.model, shape.setup(TrainSettings())).optimizer == 8 * shape.model.n_params


def test_bad_options_are_one_line_errors():
    with pytest.raises(SettingsError, match="activation='swish'; choose one of gelu, relu2"):
        GPTSettings(activation="swish")
    with pytest.raises(SettingsError, match="even head size"):
        GPTSettings(n_embd=36, n_head=4, position_embedding="rotary")
    with pytest.raises(ValueError, match="position_embedding='alibi'"):
        CgptConfig(position_embedding="alibi")
    assert isinstance(ModelShape.from_config({"model_type": "cgpt", "n_embd": 32, "n_layer": 1, "n_head": 4,
                                              "vocab_size": 9, "n_positions": 8}), ModelShape)
