"""One compiled CgptAttention layer, forward + backward, with and without rotary positions (issue 12).

zh-poetry shape: micro-batch 32 x seq 512, 768 wide, 12 heads, dropout 0.2, bf16 autocast. Prints the median ms per
layer and micro-step over 20 runs after 5 warm-up runs, and the six longest device kernels of one run (the rotary
kernel is the fused triton one). GPU only:  python benchmarks/throughput/bench_rotary_attention.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # benchmarks/tools
from gpu_gpt_profile import kernel_times  # noqa: E402
from hf_cgpu.models.cgpt import CgptConfig  # noqa: E402
from hf_cgpu.models.cgpt.modeling_cgpt import CgptAttention, rotary_cos_sin  # noqa: E402


def main() -> None:
    dev = "cuda"
    cfg = CgptConfig(vocab_size=8192, n_positions=512, n_embd=768, n_layer=1, n_head=12, dropout=0.2, bias=False)
    cfg._attn_implementation = "sdpa"
    B, T, C = 32, 512, 768
    cos_sin = rotary_cos_sin(torch.arange(T, device=dev)[None], C // cfg.n_head, 10000.0)
    for name, rotary in (("none", False), ("rotary", True)):
        torch._dynamo.reset()
        attn = CgptAttention(cfg, 0).to(dev).train()

        def layer(x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return attn(x, None, position_embeddings=cos_sin if rotary else None)[0]

        run = torch.compile(layer, dynamic=False)
        x = torch.randn(B, T, C, device=dev, requires_grad=True)
        for _ in range(5):
            run(x).float().sum().backward()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            run(x).float().sum().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(x).float().sum().backward()
            torch.cuda.synchronize()
        kernels = {name: ms for name, (_, ms) in kernel_times(prof).items()}
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:6]
        print(f"{name}: {1e3 * statistics.median(times):.3f} ms forward+backward per layer and micro-step; "
              f"top kernels (ms): {[(k[:60], round(v, 3)) for k, v in top]}", flush=True)


if __name__ == "__main__":
    main()
