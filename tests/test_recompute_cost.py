"""What recompute really reruns for a LoRA model (one forward of the blocks, never the embeddings or the head),
the selective policy (no large matmul and no attention again, same gradients), and autofit choosing no recompute
when the run fits without it."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPTNeoXForCausalLM

from conftest import tiny_neox_config
from hf_cgpu.models.causal_lm_loss import causal_lm_loss_from_hidden, unwrap_model
from hf_cgpu.settings import TrainSettings
from hf_cgpu.tiers import apply_tiers

BIG = ("aten.addmm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default")
"""GPTNeoX's base linears (with bias: addmm) and CPU attention; LoRA's own matmuls are aten.mm."""


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def lora_model(recompute: bool, policy: str = "full", compile_backend: str = ""):
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(tiny_neox_config())
    lora = TrainSettings(tier="lora", recompute=recompute, lora_r=4, lora_alpha=8, recompute_policy=policy)
    model = apply_tiers(model, lora, compile=bool(compile_backend), backend=compile_backend or "inductor")
    for n, p in model.named_parameters():
        if "lora_B" in n:  # non-zero B: every adapter is on the gradient path
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(n)))
    return model


def step(model):
    lm = unwrap_model(model)
    ids = torch.randint(0, lm.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    calls = collections.Counter()
    hooks = [m.register_forward_hook(lambda *_, n=n: calls.update([n]))
             for n, m in (("embed", lm.get_input_embeddings()), ("head", lm.get_output_embeddings()),
                          ("final_norm", lm.gpt_neox.final_layer_norm))]
    fwd, bwd = Ops(), Ops()
    with fwd:
        loss = causal_lm_loss_from_hidden(model, ids, ids)
    forward_calls = dict(calls)
    with bwd:
        loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    again = {n: c - forward_calls.get(n, 0) for n, c in calls.items() if c - forward_calls.get(n, 0)}
    return fwd.count, bwd.count, again, grads


@pytest.fixture(scope="module")
def runs():
    return {mode: step(lora_model(mode != "off", "selective" if mode == "selective" else "full"))
            for mode in ("off", "full", "selective")}


def test_full_recompute_reruns_each_block_once_and_nothing_else(runs):
    fwd_off, bwd_off, _, _ = runs["off"]
    fwd, bwd, again, _ = runs["full"]
    layers = tiny_neox_config().num_hidden_layers
    assert fwd_off[BIG[0]] == 4 * layers  # qkv, dense, h_to_4h, 4h_to_h per block
    for op in BIG:
        assert bwd_off[op] == 0
        assert bwd[op] == fwd[op], op  # every block's base matmuls and attention exactly once more
    assert again == {}  # embeddings, final norm and head are not run again


def test_selective_recompute_reruns_no_large_matmul_and_no_attention(runs):
    _, bwd, again, _ = runs["selective"]
    assert all(bwd[op] == 0 for op in BIG), {op: bwd[op] for op in BIG}
    assert again == {}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_keeps_the_gradients(runs, mode):
    ref, got = runs["off"][3], runs[mode][3]
    assert ref.keys() == got.keys() and ref
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4, msg=n)


def test_unknown_recompute_policy_is_one_line():
    with pytest.raises(ValueError, match="full, selective"):
        lora_model(True, "sometimes")


def test_autofit_takes_no_recompute_when_lora_fits_16gb():
    """The 1.4B LoRA preset asked with recompute on: autofit drops it (12.6 GiB fits 16 GB) and keeps it at 6 GB."""
    from hf_cgpu.budget import ModelShape, RunShape, autofit_settings
    from hf_cgpu.settings import TrainSettings

    shape = RunShape(ModelShape.reference("pythia-1.4b"), 1024, 1024, loss_in_forward=False)
    asked = TrainSettings(tier="lora", recompute=True, micro_batch_size=4, gradient_accumulation_steps=8,
                          memory_cap="16GB", autofit=True)
    fitted = autofit_settings(asked, shape, None, log=lambda m: None)
    assert (fitted.recompute, fitted.micro_batch_size, fitted.gradient_accumulation_steps) == (False, 4, 8)
    small = autofit_settings(TrainSettings(tier="lora", recompute=False, micro_batch_size=4,
                                           gradient_accumulation_steps=8, memory_cap="6GB", autofit=True),
                             shape, None, log=lambda m: None)
    assert small.recompute and small.micro_batch_size * small.gradient_accumulation_steps == 32


def test_lora_presets_train_without_recompute():
    from hf_cgpu.settings import load_preset

    assert load_preset("lora", "finetune")["recompute"] is False
    assert load_preset("qlora", "finetune")["recompute"] is False



def test_selective_recompute_without_compile_warns_with_the_fix():
    with pytest.warns(UserWarning, match="compile=True or recompute_policy='full'"):
        lora_model(True, "selective")


def test_selective_recompute_in_compiled_blocks_keeps_the_gradients(runs):
    """Compiled blocks apply the selective policy at tracing (no per-op Python policy at run time): the same
    gradients as no recompute. aot_eager traces exactly what inductor would compile, without codegen."""
    model = lora_model(True, "selective", compile_backend="aot_eager")
    ids = torch.randint(0, unwrap_model(model).config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    causal_lm_loss_from_hidden(model, ids, ids).backward()
    ref = runs["off"][3]
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert ref.keys() == got.keys() and ref
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4, msg=n)


def _old_style_layer(monkeypatch):
    """Make GPTNeoXLayer checkpoint as transformers before 5.23 did: in ``__call__``, around the whole module call
    (outside the region ``Module.compile`` compiles), its ``forward`` left unwrapped."""
    import functools

    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer

    def old_call(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(functools.partial(torch.nn.Module.__call__, self, **kwargs), *args)
        return torch.nn.Module.__call__(self, *args, **kwargs)

    monkeypatch.setattr(GPTNeoXLayer, "forward", getattr(GPTNeoXLayer.forward, "__wrapped__", GPTNeoXLayer.forward))
    monkeypatch.setattr(GPTNeoXLayer, "__call__", old_call, raising=False)


@pytest.mark.parametrize("transformers_style", ["current", "before-5.23"])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_compiled_blocks_trace_the_checkpoint(monkeypatch, transformers_style, policy):
    """Each compiled block's graph holds its checkpoint (so the backward graph holds the recompute and the policy
    decides what is saved) whichever way transformers checkpoints a layer; before 5.23 it wrapped the compiled call,
    and an H200 paid +111% wall time for +36% device time. Same gradients as no recompute either way."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch._dynamo.utils import counters

    if transformers_style != "current":
        _old_style_layer(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes})
        return aot_eager(gm, example_inputs)

    torch.manual_seed(0)
    lora = TrainSettings(tier="lora", recompute=True, lora_r=4, lora_alpha=8, recompute_policy=policy)
    model = apply_tiers(GPTNeoXForCausalLM(tiny_neox_config()), lora, compile=True, backend=backend)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(n)))
    ids = torch.randint(0, unwrap_model(model).config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    causal_lm_loss_from_hidden(model, ids, ids).backward()  # no dispatch mode: dynamo would leave the blocks eager
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert graphs and all("tag_activation_checkpoint" in " ".join(g) for g in graphs), graphs
    assert not counters["graph_break"], dict(counters["graph_break"])  # torch 2.11 broke on the forward's __get__
    ref = step(lora_model(False))[3]
    assert ref.keys() == grads.keys() and ref
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], atol=1e-5, rtol=1e-4, msg=n)
