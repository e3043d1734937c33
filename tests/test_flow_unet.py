"""Contract tests for FlowUNet2DModel on tiny widths (the parameter counts use the meta device)."""

import pytest
import torch

from hf_cgpu.flow.unet import FlowUNet2DModel


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("base, millions", [(128, 6.1), (160, 9.3), (192, 13.3)])
def test_parameter_counts_match_the_chapter(base, millions):
    with torch.device("meta"):
        model = FlowUNet2DModel(base_channels=base)
    assert round(_params(model) / 1e6, 1) == millions


def test_class_embedding_adds_one_null_row():
    with torch.device("meta"):
        plain, cond = FlowUNet2DModel(base_channels=128), FlowUNet2DModel(base_channels=128, num_classes=10)
    assert _params(cond) - _params(plain) == 11 * 256
    assert cond.null_class == 10 and plain.null_class is None


def _tiny(**kw) -> FlowUNet2DModel:
    torch.manual_seed(0)
    return FlowUNet2DModel(base_channels=16, time_embed_dim=32, **kw).eval()


def test_forward_shapes_and_timestep_forms():
    model = _tiny()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        out = model(x, torch.full((3,), 0.3)).sample
        assert out.shape == (3, 3, 32, 32)
        assert torch.allclose(model(x, 0.3).sample, out, atol=1e-6)
        assert torch.allclose(model(x, torch.tensor(0.3)).sample, out, atol=1e-6)
        assert model(x, 0.3, return_dict=False)[0].shape == out.shape
        assert not torch.allclose(model(x, 0.7).sample, out)  # time reaches the blocks


def test_per_sample_times_are_independent():
    model = _tiny()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        both = model(x, torch.tensor([0.1, 0.9])).sample
        first = model(x[:1], torch.tensor([0.1])).sample
    assert torch.allclose(both[:1], first, atol=1e-5)


def test_class_conditioning_and_null_class():
    model = _tiny(num_classes=4)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        a = model(x, 0.5, torch.tensor([0, 0])).sample
        b = model(x, 0.5, torch.tensor([1, 1])).sample
        null = model(x, 0.5, torch.tensor([4, 4])).sample
        none = model(x, 0.5).sample
    assert not torch.allclose(a, b)
    assert torch.allclose(null, none)  # no labels on a conditional model = the null class
    with pytest.raises(ValueError, match="num_classes"):
        _tiny()(x, 0.5, torch.tensor([0, 1]))


def test_gradient_checkpointing_same_grads_and_used(monkeypatch):
    x, t = torch.randn(2, 3, 32, 32), torch.tensor([0.2, 0.8])
    grads = []
    calls = []
    for checkpointing in (False, True):
        model = _tiny().train()
        if checkpointing:
            model.enable_gradient_checkpointing()
            inner = model._gradient_checkpointing_func
            model._gradient_checkpointing_func = lambda *a: calls.append(1) or inner(*a)
        model(x, t).sample.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert len(calls) == 5  # d1, d2, mid, u2, u1
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_channels_last_and_bf16():
    model = _tiny()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x, 0.4).sample
        cl = model.to(memory_format=torch.channels_last)(x.to(memory_format=torch.channels_last), 0.4).sample
        assert torch.allclose(ref, cl, atol=1e-5)
        low = model.to(torch.bfloat16)(x.to(torch.bfloat16), torch.tensor([0.4, 0.4])).sample
    assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), ref, atol=0.1)


