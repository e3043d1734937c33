"""What a compiled LoRA block reruns in its backward, per recompute policy: the matmuls and attention calls in the
forward and backward graphs that AOTAutograd hands to the compiler (inductor's own partitioner, which applies the
selective policy's MUST_SAVE / PREFER_RECOMPUTE tags), and how many graphs were compiled over a few steps
(a recompile would show as more graphs).

Counts, not times: the same on any device, so the CPU answers whether ``--recompute`` under compile reruns what it
should (issue 12: selective recompute of compiled blocks measured +93% on an H200, more than full recompute).

    python benchmarks/throughput/lora_recompute_graphs.py [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


def count_ops(gm) -> collections.Counter:
    """Ops by name; an op run under the rng-state wrappers (the forward saves the generator state for an op with
    randomness, the backward replays it when it reruns the op) counts as itself."""
    ops = collections.Counter()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if name == "run_and_save_rng_state":
            name = str(n.args[0])
        elif name == "run_with_rng_state":
            name = str(n.args[1])
        ops[name] += 1
    return ops


def measure(mode: str, steps: int) -> dict:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from hf_cgpu.settings import TrainSettings
    from hf_cgpu.tiers import apply_tiers

    graphs = collections.defaultdict(list)

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return gm.forward
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    cfg = GPTNeoXConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                        vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    settings = TrainSettings(tier="lora", recompute=mode != "off", compile=True, train_mode="finetune",
                             recompute_policy="selective" if mode == "selective" else "full")
    model = apply_tiers(GPTNeoXForCausalLM(cfg), settings, backend=backend)
    x = torch.randint(0, 256, (2, 64))
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x, use_cache=False).loss  # as the fine-tuning task calls it
        loss.backward()
    row = {"mode": mode, "graphs_forward": len(graphs["forward"]), "graphs_backward": len(graphs["backward"])}
    for kind in ("forward", "backward"):
        ops = count_ops(graphs[kind][-1])  # the graph the later blocks run (a block's first may differ)
        row[f"{kind}_matmuls"] = sum(ops[m] for m in MATMULS)
        row[f"{kind}_attention"] = sum(v for k, v in ops.items() if "scaled_dot_product" in k and "backward" not in k)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default="")
    a = p.parse_args()
    rows = [measure(mode, a.steps) for mode in ("off", "full", "selective")]
    print(f"GPTNeoX 2 x 128, LoRA r16 on every linear, blocks compiled (inductor's partitioner), {a.steps} steps")
    print("| recompute | graphs (fw / bw) | forward: matmuls / attention | backward: matmuls / attention forwards "
          "rerun |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['graphs_forward']} / {r['graphs_backward']} | {r['forward_matmuls']} / "
              f"{r['forward_attention']} | {r['backward_matmuls']} / {r['backward_attention']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"steps": a.steps, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
