"""modded-nanogpt's architecture options of our GPT: value embeddings, logit soft-capping, U-net skips, a zero head;
and the Slowrun's layer looping (the block stack run again with the same weights).

Each is off by default and then adds nothing; on, each is checked against a computation written out here, exact
under the KV cache and a reload (also where hf_cgpu is not installed), counted by the ledger, and trained end to end.
The resume refusals are in test_resume_fingerprint.py, the transformers mixins in test_gpt_upstream_mixins.py.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from gpt_generation_checks import GenerationChecks
from isolation import run_without_hf_cgpu
from transformers import AutoModelForCausalLM

from hf_cgpu.budget.memory import activation_bytes
from hf_cgpu.budget.time import flops_per_token
from hf_cgpu.budget.card import CPU
from hf_cgpu.commands.budget import describe_run, price
from hf_cgpu.errors import SettingsError
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.models.cgpt.modeling_cgpt import value_table_of
from hf_cgpu.optim.muon_optimizer import muon_param_groups
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tasks.settings import GPTSettings

V, L = 97, 5  # an odd depth: a middle block with neither a value table nor a skip
OPTIONS = {
    "value_embeddings": dict(value_embeddings=2),
    "logit_softcap": dict(logit_softcap=1.5),
    "unet_skips": dict(unet_skips=True),
    "zero_init_head": dict(zero_init_head=True, tie_word_embeddings=False),
    "layer_loops": dict(layer_loops=2),
}
ALL = {k: v for option in OPTIONS.values() for k, v in option.items()}
CASES = [*OPTIONS.values(), ALL]
IDS = [*OPTIONS, "all"]
NEW_PARAMETERS = ("value_embeds", "value_mix", "skip_weights")


pytestmark = pytest.mark.usefixtures("one_thread")


def model(seed=1, random_head=True, **kw):
    """A tiny GPT with a wide init (logits far from uniform, so a wrong value moves them visibly); a zero head is
    replaced by a random one unless ``random_head`` is False (a zero head gives every token the same logit)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, n_positions=64, n_embd=32, n_layer=L, n_head=4, loss_chunk_size=0, initializer_range=0.2)
    m = CgptForCausalLM(CgptConfig(**{**cfg, **kw})).eval()
    if random_head and m.config.zero_init_head:
        with torch.no_grad():
            m.lm_head.weight.normal_(0.0, 0.2)
    return m


def tokens(B=2, T=9, seed=0):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_off_adds_nothing_and_on_adds_only_its_parameters():
    plain = dict(model().named_parameters())
    assert not [n for n in plain if any(p in n for p in NEW_PARAMETERS)]
    for options in CASES:
        params = dict(model(**options).named_parameters())
        same = {n: p.shape for n, p in params.items() if not any(x in n for x in NEW_PARAMETERS)}
        head = {"lm_head.weight": plain["transformer.wte.weight"].shape} if not options.get(
            "tie_word_embeddings", True) else {}
        assert same == {**{n: p.shape for n, p in plain.items()}, **head}, options


def test_value_tables_feed_the_first_and_last_layers_in_order():
    assert [value_table_of(i, 5, 2) for i in range(5)] == [0, 1, None, 0, 1]
    assert [value_table_of(i, 4, 2) for i in range(4)] == [0, 1, 0, 1]
    assert [value_table_of(i, 6, 1) for i in range(6)] == [0, None, None, None, None, 0]
    m = model(**OPTIONS["value_embeddings"])
    assert [hasattr(b.attn, "value_mix") for b in m.transformer.h] == [True, True, False, True, True]
    assert m.transformer.h[0].attn.value_mix.tolist() == [0.5, 0.5]
    spread = m.transformer.value_embeds[0].weight.std().item()  # the values' own spread: 0.2 * sqrt(32)
    assert spread == pytest.approx(0.2 * math.sqrt(32), rel=0.05)