def test_save_load_round_trip(tmp_path):
    model = _tiny(num_classes=3)
    model.save_pretrained(tmp_path)
    loaded = FlowUNet2DModel.from_pretrained(tmp_path).eval()
    assert loaded.config.num_classes == 3 and loaded.config.base_channels == 16
    x = torch.randn(1, 3, 32, 32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    with torch.no_grad():  # same weights; oneDNN may pick another kernel for mmap-loaded tensors (~1e-6)
        a, b = model(x, 0.5, torch.tensor([2])).sample, loaded(x, 0.5, torch.tensor([2])).sample
    assert torch.allclose(a, b, atol=1e-5)


def test_bad_widths_fail_with_the_fix():
    with pytest.raises(ValueError, match="norm_num_groups"):
        FlowUNet2DModel(base_channels=12)


def group_norm_case():
    """hf_cgpu's GroupNorm (random affine weights), torch's with the same weights, and a channels_last input whose
    channels have different means (where the group's between-channel term and a variance by subtraction matter)."""
    from hf_cgpu.flow.unet import GroupNorm

    torch.manual_seed(0)
    ours, ref = GroupNorm(4, 16), torch.nn.GroupNorm(4, 16)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
    ref.load_state_dict(ours.state_dict())
    x = (3 * torch.randn(2, 16, 6, 5) + torch.linspace(-4, 8, 16).view(1, 16, 1, 1)).contiguous(
        memory_format=torch.channels_last)
    return ours, ref, x


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_group_norm_keeps_channels_last_and_the_values(autocast):
    """Under compile the UNet's GroupNorm runs as elementwise ops + var_mean on a channels_last input (no group_norm
    op in the traced graph, whose CUDA kernels would hand the backward contiguous tensors), its one reduction over
    the activation per (image, channel) (the pixels only; the group's moments are combined from those): output,
    dtype, layout and gradients as nn.GroupNorm's, fp32 and under bf16 autocast (where group_norm returns fp32), on
    channels whose means differ (the combination's between-channel term)."""
    from torch._dynamo.backends.debugging import aot_eager

    ours, ref, x = group_norm_case()
    targets, reductions = [], []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            targets.append(str(n.target))
            if "var_mean" in str(n.target):
                reductions.append((n.args[1:], n.kwargs))
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(ours, backend=backend, dynamic=False)
    outs, grads = [], []
    for m in (compiled, ref):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(xi)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y)
        grads.append((xi.grad, *(p.grad for p in m.parameters())))
    assert targets and not any("group_norm" in t for t in targets), targets
    assert len(reductions) == 1 and tuple(reductions[0][1].get("dim") or reductions[0][0][0]) == (2, 3), reductions
    assert outs[0].dtype == outs[1].dtype == torch.float32
    assert outs[0].is_contiguous(memory_format=torch.channels_last) and not outs[0].is_contiguous()
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_compiled_upsample_keeps_channels_last_and_the_values():
    """Under compile upsample2x works on the NHWC view of a channels_last input: the values of nearest upsampling,
    and both the output and the gradient sent back are channels_last."""
    import torch.nn.functional as F
    from torch._dynamo.backends.debugging import aot_eager

    from hf_cgpu.flow.unet import upsample2x

    torch._dynamo.reset()
    targets = []

    def backend(gm, example_inputs):  # the CPU's native op keeps channels_last too; CUDA's lowering did not
        targets.extend(str(n.target) for n in gm.graph.nodes)
        return aot_eager(gm, example_inputs)

    x = torch.randn(2, 6, 4, 3).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    y = torch.compile(upsample2x, backend=backend, dynamic=False)(x)
    assert targets and not any("interpolate" in t or "upsample" in t for t in targets), targets
    ref = F.interpolate(x.detach(), scale_factor=2.0, mode="nearest")
    torch.testing.assert_close(y, ref, atol=0, rtol=0)
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    g = torch.randn_like(y).contiguous(memory_format=torch.channels_last)
    y.backward(g)
    assert x.grad.is_contiguous(memory_format=torch.channels_last) and not x.grad.is_contiguous()
    torch.testing.assert_close(x.grad, g.view(2, 6, 4, 2, 3, 2).sum((3, 5)), atol=1e-6, rtol=1e-6)
    assert torch.equal(upsample2x(x.detach().contiguous()), ref)  # eager / NCHW: the native op

