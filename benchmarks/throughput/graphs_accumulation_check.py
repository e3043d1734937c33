"""GPU: gradient accumulation under CUDA graphs (``--compile_mode reduce-overhead``) gives the gradients of the
default compile, with the trainer's ``before_graphed_micro_batch`` and without it (where torch raises, or on older
versions adds into overwritten buffers: pytorch#169545, #96693).

For each model (a small GPT compiled whole, the flow UNet compiled whole, LoRA on a small GPTNeoX with each block
compiled as ``apply_tiers`` does), three optimizer steps of ``--accumulation`` micro-batches in fp32, the gradients
of each step compared with the same steps under the default compile mode. One JSON line per row: max relative
difference of the gradients, or the error.

GPU:  python benchmarks/throughput/graphs_accumulation_check.py --json $OUT/graphs_accumulation.json
CPU:  python benchmarks/throughput/graphs_accumulation_check.py --smoke   (no CUDA graphs on the CPU: eager, checks the script)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def build(kind: str, dev):
    """(model, batch maker: k -> kwargs of the k-th micro-batch, loss of the output) for ``kind``."""
    g = torch.Generator().manual_seed(0)
    if kind == "gpt":
        from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM

        model = CgptForCausalLM(CgptConfig(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2))
        data = [torch.randint(0, 512, (4, 65), generator=g) for _ in range(16)]
        return model, lambda k: {"input_ids": data[k][:, :-1].to(dev), "shift_labels": data[k][:, 1:].to(dev),
                                 "use_cache": False}, lambda out: out.loss
    if kind == "flow":
        from hf_cgpu.flow.unet import FlowUNet2DModel

        model = FlowUNet2DModel(sample_size=8, base_channels=16, norm_num_groups=4, num_classes=3)
        data = [(torch.randn(4, 3, 8, 8, generator=g), torch.rand(4, generator=g)) for _ in range(16)]
        return model, lambda k: {"sample": data[k][0].to(dev), "timestep": data[k][1].to(dev),
                                 "class_labels": torch.arange(4, device=dev) % 3}, lambda out: out.sample.square().mean()
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=128, max_position_embeddings=64))
    data = [torch.randint(0, 512, (4, 64), generator=g) for _ in range(16)]
    return model, lambda k: {"input_ids": data[k].to(dev), "labels": data[k].to(dev), "use_cache": False}, \
        lambda out: out.loss


def run(kind: str, mode: str | None, helper: bool, a, dev) -> list[list[torch.Tensor]]:
    """The gradients after each of ``a.steps`` optimizer steps (SGD, so the weights move between steps)."""
    from hf_cgpu.settings import TrainSettings
    from hf_cgpu.tiers import apply_tiers
    from hf_cgpu.train.step import before_graphed_micro_batch

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch, loss_of = build(kind, dev)
    model = model.to(dev)
    if kind == "lora":
        settings = TrainSettings(tier="lora", recompute=False, compile=a.compile, compile_mode=mode or "default",
                                 lora_r=4, lora_alpha=8, train_mode="finetune")
        model = apply_tiers(model, settings)
    elif a.compile:
        model = torch.compile(model, mode=mode, dynamic=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    grads = []
    for step in range(a.steps):
        for k in range(a.accumulation):
            if helper and mode is not None:
                before_graphed_micro_batch(params, k, a.accumulation)
            (loss_of(model(**batch(step * a.accumulation + k))) / a.accumulation).backward()
        grads.append([p.grad.detach().clone() for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt,flow,lora")
    p.add_argument("--accumulation", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    a.compile = cuda
    graphs = "reduce-overhead" if cuda else None
    rows = []
    for kind in a.models.split(","):
        reference = run(kind, None, False, a, dev)
        for helper in (True, False):
            row = {"model": kind, "mode": graphs or "eager (smoke)", "helper": helper, "accumulation": a.accumulation}
            try:
                got = run(kind, graphs, helper, a, dev)
                row["max_rel_diff"] = max(((g - r).norm() / r.norm().clamp_min(1e-12)).item()
                                          for gs, rs in zip(got, reference) for g, r in zip(gs, rs))
            except Exception as e:  # noqa: BLE001 - the failure is the measurement
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "CPU",
                                            "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
