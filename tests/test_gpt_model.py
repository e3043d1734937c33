"""Contract tests of the hf_cgpu GPT on tiny configs (CPU)."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
from isolation import WITHOUT_HF_CGPU
import torch
from transformers import AutoModelForCausalLM, pipeline

from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM, chunked_cross_entropy
from hf_cgpu.settings import load_preset




def tiny_config(**kw):
    base = dict(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, loss_chunk_size=0)
    base.update(kw)
    return CgptConfig(**base)


def closed_form_params(L, d, V, P, mlp_ratio=4, bias=False):
    """Tied embeddings: wte V*d + wpe P*d + per block (4d^2 attention + 2*ratio*d^2 MLP + norms) + final norm."""
    per_block = 4 * d * d + 2 * mlp_ratio * d * d + 2 * d  # LayerNorm weights, no bias
    if bias:
        per_block += 3 * d + d + mlp_ratio * d + d + 2 * d
    final = d * (2 if bias else 1)
    return V * d + P * d + L * per_block + final


@pytest.mark.parametrize("preset", ["tiny", "30m", "124m", "350m", "770m"])
def test_preset_parameter_counts(preset):
    p = load_preset(preset, "gpt")
    cfg = CgptConfig(vocab_size=p["vocab_size"], n_positions=p["seq_len"], n_embd=p["n_embd"], n_layer=p["n_layer"],
                     n_head=p["n_head"])
    with torch.device("meta"):
        model = CgptForCausalLM(cfg)
    n = sum(t.numel() for t in model.parameters())
    assert n == closed_form_params(p["n_layer"], p["n_embd"], p["vocab_size"], p["seq_len"])
    print(f"{preset}: {n / 1e6:.1f}M parameters")


def test_preset_sizes_match_names():
    """124m is GPT-2 small's body (85M in blocks) with a 32k vocab; 350m/770m carry their rows of the seed's ledger."""
    def count(name):
        p = load_preset(name, "gpt")
        return closed_form_params(p["n_layer"], p["n_embd"], p["vocab_size"], p["seq_len"])

    assert 105e6 < count("124m") < 125e6
    assert 320e6 < count("350m") < 360e6
    assert 700e6 < count("770m") < 780e6


def test_bias_option_counts():
    cfg = tiny_config(bias=True)
    model = CgptForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == closed_form_params(2, 32, 97, 32, bias=True)


def test_tied_embeddings_and_initial_loss():
    torch.manual_seed(0)
    model = CgptForCausalLM(tiny_config(vocab_size=500, n_embd=64))
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 500, (4, 32))
    loss = model(ids, labels=ids).loss.item()
    assert abs(loss - math.log(500)) < 0.15  # a fresh model is ~uniform over the vocabulary


def test_chunked_loss_equals_full_loss_and_grads():
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    t[5] = -100
    ref = torch.nn.functional.cross_entropy(h @ w.T, t, ignore_index=-100)
    gh, gw = torch.autograd.grad(ref, (h, w))
    got = chunked_cross_entropy(h, w, t, chunk_size=8)
    ch, cw = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(ch, gh)
    torch.testing.assert_close(cw, gw)


def test_model_chunked_and_full_paths_agree():
    torch.manual_seed(0)
    model = CgptForCausalLM(tiny_config())
    ids = torch.randint(0, 97, (2, 20))
    full = model(ids, labels=ids).loss
    model.config.loss_chunk_size = 7
    chunked = model(ids, labels=ids)
    assert chunked.logits is None
    torch.testing.assert_close(chunked.loss, full)
    # packer convention (targets already shifted) equals the HF convention (shifted inside)
    block = torch.randint(0, 97, (2, 21))
    shifted = block[:, 1:].clone()
    shifted[:, -1] = -100  # HF labels give the last position no target
    torch.testing.assert_close(model(block[:, :-1], shift_labels=shifted).loss,
                               model(block[:, :-1], labels=block[:, :-1]).loss)


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = CgptForCausalLM(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "modeling_cgpt.py").is_file()
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_cgpt.CgptForCausalLM"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_cached_greedy_equals_uncached():
    torch.manual_seed(1)
    model = CgptForCausalLM(tiny_config(n_positions=64)).eval()
    prompt = torch.randint(1, 97, (1, 7))
    kw = dict(max_new_tokens=25, do_sample=False, pad_token_id=0, eos_token_id=None)
    with_cache = model.generate(prompt, use_cache=True, **kw)
    without = model.generate(prompt, use_cache=False, **kw)
    assert with_cache.shape[1] == 7 + 25
    assert torch.equal(with_cache, without)
    # and equal to a hand-rolled argmax loop over full forwards
    seq = prompt
    for _ in range(25):
        with torch.no_grad():
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(seq, with_cache)


def test_left_padded_batch_matches_single():
    torch.manual_seed(2)
    model = CgptForCausalLM(tiny_config(n_positions=64)).eval()
    a = torch.randint(1, 97, (1, 9))
    b = torch.randint(1, 97, (1, 5))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    both = model.generate(batch, attention_mask=mask, **kw)
    single_b = model.generate(b, **kw)
    assert torch.equal(both[1, 4:], single_b[0])


def test_too_long_sequence_is_one_line_error():
    model = CgptForCausalLM(tiny_config(n_positions=16))
    with pytest.raises(ValueError, match="longer than n_positions=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_bad_heads_is_one_line_error():
    with pytest.raises(ValueError, match="not divisible by n_head"):
        CgptConfig(n_embd=100, n_head=3)


def test_gradient_checkpointing_same_gradients():
    torch.manual_seed(0)
    model = CgptForCausalLM(tiny_config()).train()
    ids = torch.randint(0, 97, (2, 16))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(b.gradient_checkpointing for b in model.transformer.h)
    got = grads()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)


@pytest.fixture(scope="module")
def saved_lm(tmp_path_factory):
    from hf_cgpu.data.tokenizer import train_tokenizer

    texts = ["the quick brown fox jumps over the lazy dog " * 3, "床前明月光，疑是地上霜。舉頭望明月，低頭思故鄉。"] * 20
    tok = train_tokenizer(texts, vocab_size=300, show_progress=False)
    torch.manual_seed(0)
    model = CgptForCausalLM(tiny_config(vocab_size=len(tok), n_positions=64, eos_token_id=tok.eos_token_id))
    d = tmp_path_factory.mktemp("lm")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_text_generation_pipeline(saved_lm):
    gen = pipeline("text-generation", model=str(saved_lm), tokenizer=str(saved_lm))
    out = gen("the quick", max_new_tokens=8, do_sample=False)
    assert out[0]["generated_text"].startswith("the quick")
    assert len(out[0]["generated_text"]) > len("the quick")


def test_trust_remote_code_without_hf_cgpu(saved_lm, tmp_path):
    script = WITHOUT_HF_CGPU + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        d = {str(saved_lm)!r}
        tok = AutoTokenizer.from_pretrained(d)
        m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
        assert type(m).__module__.startswith('transformers_modules'), type(m).__module__
        ids = tok('the quick', return_tensors='pt').input_ids
        out = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
        print('OK', out.shape[1] - ids.shape[1])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "OK 5" in res.stdout
