"""The flow speed benchmarks' model variants compute the UNet's function: flow_step_variants.py's decoder without
concatenation, and bench_seed_flow_speed.py's UNet with the seed's layers (torch's group norm and upsampling)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "throughput"))
from bench_seed_flow_speed import seed_layers  # noqa: E402
from flow_step_variants import channel_moments_from_sums, settings, split_forward  # noqa: E402
from test_flow_unet import group_norm_case  # noqa: E402

from hf_cgpu.flow.unet import FlowUNet2DModel  # noqa: E402


def _run(model, forward, x, t, y, compiled):
    m = copy.deepcopy(model)
    f = lambda *a: forward(m, *a).sample  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, backend="aot_eager", dynamic=False)
    out = f(x, t, y)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out, [p.grad for p in m.parameters()]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_split_decoder_matches_the_concatenating_forward(compiled):
    """Same output and parameter gradients as FlowUNet2DModel.forward (eager, native group norm), eager and traced
    (where the group norm takes the channel-moments path), on channels_last inputs with non-trivial weights."""
    torch.manual_seed(0)
    model = FlowUNet2DModel(sample_size=8, base_channels=16, norm_num_groups=4, num_classes=3)
    model = model.to(memory_format=torch.channels_last)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    t, y = torch.rand(2), torch.tensor([0, 2])
    ref, ref_grads = _run(model, FlowUNet2DModel.forward, x, t, y, compiled=False)
    out, grads = _run(model, split_forward, x, t, y, compiled)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    if compiled:  # no image-sized concatenation is built (the two skips'), only small ones of (n, c) moments
        cats = {}
        for name, forward in (("plain", FlowUNet2DModel.forward), ("split", split_forward)):
            dims = []

            def backend(gm, example_inputs):
                dims.extend(n.meta["example_value"].dim() for n in gm.graph.nodes if "cat" in str(n.target))
                return gm.forward

            torch._dynamo.reset()
            torch.compile(lambda *a: forward(model, *a).sample, backend=backend, dynamic=False)(x, t, y)
            cats[name] = dims.count(4)
        assert cats == {"plain": 2, "split": 0}, cats


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit, match="unknown variant"):
        settings("graphs+nope")
    assert settings("split-cat+graphs") == ("reduce-overhead", {}, False)


def test_seed_layers_trace_torch_group_norm_and_upsampling_with_the_same_values(monkeypatch):
    """The seed's baseline compiles torch's own group norm and nearest upsampling (what the seed's unet.py runs),
    not hf_cgpu's layout-keeping forms, and computes the same function."""
    from hf_cgpu.flow import unet

    torch.manual_seed(0)
    model = FlowUNet2DModel(sample_size=8, base_channels=16, norm_num_groups=4).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    t = torch.rand(2)

    def traced():
        ops = []

        def backend(gm, example_inputs):
            ops.extend(str(n.target) for n in gm.graph.nodes)
            return gm.forward

        torch._dynamo.reset()
        out = torch.compile(lambda a, b: model(a, b).sample, backend=backend, dynamic=False)(x, t)
        return out, " ".join(ops)

    ours, ours_ops = traced()
    monkeypatch.setattr(unet.GroupNorm, "forward", unet.GroupNorm.forward)  # restored after the test
    monkeypatch.setattr(unet, "upsample2x", unet.upsample2x)
    seed_layers()
    seed, seed_ops = traced()
    assert "group_norm" not in ours_ops and "interpolate" not in ours_ops
    assert "group_norm" in seed_ops and "interpolate" in seed_ops
    torch.testing.assert_close(seed, ours, atol=1e-5, rtol=1e-5)


def test_channel_moments_from_sums_match_torch_group_norm(monkeypatch):
    """flow_step_variants.py's gn-sums variant: the traced group norm with the moments from sums gives nn.GroupNorm's
    values and gradients (channels with different means, the case where a variance by subtraction loses digits
    first)."""
    from torch._dynamo.backends.debugging import aot_eager

    from hf_cgpu.flow.unet import GroupNorm

    ours, ref, x = group_norm_case()
    monkeypatch.setattr(GroupNorm, "channel_moments", staticmethod(channel_moments_from_sums))
    torch._dynamo.reset()
    f = torch.compile(ours, backend=aot_eager, dynamic=False)
    outs, grads = [], []
    for m in (f, ref):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y)
        grads.append(xi.grad)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-4)
