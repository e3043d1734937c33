"""One row of ``gpu_auto_preset.sh``'s table from a finished cell: what the run chose (or its preset set), how far it
got, and ``hf-cgpu eval``'s validation bits/char. Appends a Markdown row to TABLE and a JSON line to JSONL.

    python benchmarks/quality/auto_table.py CELL RUN_DIR TRAIN_LOG EVAL_JSON TABLE JSONL
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HEADER = ("| cell | corpus tokens | preset | minutes | shape | dropout | wd Muon / AdamW | warm-up | min lr | steps "
          "(schedule) | epochs | best step | loop val bpc | **eval val bpc** |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")


def row(cell: str, run: Path, log: str, eval_json: Path) -> dict:
    results = json.loads((run / "all_results.json").read_text()) if (run / "all_results.json").is_file() else {}
    s = results.get("settings", {})
    found = re.search(r"train ([\d,]+) tokens", log)
    tokens = int(found.group(1).replace(",", "")) if found else 0
    evaluated = json.loads(eval_json.read_text()) if eval_json.is_file() else {}
    auto = next((line for line in log.splitlines() if line.startswith("auto: ")), "")
    return {"cell": cell, "corpus_tokens": tokens, "preset": cell.rsplit("-", 1)[-1], "minutes": s.get("max_minutes"),
            "shape": f"{s.get('n_layer')}x{s.get('n_embd')}"
            + (f", {s['value_embeddings']} value tables" if s.get("value_embeddings") else ""),
            "dropout": s.get("dropout"),
            "weight_decay": s.get("weight_decay"), "muon_weight_decay": s.get("muon_weight_decay"),
            "warmup_steps": s.get("warmup_steps"), "min_lr_ratio": s.get("min_lr_ratio"),
            "steps": results.get("steps"), "schedule_steps": results.get("schedule_steps"),
            "epochs": round(results.get("toks_seen", 0) / tokens, 1) if tokens else None,
            "best_step": results.get("best_step"), "loop_val_bpc": results.get("val_bpc"),
            "eval_val_bpc": evaluated.get("val_bpc", evaluated.get("bpc")), "auto": auto}


def markdown(r: dict) -> str:
    def f(x, fmt="{}"):
        return "-" if x is None else fmt.format(x)

    return (f"| {r['cell']} | {r['corpus_tokens']:,} | {r['preset']} | {f(r['minutes'])} | {r['shape']} | "
            f"{f(r['dropout'])} | {f(r['muon_weight_decay'])} / {f(r['weight_decay'])} | {f(r['warmup_steps'])} | "
            f"{f(r['min_lr_ratio'])} | {f(r['steps'])} ({f(r['schedule_steps'])}) | {f(r['epochs'])} | "
            f"{f(r['best_step'])} | {f(r['loop_val_bpc'], '{:.4f}')} | **{f(r['eval_val_bpc'], '{:.4f}')}** |\n")


def main(argv: list[str]) -> None:
    cell, run, log, eval_json, table, jsonl = argv
    r = row(cell, Path(run), Path(log).read_text(errors="replace") if Path(log).is_file() else "", Path(eval_json))
    table_path = Path(table)
    if not table_path.is_file():
        table_path.write_text(HEADER)
    with table_path.open("a") as fh:
        fh.write(markdown(r))
    with open(jsonl, "a") as fh:
        fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(markdown(r), end="")


if __name__ == "__main__":
    main(sys.argv[1:])
