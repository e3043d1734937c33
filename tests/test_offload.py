"""--recompute_policy offload: full recompute with each block's checkpointed input kept in host memory. The same
gradients as full recompute (on the CPU the copies are real copies into fresh host buffers), every block's input
and nothing else offloaded, the ledger's rows for it, and CUDA graphs refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from conftest import TINY_VOCAB, tiny_neox_config
from hf_cgpu.budget import TrainSetup
from hf_cgpu.budget.memory import activation_bytes, ledger
from hf_cgpu.budget.time import HOST_LINK_GBS, flops_per_token, step_time
from hf_cgpu.budget.card import find_card
from hf_cgpu.budget.work import lm_step_work
from hf_cgpu.cli import main as cli_main
from hf_cgpu.commands.budget import preset_shape
from hf_cgpu.errors import SettingsError
from hf_cgpu.models.causal_lm_loss import causal_lm_loss_from_hidden
from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tiers import apply_tiers, load_base_model
from hf_cgpu.tiers.recompute import HostOffload


def _llama():
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=TINY_VOCAB,
                                        max_position_embeddings=64))


def _cgpt():
    return CgptForCausalLM(CgptConfig(vocab_size=TINY_VOCAB, n_positions=64, n_embd=32, n_layer=3, n_head=2))


MODELS = {"gptneox": lambda: GPTNeoXForCausalLM(tiny_neox_config()), "llama": _llama, "cgpt": _cgpt}


@pytest.fixture
def packed(monkeypatch):
    """What ``HostOffload.pack`` moved to host memory, in order."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    pack = HostOffload.pack

    def counting(self, t):
        out = pack(self, t)
        seen.append((t.detach().clone(), out))
        return out

    monkeypatch.setattr(HostOffload, "pack", counting)
    return seen