def test_value_mix_is_what_it_says():
    """With every mix at (1, 0) the values are the plain model's; with (0, 1) they are the table rows alone, so the
    logits then depend on the tables (and on nothing else of the values) through both layers each table feeds."""
    x = tokens()
    plain, ve = model(), model(**OPTIONS["value_embeddings"])
    ve.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        for block in ve.transformer.h:
            if hasattr(block.attn, "value_mix"):
                block.attn.value_mix.copy_(torch.tensor([1.0, 0.0]))
        torch.testing.assert_close(ve(x).logits, plain(x).logits, rtol=0, atol=0)
        ve.transformer.h[3].attn.value_mix.copy_(torch.tensor([0.0, 1.0]))  # layer 3 reads table 0
        before = ve(x).logits
        ve.transformer.value_embeds[1].weight.mul_(3.0)  # table 1 feeds layers 1 and 4, both at (1, 0): no effect
        torch.testing.assert_close(ve(x).logits, before, rtol=0, atol=0)
        ve.transformer.value_embeds[0].weight.mul_(3.0)
        assert not torch.allclose(ve(x).logits, before, atol=1e-3)


def test_value_embeddings_train_with_adamw_under_muon():
    m = model(**OPTIONS["value_embeddings"])
    groups = muon_param_groups(m, m.named_parameters(), lr=1e-3, weight_decay=0.1, muon_lr=0.02, muon_momentum=0.95,
                               muon_weight_decay=0.0)
    where = {id(p): (g["use_muon"], g["weight_decay"]) for g in groups for p in g["params"]}
    for table in m.transformer.value_embeds:
        assert where[id(table.weight)] == (False, 0.1)  # AdamW, decayed like the token embedding
    assert where[id(m.transformer.h[0].attn.value_mix)] == (False, 0.0)
    assert where[id(m.transformer.h[0].attn.qkv.weight)][0]  # the block matrices stay Muon's


def test_value_embeddings_need_token_ids():
    m = model(**OPTIONS["value_embeddings"])
    with pytest.raises(ValueError, match="pass input_ids, not inputs_embeds"):
        m(inputs_embeds=m.transformer.wte(tokens()))


@pytest.mark.parametrize("chunk", [0, 5])
def test_softcap_bounds_the_logits_and_the_loss_is_the_capped_cross_entropy(chunk):
    cap = 1.5
    m = model(logit_softcap=cap, loss_chunk_size=chunk)
    x = tokens()
    with torch.no_grad():
        m.lm_head.weight.mul_(50.0)  # raw logits far beyond the cap
        hidden = m.transformer(x).last_hidden_state
        raw = hidden @ m.lm_head.weight.T
        assert raw.abs().max() > 10 * cap
        capped = cap * torch.tanh(raw.double() / cap)
        want = F.cross_entropy(capped[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
        out = m(x, labels=x)
        for_generation = m(x, logits_to_keep=1).logits  # what generate and eval read, capped alike
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)
    for logits, expected in ((out.logits, capped), (for_generation, capped[:, -1:])):
        assert logits.abs().max() <= cap
        torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5)


def test_unet_skips_add_the_mirrored_outputs():
    """Block j's output times skip_weights[j] joins the input of block n_layer - 1 - j, written out here for 5
    blocks (the middle one gets none); at zero weights the model is the plain one."""
    x = tokens()
    m = model(unet_skips=True)
    assert m.transformer.skip_weights.tolist() == [1.0, 1.0]
    t = m.transformer
    with torch.no_grad():
        t.skip_weights.copy_(torch.tensor([0.3, -0.7]))
        h = t.wte(x) + t.wpe(torch.arange(x.shape[1]))[None]
        o0 = t.h[0](h)
        o1 = t.h[1](o0)
        o2 = t.h[2](o1)
        o3 = t.h[3](o2 - 0.7 * o1)
        o4 = t.h[4](o3 + 0.3 * o0)
        torch.testing.assert_close(t(x).last_hidden_state, t.ln_f(o4), rtol=1e-6, atol=1e-6)
        t.skip_weights.zero_()
        plain = model()
        plain.load_state_dict(m.state_dict(), strict=False)
        torch.testing.assert_close(m(x).logits, plain(x).logits, rtol=0, atol=0)


