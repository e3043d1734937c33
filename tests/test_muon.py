"""Muon on the hidden matrices + AdamW on the rest (hf_cgpu.optim): the update, the grouping, the schedule, state."""

import copy

import pytest
import torch

from hf_cgpu.errors import SettingsError
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.optim import build_optimizer
from hf_cgpu.optim.muon import MuonSettings
from hf_cgpu.optim.muon_optimizer import MuonWithAdamW
from hf_cgpu.settings import TrainSettings
from hf_cgpu.train.schedule import set_lr


def _muon(lr: float, **muon) -> TrainSettings:
    """The settings of a Muon run at AdamW peak ``lr`` (Muon's own settings by name)."""
    return TrainSettings(learning_rate=lr, optimizer="muon", optimizer_options=MuonSettings(**muon))


def _gpt(**kw):
    torch.manual_seed(0)
    base = dict(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, loss_chunk_size=0)
    return CgptForCausalLM(CgptConfig(**{**base, **kw}))


def _muon_step_delta(shape, lr=0.1):
    """What one Muon step (momentum 0, so the update is NS(grad)) subtracts from a matrix of ``shape``, over lr."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(*shape))
    opt = MuonWithAdamW([{"params": [w], "use_muon": True, "lr": lr, "lr_scale": 1.0, "momentum": 0.0,
                          "weight_decay": 0.0}], lr=lr)
    before = w.detach().clone()
    w.grad = torch.randn(*shape)
    opt.step()
    return (before - w.detach()) / lr


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32)])
def test_newton_schulz_update_is_nearly_orthogonal_and_scaled_by_aspect(shape):
    delta = _muon_step_delta(shape)
    scale = max(1.0, shape[0] / shape[1]) ** 0.5  # Keller Jordan's max(1, rows/cols)^0.5
    sv = torch.linalg.svdvals(delta / scale)
    # the quintic (3.4445, -4.7750, 2.0315) in bf16 aims at ~Uniform(0.5, 1.5), not exactly 1
    assert sv.min() > 0.6 and sv.max() < 1.3, sv
    assert abs(sv.mean().item() - 1.0) < 0.25, sv.mean()


def test_grouping_puts_block_matrices_on_muon_and_the_rest_on_adamw():
    for tie in (True, False):
        model = _gpt(tie_word_embeddings=tie, position_embedding="rotary", qk_norm=True)
        opt = build_optimizer(model, _muon(1e-3, muon_learning_rate=0.02))
        names = {id(p): n for n, p in model.named_parameters()}
        muon = sorted(names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"])
        want = sorted(n for n, p in model.named_parameters() if ".h." in n and p.ndim == 2)
        assert muon == want and all(n.endswith(("qkv.weight", "proj.weight", "fc.weight", "fc_out.weight"))
                                    for n in muon)
        adam = {names[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]}
        assert "transformer.wte.weight" in adam and ("lm_head.weight" in adam) == (not tie)
        assert len(muon) + len(adam) == len(names)


def test_schedule_scales_muon_by_its_ratio_and_leaves_adamw_exact():
    model = _gpt()
    opt = build_optimizer(model, _muon(1e-3, muon_learning_rate=0.02))
    set_lr(opt, 3e-4)
    for g in opt.param_groups:
        assert g["lr"] == (pytest.approx(6e-3, rel=1e-12) if g["use_muon"] else 3e-4)
    plain = build_optimizer(_gpt(), TrainSettings(learning_rate=1e-3))
    assert type(plain) is torch.optim.AdamW and all("lr_scale" not in g for g in plain.param_groups)
    set_lr(plain, 3e-4)
    assert all(g["lr"] == 3e-4 for g in plain.param_groups)


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 97, (2, 16), generator=g)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_state_dict_round_trip_continues_exactly():
    model = _gpt(position_embedding="rotary", qk_norm=True, activation="relu2")
    opt = build_optimizer(model, _muon(1e-3))
    _train(model, opt, 3)
    state = copy.deepcopy(opt.state_dict())
    assert any("momentum_buffer" in s for s in state["state"].values())  # Muon's
    assert any("exp_avg_sq" in s for s in state["state"].values())  # AdamW's
    twin = copy.deepcopy(model)
    twin_opt = build_optimizer(twin, _muon(1e-3))
    twin_opt.load_state_dict(state)
    _train(model, opt, 3, seed=2)
    _train(twin, twin_opt, 3, seed=2)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name


def test_muon_needs_the_full_tier():
    with pytest.raises(SettingsError, match="use --tier full or --optimizer adamw"):
        TrainSettings(optimizer="muon", tier="lora")
    with pytest.raises(SettingsError, match="choose one of adamw, muon"):
        TrainSettings(optimizer="sgd")
    with pytest.raises(SettingsError, match="use --tier full or --optimizer adamw"):
        TrainSettings(tier="adamw8bit", optimizer="muon")


def test_the_ledger_ladder_never_lowers_a_muon_run_to_an_8bit_or_adapter_tier():
    from hf_cgpu.budget.ladder import LADDER
    from hf_cgpu.budget.shape import TrainSetup

    tiers = [r for r in LADDER if r.key in ("adamw8bit", "lora", "qlora")]
    assert tiers and all(r.lower(TrainSetup(optimizer="muon"), 8192, 1) is None for r in tiers)
    assert tiers[0].lower(TrainSetup(), 8192, 1).tier == "adamw8bit"


def test_batched_step_is_torch_muon_up_to_bf16_rounding():
    """Our shape-batched Newton-Schulz step against torch.optim.Muon.step itself (batched=False), 3 steps with momentum
    and weight decay: the same weights up to bf16 rounding of the orthogonalised update, the same momentum state."""
    model = _gpt(position_embedding="rotary", qk_norm=True, activation="relu2")
    twin = copy.deepcopy(model)
    opts = []
    for m, batched in ((model, True), (twin, False)):
        opt = build_optimizer(m, _muon(1e-2, muon_weight_decay=0.5, muon_learning_rate=0.05))
        opt.batched = batched
        opts.append(opt)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(model, opts[0], 3)
    _train(twin, opts[1], 3)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        moved = (b - start[name]).abs().max()
        assert moved > 0, name
        assert (a - b).abs().max() <= 0.02 * moved + 1e-6, name  # bf16 has 8 bits of mantissa
    muon_params = [p for g in opts[0].param_groups if g["use_muon"] for p in g["params"]]
    assert muon_params
    twin_params = dict(zip([id(p) for p in model.parameters()], twin.parameters()))
    for p in muon_params:
        ours, theirs = opts[0].state[p]["momentum_buffer"], opts[1].state[twin_params[id(p)]]["momentum_buffer"]
        torch.testing.assert_close(ours, theirs, rtol=0.05, atol=1e-4)


def test_batched_newton_schulz_matches_torch_per_matrix():
    from torch.optim._muon import _zeropower_via_newtonschulz

    from hf_cgpu.optim.muon_optimizer import newton_schulz_batched

    torch.manual_seed(0)
    for shape in [(48, 16), (16, 48), (32, 32)]:
        g = torch.randn(3, *shape)
        ours = newton_schulz_batched(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        for i in range(3):
            ref = _zeropower_via_newtonschulz(g[i], (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
            assert (ours[i] - ref).abs().max() < 0.03, shape


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_embedding_tables_take_their_learning_rate_with_the_same_decay_per_step(optimizer):
    """Adam's first step moves every element by exactly lr (m / sqrt(v) = sign(g)) after decoupled decay lr * wd: the
    value tables (and an untied token table) at --embedding_learning_rate, with the decay per step of the others."""
    lr, embed_lr, wd = 1e-3, 0.05, 0.5
    options = MuonSettings() if optimizer == "muon" else None
    settings = TrainSettings(learning_rate=lr, embedding_learning_rate=embed_lr, weight_decay=wd, adam_eps=1e-12,
                             optimizer=optimizer, optimizer_options=options)
    model = _gpt(value_embeddings=1, tie_word_embeddings=False)
    opt = build_optimizer(model, settings)
    set_lr(opt, lr)  # the schedule at its peak
    tables = [model.transformer.wte.weight, *(t.weight for t in model.transformer.value_embeds)]
    others = [model.lm_head.weight]
    before = {id(p): p.detach().clone() for p in tables + others}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for p, rate in [(p, embed_lr) for p in tables] + [(p, lr) for p in others]:
        expected = before[id(p)] * (1 - lr * wd) - rate * p.grad.sign()
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


def test_embedding_learning_rate_off_keeps_the_groups_and_a_tied_table_is_refused():
    plain = build_optimizer(_gpt(value_embeddings=1), TrainSettings(learning_rate=1e-3))
    assert [len(g["params"]) for g in plain.param_groups] == [
        len(g["params"]) for g in build_optimizer(_gpt(value_embeddings=1),
                                                  TrainSettings(learning_rate=1e-3, embedding_learning_rate=0.0))
        .param_groups]
    assert all("lr_scale" not in g for g in plain.param_groups)
    with pytest.raises(SettingsError, match="tie_word_embeddings false"):
        build_optimizer(_gpt(position_embedding="rotary"), TrainSettings(learning_rate=1e-3,
                                                                         embedding_learning_rate=0.01))


def test_an_optimizer_that_ignores_the_embedding_learning_rate_is_refused():
    from hf_cgpu.optim import OPTIMIZERS, OptimizerSpec

    OPTIMIZERS.add("plain-sgd", OptimizerSpec(
        "plain-sgd", "SGD over one group", state_bytes=lambda tensors, tier: (0.0, ""),
        build=lambda model, named, s, fused: torch.optim.SGD([p for _, p in named], lr=s.learning_rate)))
    try:
        settings = TrainSettings(learning_rate=1e-3, embedding_learning_rate=0.01, optimizer="plain-sgd")
        with pytest.raises(SettingsError, match="does not take --embedding_learning_rate"):
            build_optimizer(_gpt(), settings)
        build_optimizer(_gpt(), TrainSettings(learning_rate=1e-3, optimizer="plain-sgd"))  # without the flag: fine
    finally:
        OPTIMIZERS.remove("plain-sgd")
