"""What each convolution backward of the compiled flow UNet receives, and what it converts: dtype and layout of its
grad_output, input and weight (a dispatch mode over the backward only, so the forward stays compiled), and every
copy (``aten::_to_copy``, ``aten::clone``) that runs inside ``aten::convolution_backward`` (torch.profiler).
Issue 12's profile found activation-sized copies there (``aten::to`` -> ``aten::_to_copy``) after the layout fix.

GPU:  python benchmarks/throughput/flow_conv_probe.py            (base 128, batch 256, as the cifar10 preset)
CPU:  python benchmarks/throughput/flow_conv_probe.py --smoke    (base 16, batch 4, inductor with mkldnn off; the script only)
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def layout(t: torch.Tensor) -> str:
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return "channels_last"
    if t.is_contiguous():
        return "contiguous" if t.dim() != 4 or not t.is_contiguous(memory_format=torch.channels_last) else "both"
    return f"strided{tuple(t.stride())}"


class ConvArgs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution_backward.default:
            g, x, w = args[:3]
            self.seen[(tuple(g.shape), str(g.dtype), layout(g), tuple(x.shape), str(x.dtype), layout(x),
                       tuple(w.shape), str(w.dtype), layout(w), str(args[-1]))] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    from hf_cgpu.flow.matching import FlowMatcher
    from hf_cgpu.flow.unet import FlowUNet2DModel
    from hf_cgpu.tiers import apply_compile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.backends.mkldnn.enabled = False  # the CPU then takes the GPU's layout heuristic
    size, base, batch = (32, 16, 4) if a.smoke else (32, 128, 256)
    torch.manual_seed(0)
    model = FlowUNet2DModel(sample_size=size, base_channels=base, num_classes=10).to(dev)
    model = apply_compile(model.to(memory_format=torch.channels_last).train(), True)
    matcher = FlowMatcher(time_sampling="logit_normal")
    x1 = (torch.rand(batch, 3, size, size, device=dev) * 2 - 1).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (batch,), device=dev)

    def loss():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            return matcher.loss(lambda xt, t, y=None: model(xt, t, y).sample, x1, labels, cond_drop_prob=0.1,
                                null_class=10)

    for _ in range(3):
        loss().backward()
    probe = ConvArgs()
    out = loss()
    with probe:
        out.backward()
    print("| grad_output | input | weight | mask | calls |\n|---|---|---|---|---|")
    for k, n in sorted(probe.seen.items(), key=lambda kv: str(kv[0])):
        print(f"| {k[0]} {k[1]} {k[2]} | {k[3]} {k[4]} {k[5]} | {k[6]} {k[7]} {k[8]} | {k[9]} | {n} |")
    out = loss()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        out.backward()
    copies = collections.Counter()  # real copies: aten::to returns its input as is when the layout already fits
    for ev in prof.events():
        if ev.name not in ("aten::_to_copy", "aten::clone"):
            continue
        up = ev.cpu_parent
        while up is not None and up.name != "aten::convolution_backward":
            up = up.cpu_parent
        if up is not None:
            copies[(ev.name, str(ev.input_shapes[:1]), str(up.input_shapes[:3]))] += 1
    print(f"copies inside aten::convolution_backward: {sum(copies.values())} (op, copied shape <- the backward's "
          "grad_output, input, weight shapes)")
    for k, n in sorted(copies.items(), key=lambda kv: -kv[1]):
        print(f"  {n} x {k[0]} {k[1]} <- {k[2]}")

if __name__ == "__main__":
    main()