def test_layer_loops_run_the_blocks_again_and_cost_per_pass():
    x = tokens()
    m = model(layer_loops=2)
    t = m.transformer
    with torch.no_grad():
        h = t.wte(x) + t.wpe(torch.arange(x.shape[1]))[None]
        for block in [*t.h, *t.h]:
            h = block(h)
        torch.testing.assert_close(t(x).last_hidden_state, t.ln_f(h), rtol=1e-6, atol=1e-6)
    assert m.config.num_hidden_layers == 2 * L and m.config.n_layer == L
    once, twice = (GPTSettings(n_layer=L, n_embd=32, n_head=4, seq_len=64, vocab_size=V, layer_loops=k).run_shape()
                   for k in (1, 2))
    setup = once.setup(TrainSettings(micro_batch_size=2))
    blocks = once.model.n_block_linear_params
    assert twice.model.n_params == once.model.n_params and twice.model.depth == 2 * L
    assert flops_per_token(twice.model, setup) - flops_per_token(once.model, setup) == 6 * blocks + 12 * L * 64 * 32
    one, two = activation_bytes(once.model, setup), activation_bytes(twice.model, setup)
    assert two.no_recompute - one.no_recompute == pytest.approx(L * one.per_token_per_layer * 128)


def test_zero_head_starts_at_zero_and_at_the_uniform_loss():
    m = model(random_head=False, **OPTIONS["zero_init_head"])
    assert not m.lm_head.weight.any() and m.transformer.wte.weight.any()
    x = tokens()
    assert m(x, labels=x).loss.item() == pytest.approx(math.log(V), abs=1e-6)
    with pytest.raises(SettingsError, match="add --tie_word_embeddings false$"):
        GPTSettings(zero_init_head=True)


@pytest.mark.parametrize("options, error", [
    (dict(n_layer=4, value_embeddings=3), "value_embeddings=3 must be in \\[0, n_layer // 2 = 2\\]"),
    (dict(n_layer=1, unet_skips=True), "n_layer=1 has none"),
    (dict(logit_softcap=-1.0), "logit_softcap=-1.0 must be >= 0"),
    (dict(layer_loops=0), "layer_loops=0 must be >= 1"),
])
def test_bad_values_are_one_line_errors(options, error):
    with pytest.raises(SettingsError, match=error) as err:
        GPTSettings(**options)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=error):
        CgptConfig(**options)


