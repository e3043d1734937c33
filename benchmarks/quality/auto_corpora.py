"""Corpora of a tenth, a third and all of a parquet corpus's training split, the validation split unchanged, for
``gpu_auto_preset.sh``: ``OUT/{tenth,third,all}/{train,validation}.parquet``. The subsets are the first rows of one
seeded shuffle, so the tenth lies inside the third.

    python benchmarks/quality/auto_corpora.py --src .data/zh-poetry --out /tmp/auto-corpora [--limit 2000]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

FRACTIONS = {"tenth": 1 / 10, "third": 1 / 3, "all": 1.0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, help="folder with train.parquet and validation.parquet")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=0, help="use only this many training rows (a smoke run); 0 = all")
    p.add_argument("--val_limit", type=int, default=0, help="use only this many validation rows; 0 = all")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    src, out = Path(args.src), Path(args.out)
    train = pq.read_table(src / "train.parquet")
    order = np.random.default_rng(args.seed).permutation(len(train))
    if args.limit:
        order = order[: args.limit]
    validation = pq.read_table(src / "validation.parquet")
    if args.val_limit:
        validation = validation.slice(0, args.val_limit)
    for name, fraction in FRACTIONS.items():
        folder = out / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        rows = np.sort(order[: max(1, round(fraction * len(order)))])
        pq.write_table(train.take(rows), folder / "train.parquet")
        pq.write_table(validation, folder / "validation.parquet")
        print(f"{name}: {len(rows):,} of {len(train):,} training rows, {len(validation):,} validation rows -> {folder}")


if __name__ == "__main__":
    main()
