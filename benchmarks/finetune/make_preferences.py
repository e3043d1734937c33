"""An offline preference set from zh-poetry, for `hf-cgpu train dpo` and benchmarks/finetune/bench_dpo_vs_trl.py.

Each pair: the prompt asks to continue a poem given its title, author and first lines (1 to 4); the chosen answer is
the poem's real next line, the rejected one a line of the same length from another poem (so length says nothing
about which is which). Train pairs come from the train split, validation pairs from the validation split, in a
fixed order (seeded): the same files every time. Writes OUT/train.jsonl and OUT/validation.jsonl in TRL's standard
preference format (prompt, chosen, rejected as strings); --conversational writes them as lists of {role, content}
messages. The files are made where they are needed and never committed as data.

    python benchmarks/finetune/make_preferences.py --zh ../shared/data/zh-poetry --out /tmp/prefs --train 2000
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path

PROMPT = "續寫這首詩的下一句。\n{title}\n{author}\n{lines}"
MAX_PROMPT_LINES = 4
"""The prompt holds the poem's first 1 to 4 lines (prompts of about a hundred characters at most)."""


def poems(path: Path) -> list[tuple[str, str, list[str]]]:
    """(title, author, lines) of every poem of a zh-poetry parquet file with at least two lines."""
    import pyarrow.parquet as pq

    out = []
    for text in pq.read_table(path, columns=["text"]).column("text").to_pylist():
        parts = [p.strip() for p in text.split("\n")]
        if len(parts) >= 4 and all(parts[2:]):
            out.append((parts[0], parts[1], parts[2:]))
    return out


def pairs(source: list[tuple[str, str, list[str]]], n: int, seed: int, conversational: bool = False) -> list[dict]:
    """``n`` preference rows (fewer where ``source`` runs out) of ``source``'s poems, in a seeded order."""
    rng = random.Random(seed)
    by_length: dict[int, list[str]] = defaultdict(list)
    for _, _, lines in source:
        for line in lines:
            by_length[len(line)].append(line)
    order = list(range(len(source)))
    rng.shuffle(order)
    rows = []
    for i in order:
        title, author, lines = source[i]
        k = rng.randrange(1, min(len(lines), MAX_PROMPT_LINES + 1))
        chosen = lines[k]
        others = [line for line in rng.sample(by_length[len(chosen)], min(8, len(by_length[len(chosen)])))
                  if line != chosen]
        if not others:
            continue
        prompt = PROMPT.format(title=title, author=author, lines="\n".join(lines[:k]))
        row = {"prompt": prompt, "chosen": chosen, "rejected": others[0]}
        if conversational:
            row = {"prompt": [{"role": "user", "content": prompt}],
                   "chosen": [{"role": "assistant", "content": chosen}],
                   "rejected": [{"role": "assistant", "content": others[0]}]}
        rows.append(row)
        if len(rows) == n:
            break
    return rows


def write(folder: Path, name: str, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--zh", default="../shared/data/zh-poetry", help="zh-poetry folder (train.parquet, "
                   "validation.parquet)")
    p.add_argument("--out", required=True, help="folder for train.jsonl and validation.jsonl")
    p.add_argument("--train", type=int, default=2000, help="training pairs")
    p.add_argument("--validation", type=int, default=200, help="held-out pairs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversational", action="store_true", help="messages instead of plain strings")
    a = p.parse_args(argv)
    out = Path(a.out)
    for split, n in (("train", a.train), ("validation", a.validation)):
        rows = pairs(poems(Path(a.zh) / f"{split}.parquet"), n, a.seed, a.conversational)
        print(f"{write(out, split, rows)}: {len(rows):,} pairs")


if __name__ == "__main__":
    main()
