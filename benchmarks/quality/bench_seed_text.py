"""The seed chapter's text recipe as a plain script, to compare our zh-poetry preset against at equal time.

What the chapter prescribes, written the nanoGPT way (our own code): a 12 x 768 GPT (12 heads, seq 1024, no bias,
no dropout, tied embeddings; the package's CgptForCausalLM, which is that architecture), a 32k byte-level BPE with
GPT-2's pre-tokenizer, micro-batch 8 x accumulation 16, AdamW (0.9, 0.95), lr 6e-4, weight decay 0.1 on >=2-D
weights, warmup 400 then cosine to 10%, clip 1.0, bf16 autocast, torch.compile, fused AdamW, TF32, and random
windows cut from the token stream at any offset (``get_batch``). The cosine is sized to the time budget from the
step time measured after compilation. Validation uses the package's ``score_stream`` (whole split, bits per
character), so both sides are scored by one function; its time is not charged to the budget.

    python benchmarks/quality/bench_seed_text.py --data .data/zh-poetry --minutes 7 --out /tmp/seed_text
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def byte_level_bpe(texts, vocab_size: int):
    """GPT-2-style byte-level BPE (GPT-2's regex pre-tokenizer), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/data/zh-poetry")
    p.add_argument("--minutes", type=float, default=7.0, help="training time budget (compile included)")
    p.add_argument("--out", default="runs/seed_text")
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--accum", type=int, default=16)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=400)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--tokenizer_docs", type=int, default=50000)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    from hf_cgpu.data.corpus import load_text_dataset
    from hf_cgpu.data.packing import pack_dataset
    from hf_cgpu.evaluation.text import score_stream
    from hf_cgpu.models.cgpt import CgptConfig, CgptForCausalLM

    torch.manual_seed(a.seed)
    torch.set_float32_matmul_precision("high")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ds = load_text_dataset(a.data)
    docs = ds["train"].shuffle(seed=0).select(range(min(a.tokenizer_docs, len(ds["train"]))))["text"]
    tok = byte_level_bpe(docs, a.vocab)
    train = pack_dataset(ds["train"], tok, a.seq_len, cache_dir=out / "cache")
    val = pack_dataset(ds["validation"], tok, a.seq_len, cache_dir=out / "cache")
    stream = torch.from_numpy(train.tokens.astype("int64"))
    print(f"train {train.n_tokens:,} tokens ({train.n_chars / train.n_tokens:.3f} chars/token), val {val.n_tokens:,}")

    cfg = CgptConfig(vocab_size=len(tok), n_positions=a.seq_len, n_embd=a.n_embd, n_layer=a.n_layer,
                     n_head=a.n_head, dropout=0.0, bias=False, loss_chunk_size=0,
                     eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    model = CgptForCausalLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    step_model = torch.compile(model) if a.compile and dev.type == "cuda" else model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    gen = torch.Generator().manual_seed(a.seed)

    def get_batch():
        starts = torch.randint(0, len(stream) - a.seq_len - 1, (a.micro,), generator=gen)
        block = torch.stack([stream[s : s + a.seq_len + 1] for s in starts.tolist()]).to(dev, non_blocking=True)
        return block[:, :-1], block[:, 1:]

    def evaluate() -> dict:
        model.eval()
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            r = score_stream(lambda x, y: step_model(input_ids=x, shift_labels=y, use_cache=False).loss,
                             val, a.seq_len, a.micro, dev)
        model.train()
        return r

    total_steps = None  # sized to the budget once the step time is known
    budget = 60 * a.minutes
    spent, history, step = 0.0, [], 0
    tokens_per_step = a.micro * a.accum * a.seq_len

    def lr_at(k: int, n: int) -> float:
        if k < a.warmup:
            return a.lr * (k + 1) / a.warmup
        t = min(1.0, (k - a.warmup) / max(1, n - a.warmup))
        return 0.1 * a.lr + 0.45 * a.lr * (1 + math.cos(math.pi * t))

    while total_steps is None or step < total_steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps or 10**9)
        opt.zero_grad(set_to_none=True)
        for _ in range(a.accum):
            x, y = get_batch()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = step_model(input_ids=x, shift_labels=y, use_cache=False).loss
            (loss / a.accum).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_loss = loss.item()  # syncs: the step time below is real
        spent += time.perf_counter() - t0
        step += 1
        if step == 25:
            spent_at_25 = spent  # compiled and warm from here
        if step == 35 and total_steps is None:  # size the cosine to the time that is left
            per_step = (spent - spent_at_25) / 10
            total_steps = step + int((budget - spent) / per_step)
            print(f"step time {per_step * 1000:.0f} ms -> {total_steps} steps in {a.minutes} minutes")
        if step % 20 == 0:
            print(f"step {step} loss {train_loss:.4f} grad_norm {float(gnorm):.2f} "
                  f"{tokens_per_step * step / spent:,.0f} tok/s (incl. compile)")
        if (a.eval_every and step % a.eval_every == 0) or step == total_steps or spent > budget:
            r = evaluate()
            history.append({"step": step, "minutes": spent / 60, "train_loss": train_loss, **r})
            print(f"step {step}: val_loss {r['loss']:.4f} val_bpc {r['bpc']:.4f}")
        if spent > budget:
            break
    final, best = history[-1], min(history, key=lambda h: h["loss"])
    result = {
        "recipe": "seed train_text.py configuration, random windows", "params": n_params, "steps": step,
        "tokens": step * tokens_per_step, "epochs": step * tokens_per_step / train.n_tokens,
        "minutes": spent / 60, "tok_per_s": step * tokens_per_step / spent,
        "chars_per_token_val": val.n_chars / val.n_tokens, "train_loss": final["train_loss"],
        "val_loss": final["loss"], "val_bpc": final["bpc"], "best_val_loss": best["loss"],
        "best_val_bpc": best["bpc"], "best_step": best["step"], "history": history,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