def _grads(family: str, policy: str, backend: str = "", base: str = "") -> dict[str, torch.Tensor]:
    """One step's gradients of ``family`` (a tiny model made here, or with ``base`` the QLoRA of that folder)."""
    torch.manual_seed(0)
    model = load_base_model(base, "qlora") if base else MODELS[family]()
    tier = "qlora" if base else ("full" if family == "cgpt" else "lora")
    settings = TrainSettings(tier=tier, train_mode="pretrain" if tier == "full" else "finetune", recompute=True,
                             recompute_policy=policy, lora_r=4, lora_alpha=8)
    model = apply_tiers(model, settings, compile=bool(backend), backend=backend or "inductor")
    for n, p in model.named_parameters():
        if "lora_B" in n:  # non-zero B: every adapter is on the gradient path
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(n)))
    ids = torch.randint(0, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    if family == "cgpt":
        loss = model(input_ids=ids, labels=ids).loss
    else:
        loss = causal_lm_loss_from_hidden(model, ids, ids, chunk_size=16)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_offload_keeps_the_gradients_of_full_recompute(family, packed):
    full = _grads(family, "full")
    assert not packed
    offloaded = _grads(family, "offload")
    assert full.keys() == offloaded.keys() and full
    for name in full:
        assert torch.equal(offloaded[name], full[name]), name
    layers = {"gptneox": 2, "llama": 2, "cgpt": 3}[family]
    stashed = [(t, s) for t, s in packed if not isinstance(s, torch.Tensor)]
    assert len(stashed) == layers  # every block's input, and nothing inside the blocks
    for t, s in stashed:
        assert torch.equal(s.host, t) and s.host.data_ptr() != t.data_ptr()  # a copy, not the same storage


def test_offload_keeps_the_qlora_gradients(neox_dir, packed):
    """A 4-bit base (bitsandbytes' nf4 linears, on the CPU here): the same mechanism, the same gradients."""
    full = _grads("gptneox", "full", base=str(neox_dir))
    offloaded = _grads("gptneox", "offload", base=str(neox_dir))
    assert full.keys() == offloaded.keys() and all("lora_" in n for n in full) and full
    for name in full:
        assert torch.equal(offloaded[name], full[name]), name
    assert len([s for _, s in packed if not isinstance(s, torch.Tensor)]) == 2


@pytest.mark.slow
def test_offload_in_compiled_blocks_keeps_the_gradients(packed):
    """Compile mode default: the checkpoint (and its hooks) inside each compiled block still offloads."""
    full = _grads("gptneox", "full")
    compiled = _grads("gptneox", "offload", backend="aot_eager")
    assert len([s for _, s in packed if not isinstance(s, torch.Tensor)]) == 2
    for name in full:
        assert torch.equal(compiled[name], full[name]), name


def _pythia(policy: str, recompute: bool = True, **run) -> TrainSetup:
    return TrainSetup(tier="lora", train_mode="finetune", recompute=recompute, recompute_policy=policy,
                      seq_len=32768, micro_batch_size=1, gradient_accumulation_steps=1, **run)


def test_ledger_offload_keeps_two_block_inputs_on_the_card_and_every_one_in_host_memory():
    shape = preset_shape("pythia-1.4b")
    full, off = ledger(shape, _pythia("full")), ledger(shape, _pythia("offload"))
    block_input = 2 * 2048 * 32768  # bf16 residual of one block, one row of 32,768 tokens
    assert off.host_pinned == 24 * block_input and full.host_pinned == 0
    outside = full.row("activations") - 24 * block_input
    assert off.row("activations") == outside + 2 * block_input
    assert off.row("recompute_layer") == full.row("recompute_layer")
    assert off.allocated == full.allocated - 22 * block_input
    assert off.as_dict()["host_pinned"] == off.host_pinned


def test_the_rebuilt_blocks_backward_holds_its_gradients_and_offload_reserves_its_copy_pool():
    """The arithmetic of the two fitted terms, pinned: 31 x d bytes a token beside a re-run block of a frozen base,
    and offload's copy-stream pool on top of the allocator's usual reserve."""
    shape = preset_shape("pythia-1.4b")
    full, off = ledger(shape, _pythia("full")), ledger(shape, _pythia("offload"))
    grads = 31 * 2048 * 32768
    assert full.row("recompute_layer") == activation_bytes(shape, _pythia("full")).recompute_layer + grads
    assert full.reserved == pytest.approx(1.04 * full.allocated, rel=1e-9)
    assert off.reserved == pytest.approx(1.20 * off.allocated, rel=1e-9)
    assert not ledger(shape, dataclasses.replace(_pythia("offload"), seq_len=131072), memory_cap=16 * 2**30).fits


def test_time_adds_the_copies_beside_the_compute(monkeypatch):
    shape, card = preset_shape("pythia-1.4b"), find_card("h100")
    full, off = _pythia("full"), _pythia("offload")
    assert flops_per_token(shape, off) == flops_per_token(shape, full)  # the same recompute
    t_full, t_off = step_time(lm_step_work(shape, full), card), step_time(lm_step_work(shape, off), card)
    copies = next(r for r in t_off.rows if r.key == "host_copies")
    assert copies.seconds == 2 * 24 * 2 * 2048 * 32768 / (HOST_LINK_GBS * 1e9)
    assert t_off.seconds == t_full.seconds  # at 25 GB/s the copies hide behind the compute
    slow = dataclasses.replace(lm_step_work(shape, off), host_copy_bytes=1e6 * copies.seconds * HOST_LINK_GBS * 1e9)
    t_slow = step_time(slow, card)
    assert t_slow.seconds == pytest.approx(t_slow.copy_seconds + t_slow.optimizer_device_seconds, rel=0.01)
    assert t_slow.bound.startswith("copy-bound")


def test_budget_answers_for_offload_and_drops_a_presets_cuda_graphs(capsys):
    argv = ["budget", "--preset", "pythia-1.4b", "--tier", "lora", "--recompute", "true", "--recompute_policy",
            "offload", "--seq_len", "32768"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "host memory" in out and "host copies" in out and "CUDA graphs keep a memory pool" not in out


@pytest.mark.parametrize("typed", [["--compile_mode", "reduce-overhead"], ["--compile", "true"]])
def test_offload_under_typed_cuda_graphs_is_one_line(typed, capsys):
    argv = ["budget", "--preset", "pythia-1.4b", "--tier", "lora", "--recompute", "true", "--recompute_policy",
            "offload", *typed]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --recompute_policy offload") and "--compile_mode default" in err
    assert err.count("\n") == 1


def test_offload_settings_made_in_code():
    s = TrainSettings(tier="lora", train_mode="finetune", recompute=True, recompute_policy="offload", compile=True,
                      compile_mode="reduce-overhead")
    assert s.compile_mode == "default"  # no flag typed: a preset's choice, dropped
    with pytest.raises(SettingsError, match="CUDA graphs"):
        TrainSettings(tier="lora", train_mode="finetune", recompute=True, recompute_policy="offload", compile=True,
                      compile_mode="max-autotune", given_flags="compile_mode")
