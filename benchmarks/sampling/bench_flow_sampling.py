"""Sampling speed of the flow UNet: images/s for ``--num_images`` images at 20 network evaluations, by mode.

The UNet of ``--preset cifar10`` (base 128, class-conditional, 10 classes; random weights: speed does not depend on
them), ``FlowMatchPipeline`` with the Euler scheduler at 20 steps (20 evaluations, guidance 1), batches of
``--batch`` images, labels cycling over the classes. Modes (``--modes``):

    eager-fp32       the pipeline as loaded (fp32 weights)
    eager-bf16       weights cast to bf16
    compiled-bf16    the UNet compiled in place (``dynamic=False``)
    graphed-bf16     compiled with ``mode="reduce-overhead"`` (CUDA graphs)

The first batch of every mode is a warm-up (compile, graph capture) and is timed apart; images/s is over the rest.

GPU:  python benchmarks/sampling/bench_flow_sampling.py --json $OUT/flow_sampling.json
CPU:  python benchmarks/sampling/bench_flow_sampling.py --smoke      (base 32, 32 images, 2 steps: checks the script only)
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    from hf_cgpu.flow.pipeline_flow_match import FlowMatchPipeline
    from hf_cgpu.flow.scheduling_flow_match import FlowMatchEulerScheduler
    from hf_cgpu.flow.unet import FlowUNet2DModel

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num_images", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20, help="Euler steps = network evaluations")
    p.add_argument("--base_channels", type=int, default=128)
    p.add_argument("--modes", default="eager-fp32,eager-bf16,compiled-bf16,graphed-bf16")
    p.add_argument("--json", default="")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    if a.smoke:
        a.num_images, a.batch, a.steps, a.base_channels, a.modes = 32, 16, 2, 32, "eager-fp32,eager-bf16"
    dev = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    rows = []
    for mode in a.modes.split(","):
        torch.manual_seed(0)
        torch._dynamo.reset()
        unet = FlowUNet2DModel(sample_size=32, base_channels=a.base_channels, num_classes=10).to(dev).eval()
        if mode.endswith("bf16"):
            unet = unet.to(torch.bfloat16)
        unet = unet.to(memory_format=torch.channels_last)
        if mode.startswith("compiled"):
            unet.compile(dynamic=False)
        elif mode.startswith("graphed"):
            unet.compile(dynamic=False, mode="reduce-overhead")
        pipe = FlowMatchPipeline(unet=unet, scheduler=FlowMatchEulerScheduler()).to(dev)
        pipe.set_progress_bar_config(disable=True)
        labels = (torch.arange(a.batch) % 10).tolist()
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def batch(i: int):
            g = torch.Generator(device=dev).manual_seed(i)
            with torch.inference_mode():
                return pipe(batch_size=a.batch, num_inference_steps=a.steps, generator=g, class_labels=labels,
                            output_type="pt").images

        t0 = time.perf_counter()
        batch(0)
        sync()
        warm = time.perf_counter() - t0
        n = max(1, a.num_images // a.batch - 1)
        t0 = time.perf_counter()
        for i in range(n):
            batch(i + 1)
        sync()
        seconds = time.perf_counter() - t0
        rows.append({"mode": mode, "img_per_s": n * a.batch / seconds, "warmup_batch_s": warm, "batches": n,
                     "batch": a.batch, "evaluations": a.steps})
        print(json.dumps(rows[-1]), flush=True)
    where = torch.cuda.get_device_name() if cuda else "CPU (smoke: no figure to quote)"
    print(f"{where} | {a.num_images} images at {a.steps} evaluations, batch {a.batch}")
    print("| mode | img/s | first batch (s) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['img_per_s']:,.0f} | {r['warmup_batch_s']:.1f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": where, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
