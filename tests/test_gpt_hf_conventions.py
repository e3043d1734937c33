"""The GPT behaves like a transformers model where library code relies on it (issue 11), and keeps its fast paths.

transformers' own ModelTesterMixin runs in test_gpt_upstream_mixins.py; these are the issue's cases, written out, plus
what keeps training fast (plain causal SDPA, one graph) and what the vendored mixins do not cover (export).
"""

import functools
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments
from transformers.cache_utils import DynamicCache

from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM, CgptModel
from hf_cgpu.models.cgpt.modeling_cgpt import _CACHE_FIELD

V, L, H, C = 97, 2, 4, 32


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(cls=CgptForCausalLM, seed=0, **kw):
    cfg = dict(vocab_size=V, n_positions=64, n_embd=C, n_layer=L, n_head=H, loss_chunk_size=7, pad_token_id=0)
    cfg.update(kw)
    torch.manual_seed(seed)
    return cls(CgptConfig(**cfg)).eval()


def ids(B=2, T=10, seed=0):
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


def left_padded():
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    return x.masked_fill(mask == 0, 0), mask


class CountSDPA:
    """Wraps F.scaled_dot_product_attention (which transformers' sdpa backend calls) and records its arguments."""

    def __init__(self):
        self.calls = []
        sdpa = F.scaled_dot_product_attention

        @functools.wraps(sdpa)
        def counting(*args, **kwargs):
            self.calls.append(kwargs)
            return sdpa(*args, **kwargs)

        self._patch = mock.patch("torch.nn.functional.scaled_dot_product_attention", counting)

    def __enter__(self):
        self._patch.start()
        return self

    def __exit__(self, *exc):
        self._patch.stop()


# ---------------------------------------------------------------------------- outputs
def test_hidden_states_and_attentions_are_recorded():
    model = tiny(CgptModel)
    x = ids()
    out = model(x, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == L + 1 and len(out.attentions) == L
    with torch.no_grad():
        embeddings = model.wte(x) + model.wpe(torch.arange(x.shape[1]))[None]
        after_block0 = model.h[0](embeddings)
    torch.testing.assert_close(out.hidden_states[0], embeddings)
    torch.testing.assert_close(out.hidden_states[1], after_block0)
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)  # after ln_f, as in GPT-2
    for attn in out.attentions:
        assert attn.shape == (2, H, 10, 10)
        torch.testing.assert_close(attn.sum(-1), torch.ones(2, H, 10))
        assert torch.all(attn.triu(1) == 0)  # causal
    # the same from the config, and nothing when not asked for
    model.config.output_hidden_states = True
    assert len(model(x).hidden_states) == L + 1
    model.config.output_hidden_states = False
    plain = model(x)
    assert plain.hidden_states is None and plain.attentions is None


def test_output_attentions_under_sdpa_runs_eager_with_the_right_mask():
    sdpa = tiny()
    eager = tiny(attn_implementation="eager")
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    x, mask = left_padded()
    with torch.no_grad():
        a = sdpa(x, attention_mask=mask, output_attentions=True)
        b = eager(x, attention_mask=mask, output_attentions=True)
        plain = sdpa(x, attention_mask=mask)
    for wa, wb in zip(a.attentions, b.attentions):
        torch.testing.assert_close(wa, wb)
        assert torch.all(wa[1, :, 3:, :3] == 0)  # real tokens never see the left padding
    torch.testing.assert_close(a.logits[mask.bool()], plain.logits[mask.bool()], rtol=1e-5, atol=1e-5)


def test_return_dict_false_gives_tuples():
    model = tiny()
    x = ids()
    with torch.no_grad():
        out = model(x, labels=x, output_hidden_states=True)
        tup = model(x, labels=x, output_hidden_states=True, return_dict=False)
        base = model.transformer(x, use_cache=False, return_dict=False)
    assert isinstance(tup, tuple) and isinstance(base, tuple)
    assert len(tup) == len(out.to_tuple())
    torch.testing.assert_close(tup[0], out.loss)
    torch.testing.assert_close(tup[1], out.logits)
    torch.testing.assert_close(base[0], model.transformer(x, use_cache=False).last_hidden_state)
    model.config.return_dict = False
    assert isinstance(model(x), tuple)