@pytest.mark.parametrize("options", CASES, ids=IDS)
def test_cached_generation_equals_the_uncached_forward(options):
    m = model(**options)
    prompt, mask = tokens(), torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding in the second row
    steps = 12
    by_hand, logits = GenerationChecks._greedy_by_hand(m, prompt, mask, steps)
    assert len(set(by_hand[0, 9:].tolist())) > 2  # not one repeated token
    kw = dict(attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None,
              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        for cache in (dict(use_cache=True), dict(cache_implementation="static"), dict(use_cache=False)):
            out = m.generate(prompt, **kw, **cache)
            assert torch.equal(out.sequences, by_hand), cache
            for got, want in zip(out.logits, logits):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_save_load_round_trip_and_trust_remote_code_without_hf_cgpu(tmp_path):
    m = model(**ALL)
    m.save_pretrained(tmp_path / "m")
    x = tokens(B=1)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = m.generate(x, **kw)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
        for key, value in ALL.items():
            assert getattr(loaded.config, key) == value, key
        torch.testing.assert_close(loaded(x).logits, m(x).logits, rtol=0, atol=0)
    torch.save({"ids": x, "want": want, "logits": m(x).logits.detach()}, tmp_path / "io.pt")
    run_without_hf_cgpu(f"""
        import torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path / "m")!r}, trust_remote_code=True).eval()
        assert type(m).__module__.startswith('transformers_modules'), type(m).__module__
        io = torch.load({str(tmp_path / "io.pt")!r})
        with torch.no_grad():
            assert torch.equal(m(io['ids']).logits, io['logits'])
            out = m.generate(io['ids'], max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert torch.equal(out, io['want']), (out, io['want'])
        print('OK')
        """, tmp_path)


@pytest.mark.parametrize("options", CASES, ids=IDS)
def test_ledger_counts_every_parameter(options):
    gpt = GPTSettings(n_layer=L, n_embd=32, n_head=4, seq_len=64, vocab_size=V, **options)
    m = CgptForCausalLM(gpt.model_config(V, 0))
    assert gpt.run_shape().model.n_params == sum(p.numel() for p in m.parameters())


def test_budget_of_the_tiny_preset_with_every_option_counts_the_model():
    flags = ["--value_embeddings", "2", "--logit_softcap", "15", "--unet_skips", "true", "--zero_init_head", "true",
             "--tie_word_embeddings", "false", "--layer_loops", "2"]
    shape, _, _ = describe_run(["--preset", "tiny", *flags])
    gpt = GPTSettings(n_layer=4, n_embd=128, n_head=4, seq_len=128, vocab_size=4096, value_embeddings=2,
                      logit_softcap=15.0, unet_skips=True, zero_init_head=True, tie_word_embeddings=False,
                      layer_loops=2)
    with torch.device("meta"):
        m = CgptForCausalLM(gpt.model_config(4096, 0))
    assert shape.model.n_params == sum(p.numel() for p in m.parameters())


def test_tiny_recipe_with_every_option_trains_and_generates(tmp_path):
    from hf_cgpu.cli import main

    out = tmp_path / "run"
    run = ["--preset", "tiny", "--n_layer", "4", "--n_embd", "64", "--seq_len", "64", "--vocab_size", "512",
           "--max_steps", "6", "--warmup_steps", "2", "--eval_steps", "3", "--eval_batches", "1",
           "--micro_batch_size", "4", "--value_embeddings", "2", "--logit_softcap", "15", "--unet_skips", "true",
           "--zero_init_head", "true", "--tie_word_embeddings", "false", "--layer_loops", "2"]
    rc = main(["train", "gpt", *run, "--progress", "false", "--max_new_tokens", "8", "--prompts", "The",
               "--mixed_precision", "no", "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(out)])
    assert rc == 0
    results = json.loads((out / "all_results.json").read_text())
    led = results["ledger"]  # the run priced itself as `hf-cgpu budget --card cpu` prices the same flags
    assert led["step_seconds"] == pytest.approx(price("gpt", run, CPU)["step_s"], rel=1e-4)
    assert results["step_seconds"] > 0
    assert led["measured_step_seconds"] == pytest.approx(results["step_seconds"], rel=1e-4)
    assert results["samples"] and results["samples"][0].startswith("The") and len(results["samples"][0]) > 3
    assert results["best_val_loss"] < math.log(512)  # below where the zero head starts: it learned
    config = json.loads((out / "config.json").read_text())
    assert config["value_embeddings"] == 2 and config["unet_skips"] and config["logit_softcap"] == 15.0
    assert config["layer_loops"] == 2


def test_every_option_compiles_as_one_graph():
    """No Python branch on a tensor's value: the whole model, loss and backward trace as one graph."""
    torch._dynamo.reset()
    m = model(**ALL).train()
    x = tokens()
    try:
        torch.compile(m, backend="eager", fullgraph=True)(input_ids=x, labels=x).loss.backward()
    finally:
        torch._dynamo.reset()
    assert m.transformer.value_embeds[0].weight.grad.any() and m.transformer.skip_weights.grad.all()
