"""The ledger's answer for each shipped job on named cards (no GPU needed): memory on the card, step time, and the
steps a preset's minutes hold, as ``hf-cgpu budget --card NAME`` prints them one by one.

    python benchmarks/ledger/card_table.py                       # the 12, 16 and 24 GB cards, markdown
    python benchmarks/ledger/card_table.py --cards "RTX 5070 Ti"
"""

from __future__ import annotations

import argparse

from hf_cgpu.budget.card import find_card
from hf_cgpu.budget.memory import GiB
from hf_cgpu.commands.budget import describe_run, price, price_card

JOBS = (
    ("zh-poetry-modern (7 min)", ["--preset", "zh-poetry-modern"]),
    ("GPT 124M", ["--preset", "124m", "--max_minutes", "60"]),
    ("GPT 350M", ["--preset", "350m", "--max_minutes", "60"]),
    ("GPT 770M (8-bit, recompute)", ["--preset", "770m", "--max_minutes", "60"]),
    ("LoRA Pythia-1.4B", ["--preset", "pythia-1.4b", "--tier", "lora", "--max_minutes", "60"]),
    ("QLoRA Pythia-1.4B", ["--preset", "pythia-1.4b", "--tier", "qlora", "--max_minutes", "60"]),
    ("flow UNet, CIFAR-10 (4 min)", ["--task", "flow", "--preset", "cifar10", "--max_minutes", "4"]),
    ("flow-distill (7 min)", ["--task", "flow-distill", "--preset", "cifar10"]),
    ("CIFAR-10 classifier", ["--task", "classifier", "--preset", "cifar10"]),
)
CARDS = ("RTX 3060", "RTX 5070", "RTX 4060 Ti 16GB", "RTX 5070 Ti", "RTX 4090", "RTX 5090")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cards", default=",".join(CARDS))
    a = p.parse_args()
    cards = [find_card(c) for c in a.cards.split(",")]
    print("| job | " + " | ".join(f"{c.name} ({c.memory_gib:g} GB)" for c in cards) + " |")
    print("|---|" + "---|" * len(cards))
    for name, argv in JOBS:
        task = argv[1] if argv[0] == "--task" else "gpt"
        if task == "gpt":
            shape, train, _ = describe_run(argv)
            minutes = train.max_minutes
        else:
            from hf_cgpu.commands.budget import image_run

            minutes = image_run(task, argv[2:])[1].max_minutes
        cells = []
        for card in cards:
            fig = (price_card(shape, shape.setup(train), train, card) if task == "gpt" else
                   price(task, argv[2:], card))
            if not fig["fits"]:
                cells.append(f"needs {fig['total_gib']:.1f} GiB: does not fit")
                continue
            held = f"{fig['steps']:,} steps in {minutes:g} min" if minutes else f"{fig['steps']:,} steps"
            cells.append(f"{fig['total_gib']:.1f} GiB, {fig['step_s']:.2f} s/step, {held}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
