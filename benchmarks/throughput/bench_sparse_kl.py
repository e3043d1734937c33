"""The loss chunk of a cached teacher's step (``--teacher_top_k``), forward + backward, eager as the run calls it and
compiled, against the plain chunked cross-entropy (issue 52). A run that compiles its model compiles the chunk.

zh-poetry-modern's micro-batch: 16,384 tokens x 768 wide, vocabulary 8,192, top-32, bf16 autocast, the chunk
checkpointed as ``chunked_ce_sparse_kl`` does it. Prints the median ms per micro-batch over 20 runs after 5 warm-up
runs. GPU only:  python benchmarks/throughput/bench_sparse_kl.py   (SMOKE=1: a tiny shape on the CPU)
"""

import os
import statistics
import time

import torch

from hf_cgpu.models.cgpt.modeling_cgpt import chunked_cross_entropy
from hf_cgpu.tasks.teacher_cache import chunked_ce_sparse_kl


def timed(fn, sync, runs: int = 20, warm: int = 5) -> float:
    """Median milliseconds of ``fn()`` (forward and backward)."""
    out = []
    for i in range(warm + runs):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warm:
            out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def main() -> None:
    smoke = bool(os.environ.get("SMOKE"))
    dev = "cpu" if smoke else "cuda"
    n, c, v, k = (256, 32, 512, 8) if smoke else (16384, 768, 8192, 32)
    sync = (lambda: None) if smoke else torch.cuda.synchronize
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(n, c, device=dev, generator=gen, requires_grad=True)
    weight = (0.02 * torch.randn(v, c, device=dev, generator=gen)).requires_grad_()
    targets = torch.randint(0, v, (n,), device=dev, generator=gen)
    ids = torch.randint(0, v, (n, k), device=dev, generator=gen)
    values = torch.randn(n, k, device=dev, generator=gen).log_softmax(-1)
    amp = torch.autocast(dev, dtype=torch.bfloat16)

    def step(loss_fn):
        def run():
            with amp:
                loss = loss_fn()
            loss.backward()
            hidden.grad = weight.grad = None
        return run

    rows = {"plain cross-entropy, one checkpointed chunk": step(lambda: chunked_cross_entropy(hidden, weight, targets, n)),
            "cross-entropy + sparse KL, eager (an eager run's)": step(
                lambda: sum(chunked_ce_sparse_kl(hidden, weight, targets, ids, values, 0)))}
    rows["cross-entropy + sparse KL, the chunk compiled (a compiled run's)"] = step(
        lambda: sum(chunked_ce_sparse_kl(hidden, weight, targets, ids, values, 0, compiled=True)))
    times = {name: timed(fn, sync) for name, fn in rows.items()}
    name = "CPU (smoke)" if smoke else torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}: {n:,} tokens x {c} wide, vocabulary {v:,}, top-{k}, bf16 autocast")
    print("| loss chunk, forward + backward | ms a micro-batch |\n|---|---|")
    for row, ms in times.items():
        print(f"| {row} | {ms:.2f} |")


if __name__ == "__main__":
    main()