# ---------------------------------------------------------------------------- attention backends
@pytest.mark.parametrize("implementation, padded", [("eager", False), ("eager", True),
                                                     pytest.param("flex_attention", True, marks=pytest.mark.slow)])
def test_other_backends_match_sdpa(implementation, padded):
    x, mask = left_padded() if padded else (ids(), None)
    sdpa = tiny()
    other = tiny(attn_implementation=implementation)
    with torch.no_grad(), CountSDPA() as sdpa_calls:
        a = sdpa(x, attention_mask=mask).logits
        n_sdpa = len(sdpa_calls.calls)
        b = other(x, attention_mask=mask).logits
    assert n_sdpa == L and len(sdpa_calls.calls) == L  # the other backend really runs without SDPA
    keep = mask.bool() if padded else slice(None)
    torch.testing.assert_close(a[keep], b[keep], rtol=1e-5, atol=1e-5)
    sdpa.set_attn_implementation(implementation)  # switching at run time takes effect too
    with torch.no_grad(), CountSDPA() as sdpa_calls:
        torch.testing.assert_close(sdpa(x, attention_mask=mask).logits[keep], b[keep])
    assert not sdpa_calls.calls


def test_attn_implementation_survives_save_and_load(tmp_path):
    tiny().save_pretrained(tmp_path)
    loaded = CgptForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert loaded.config._attn_implementation == "eager"
    with torch.no_grad(), CountSDPA() as sdpa_calls:
        loaded(ids())
    assert not sdpa_calls.calls
    with pytest.raises(ValueError, match="attn_implementation"):
        CgptForCausalLM.from_pretrained(tmp_path, attn_implementation="not_a_backend")


def test_training_path_is_plain_causal_sdpa_with_dropout():
    """Training without padding: SDPA with is_causal=True, no mask (the flash kernel), attention dropout on."""
    model = tiny(dropout=0.1).train()
    block = ids(T=11)
    with CountSDPA() as sdpa_calls:
        model(input_ids=block[:, :-1], shift_labels=block[:, 1:], use_cache=False).loss.backward()
    assert len(sdpa_calls.calls) == L
    assert all(c["attn_mask"] is None and c["is_causal"] is True and c["dropout_p"] == 0.1 for c in sdpa_calls.calls)
    model.eval()
    with torch.no_grad(), CountSDPA() as sdpa_calls:
        model(block, use_cache=False)
    assert all(c["dropout_p"] == 0.0 for c in sdpa_calls.calls)


# ---------------------------------------------------------------------------- compile / export
def test_training_step_compiles_to_one_graph_with_causal_sdpa():
    model = tiny().train()
    block = ids(T=11)
    kwargs = dict(input_ids=block[:, :-1], shift_labels=block[:, 1:], use_cache=False)
    explained = torch._dynamo.explain(model)(**kwargs)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    sdpa_nodes = [n for g in explained.graphs for n in g.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(sdpa_nodes) == L and all(n.kwargs.get("is_causal") and n.kwargs.get("attn_mask") is None
                                        for n in sdpa_nodes)

    torch._dynamo.reset()
    # aot_eager: dynamo's one-graph capture and AOT autograd, without inductor's (slow on CPU) code generation
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(**kwargs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager_loss = model(**kwargs).loss
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_torch_export_static_and_dynamic():
    model = tiny()
    x, mask = left_padded()
    with torch.no_grad():
        expected = model(x, attention_mask=mask, use_cache=False).logits
    static = torch.export.export(model, (), {"input_ids": x, "attention_mask": mask, "use_cache": False})
    torch.testing.assert_close(static.module()(input_ids=x, attention_mask=mask, use_cache=False).logits, expected)

    batch, seq = torch.export.Dim("batch", max=8), torch.export.Dim("seq", min=2, max=32)
    dynamic = torch.export.export(
        model, (), {"input_ids": ids(), "attention_mask": torch.ones_like(ids()), "use_cache": False},
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}, "use_cache": None},
    )
    other, other_mask = ids(B=3, T=13, seed=5), torch.ones(3, 13, dtype=torch.long)
    other_mask[0, :4] = 0
    with torch.no_grad():
        want = model(other, attention_mask=other_mask, use_cache=False).logits
    got = dynamic.module()(input_ids=other, attention_mask=other_mask, use_cache=False).logits
    torch.testing.assert_close(got[other_mask.bool()], want[other_mask.bool()])


