"""Characters per token of hf_cgpu's byte-level BPE on zh-poetry validation (CPU).

    python benchmarks/quality/zh_chars_per_token.py --data ../shared/data/zh-poetry --vocab_size 32000 --train_docs 50000
Trains the tokenizer exactly as recipes/train_gpt.py does (a shuffled sample of train_docs training poems).
"""

import argparse
import time

from hf_cgpu.data.corpus import load_text_dataset
from hf_cgpu.data.tokenizer import train_tokenizer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="../shared/data/zh-poetry")
    p.add_argument("--vocab_size", type=int, default=32000)
    p.add_argument("--train_docs", type=int, default=50000)
    a = p.parse_args()
    ds = load_text_dataset(a.data)
    train = ds["train"].shuffle(seed=0).select(range(min(a.train_docs, len(ds["train"]))))
    t0 = time.perf_counter()
    tok = train_tokenizer(train["text"], vocab_size=a.vocab_size, show_progress=False)
    dt = time.perf_counter() - t0
    val = list(ds["validation"]["text"])
    chars = sum(len(t) for t in val)
    tokens = sum(len(ids) for ids in tok(val)["input_ids"])
    print(f"vocab {len(tok)} trained on {len(train)} poems in {dt:.0f} s; validation {chars:,} chars / "
          f"{tokens:,} tokens = {chars / tokens:.3f} chars per token")


if __name__ == "__main__":
    main()
