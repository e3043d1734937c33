"""Where the modern GPT options lose speed: the zh-poetry step, one option at a time, one process (issue 12 / 8).

The step of `--preset zh-poetry` / `zh-poetry-modern`: 12x768, vocab 8192, seq 512, dropout 0.2, micro-batch 32 x
accumulation 4 (65,536 tokens per optimizer step), bf16 autocast, the whole model compiled (`hf_cgpu.tiers`), clip 1.0,
the loop's optimizer (`hf_cgpu.optim.build_optimizer`: fused AdamW, or Muon + AdamW). Each architecture compiles once
and serves its optimizers. Per row: end-to-end ms per optimizer step (median, no syncs inside the step), tokens/s,
and the same step with a sync after each phase: forward+backward (4 micro-steps), clipping, optimizer.

GPU:  python benchmarks/throughput/bench_gpt_modern_speed.py --json $OUT/modern_speed.json
CPU:  python benchmarks/throughput/bench_gpt_modern_speed.py --smoke     (tiny shapes, eager: checks the script, no figure)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

ARCHS = {
    "plain": {},
    "rotary": {"position_embedding": "rotary"},
    "rotary+qk_norm": {"position_embedding": "rotary", "qk_norm": True},
    "modern": {"position_embedding": "rotary", "qk_norm": True, "activation": "relu2"},
}
ROWS = [("plain", "adamw"), ("plain", "muon-torch"), ("plain", "muon-batched"), ("rotary", "adamw"),
        ("rotary+qk_norm", "adamw"), ("modern", "adamw"), ("modern", "muon-torch"), ("modern", "muon-batched")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", default=",".join(f"{a}/{o}" for a, o in ROWS))
    p.add_argument("--json", default="")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()

    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM
    from hf_cgpu.optim import build_optimizer
    from hf_cgpu.optim.muon import MuonSettings
    from hf_cgpu.settings import TrainSettings
    from hf_cgpu.tiers import apply_tiers

    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if a.smoke:
        shape = dict(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        micro, seq, accum, a.warmup, a.steps = 2, 32, 2, 1, 2
    else:
        shape = dict(vocab_size=8192, n_positions=512, n_embd=768, n_layer=12, n_head=12)
        micro, seq, accum = 32, 512, 4
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = [tuple(r.split("/")) for r in a.rows.split(",")]
    results = []
    for arch in dict.fromkeys(r[0] for r in rows):
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = CgptConfig(**shape, dropout=0.2, bias=False, loss_chunk_size=0, **ARCHS[arch])
        model = CgptForCausalLM(cfg).to(dev)
        model = apply_tiers(model, TrainSettings(tier="full", recompute=False), compile=cuda)
        x = torch.randint(0, cfg.vocab_size, (accum, micro, seq + 1), device=dev)
        t_compile = time.perf_counter()
        compile_s = None  # the first optimizer of an architecture pays its compilation in the warm-up
        for arch_, opt_name in rows:
            if arch_ != arch:
                continue
            kind = "adamw" if opt_name == "adamw" else "muon"
            muon = MuonSettings(muon_learning_rate=0.02, muon_weight_decay=0.1) if kind == "muon" else None
            opt = build_optimizer(model, TrainSettings(tier="full", learning_rate=1e-3, weight_decay=0.1,
                                                       optimizer=kind, optimizer_options=muon))
            if kind == "muon":
                opt.batched = opt_name == "muon-batched"

            def step(phases=None):
                marks = [time.perf_counter()]
                for i in range(accum):
                    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                        loss = model(input_ids=x[i, :, :-1], shift_labels=x[i, :, 1:], use_cache=False,
                                     return_logits=False).loss
                    (loss / accum).backward()
                if phases is not None:
                    sync()
                    marks.append(time.perf_counter())
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if phases is not None:
                    sync()
                    marks.append(time.perf_counter())
                opt.step()
                opt.zero_grad(set_to_none=True)
                if phases is not None:
                    sync()
                    marks.append(time.perf_counter())
                    phases.append([1e3 * (b - c) for c, b in zip(marks, marks[1:])])

            for _ in range(a.warmup):
                step()
            sync()
            warmup_s = None
            if compile_s is None:
                compile_s = warmup_s = round(time.perf_counter() - t_compile, 1)
            times = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                step()
                sync()
                times.append(1e3 * (time.perf_counter() - t0))
            phases: list[list[float]] = []
            for _ in range(a.steps):
                step(phases)
            med = statistics.median(times)
            row = {"arch": arch, "optimizer": opt_name, "ms_per_step": med,
                   "tok_per_s": accum * micro * seq / (med / 1e3),
                   "phases_ms": {k: statistics.median(ph[j] for ph in phases)
                                 for j, k in enumerate(("forward+backward", "clip", "optimizer"))},
                   "warmup_s_incl_compile": warmup_s,
                   "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
            results.append(row)
            ph = row["phases_ms"]
            print(f"| {arch} | {opt_name} | {med:.1f} | {row['tok_per_s']:,.0f} | {ph['forward+backward']:.1f} | "
                  f"{ph['clip']:.1f} | {ph['optimizer']:.1f} |", flush=True)
            del opt
        del model
        if cuda:
            torch.cuda.empty_cache()
    env = {"device": torch.cuda.get_device_name() if cuda else "CPU (smoke: the script only)",
           "torch": torch.__version__, "micro_batch": micro, "seq": seq, "accumulation": accum}
    print(json.dumps(env))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": env, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