def test_export_with_default_use_cache():
    """The call of the issue: export of model(input_ids, attention_mask), use_cache from the config (True). The
    returned DynamicCache needs transformers' pytree registration, as for its own models."""
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()
    model = tiny()
    x = ids()
    exported = torch.export.export(model, (x,), {"attention_mask": torch.ones_like(x)})
    out = exported.module()(x, attention_mask=torch.ones_like(x))
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(getattr(out, _CACHE_FIELD).layers[0].keys, getattr(expected, _CACHE_FIELD).layers[0].keys)


def test_static_cache_decode_step_compiles_fullgraph():
    from transformers.cache_utils import StaticCache

    model = tiny()
    x = ids()
    with torch.no_grad():
        expected = model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
        cache = StaticCache(config=model.config, max_cache_len=16)
        seq = torch.cat([x, model(x, cache=cache).logits[:, -1:].argmax(-1)], 1)
        torch._dynamo.reset()
        step = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        for _ in range(2):
            position = torch.full((2, 1), seq.shape[1] - 1)
            logits = step(seq[:, -1:], cache=cache, position_ids=position).logits
            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(seq, expected)


# ---------------------------------------------------------------------------- loss and logits
def test_logits_come_with_the_chunked_loss_in_eval_only():
    model = tiny()
    x = ids()
    out = model(x, labels=x)
    assert out.logits is not None and out.logits.shape == (2, 10, V)
    reference = F.cross_entropy(out.logits[:, :-1].reshape(-1, V).float(), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, reference)  # the chunked loss is the loss of the returned logits
    assert model(x, labels=x, return_logits=False).logits is None
    model.train()
    assert model(x, labels=x).logits is None  # training never builds them
    torch.testing.assert_close(model(x, labels=x, return_logits=True).logits, out.logits)
    model.config.loss_chunk_size = 0  # full-logits mode returns them always, with the same loss
    full = model(x, labels=x)
    assert full.logits.shape == (2, 10, V)
    torch.testing.assert_close(full.loss, out.loss)
    kept = model(x, labels=x, logits_to_keep=1)
    assert kept.logits.shape == (2, 1, V)
    torch.testing.assert_close(kept.loss, out.loss)


def test_num_items_in_batch_is_the_denominator():
    for chunk in (7, 0):
        model = tiny(loss_chunk_size=chunk).train()
        x = ids()
        mean = model(x, labels=x).loss
        summed = model(x, labels=x, num_items_in_batch=torch.tensor(3)).loss
        torch.testing.assert_close(summed, mean * (2 * 9) / 3)


def test_trainer_predict_gets_logits_and_loss(tmp_path):
    model = tiny()
    x = ids(B=4)
    data = [{"input_ids": row, "labels": row} for row in x]
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                                          per_device_eval_batch_size=2))
    pred = trainer.predict(data)
    assert pred.predictions.shape == (4, 10, V)
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(pred.predictions), model(x).logits, rtol=1e-5, atol=1e-5)
        loss = model(x, labels=x).loss
    assert abs(pred.metrics["test_loss"] - loss.item()) < 1e-4


# ---------------------------------------------------------------------------- cache argument names
def test_both_cache_names_are_accepted():
    model = tiny()
    x = ids()
    with torch.no_grad():
        first = model(x[:, :6])
        cache = getattr(first, _CACHE_FIELD)
        assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 6
        full = model(x).logits[:, 6:]
        other = "past_key_values" if _CACHE_FIELD == "cache" else "cache"
        for name in (_CACHE_FIELD, other):
            c = DynamicCache(config=model.config)
            model(x[:, :6], **{_CACHE_FIELD: c})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # 5.24+: past_key_values is deprecated
                step = model(x[:, 6:], **{name: c}).logits
            torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def test_input_errors_are_one_line():
    model = tiny()
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model()
    with pytest.raises(ValueError, match="longer than n_positions=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
