"""The ledger's prediction beside each measured configuration of ``run_all.py``: peak allocated and reserved memory
(GiB), step time (ms) and its parts, priced on the card the call measured (its ``hf-cgpu bench``).

    python benchmarks/ledger/compare.py ledger_A.json [ledger_B.json ...] --bench bench.json [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bases import PYTHIA, SMOL  # noqa: E402

from hf_cgpu.bench import BenchResult  # noqa: E402
from hf_cgpu.budget.card import card_from_bench  # noqa: E402
from hf_cgpu.budget.memory import GiB  # noqa: E402

DROP = {"--dataset", "--output_dir", "--overwrite_output_dir", "--prompts", "--max_new_tokens", "--save_best",
        "--progress", "--log_steps", "--sample_every_epochs", "--cpu"}
"""Training flags the ledger does not take (they change no memory or step time)."""


def base_configs(root: Path) -> dict[str, str]:
    """config.json folders of the random bases and of set B's flow-distill teacher (the base-192 flow run: its
    pipeline's model_index.json and unet/config.json as the flow task saves them; no weights: the ledger reads the
    configs only)."""
    from hf_cgpu.budget.images import unet_config

    teacher = root / "teacher"
    (teacher / "unet").mkdir(parents=True, exist_ok=True)
    (teacher / "unet" / "config.json").write_text(json.dumps(unet_config(base_channels=192)))
    (teacher / "model_index.json").write_text(json.dumps({
        "_class_name": "FlowMatchPipeline", "unet": ["hf_cgpu", "FlowUNet2DModel"],
        "scheduler": ["hf_cgpu", "FlowMatchHeunScheduler"], "num_inference_steps": 6, "guidance_scale": 2.5,
        "guidance_interval": [0.25, 0.8]}))
    out = {"teacher": str(teacher)}
    for name, shape, model_type in (("pythia", PYTHIA, "gpt_neox"), ("smol", SMOL, "llama")):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps({"model_type": model_type, **shape}))
        out[name] = str(d)
    return out


def budget_argv(command: list[str], bases: dict[str, str]) -> tuple[str, list[str]]:
    """(task, ``hf-cgpu budget`` flags) of a ``train TASK ...`` command."""
    task, rest = command[1], command[2:]
    out, i = [], 0
    while i < len(rest):
        flag = rest[i]
        value = rest[i + 1] if i + 1 < len(rest) else ""
        if flag in DROP:
            i += 2
            continue
        if flag == "--model":
            value = bases["pythia" if "pythia" in value else "smol"]
        if flag == "--teacher":
            value = bases["teacher"]
        out += [flag, value]
        i += 2
    return task, out


def predict(task: str, argv: list[str], card) -> dict:
    """Predicted figures of one configuration (language-model tasks through ``hf-cgpu budget``'s own parsing)."""
    from hf_cgpu.commands.budget import price

    return price(task, argv, card)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("files", nargs="+")
    p.add_argument("--bench", required=True)
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args()
    card = card_from_bench(BenchResult.from_dict(json.loads(Path(a.bench).read_text())))
    bases = base_configs(Path(tempfile.mkdtemp()))
    rows = []
    for f in a.files:
        for rec in json.loads(Path(f).read_text()):
            task, argv = budget_argv(rec["command"], bases)
            try:
                pred = predict(task, argv, card)
            except Exception as err:  # a configuration the ledger cannot price yet: said in the table
                pred = {"error": f"{type(err).__name__}: {err}"}
            rows.append((rec, pred))
    head = ("config", "set", "alloc meas", "alloc pred", "err", "resv meas", "resv pred", "err", "step ms meas",
            "step ms pred", "err", "device ms (mm/attn/other)", "pred ms (mm/attn/mem/kern)")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for rec, pred in rows:
        m_alloc, m_resv, m_step = rec.get("peak_alloc_gib"), rec.get("peak_reserved_gib"), rec.get("wall_s_per_step")
        prof = (rec.get("profile") or {}).get("ms_per_step", {})
        mm = prof.get("matmul", 0) + prof.get("convolution", 0)
        attn = prof.get("attention", 0)
        other = sum(prof.values()) - mm - attn
        cells = [rec["name"], rec.get("set", ""), _f(m_alloc), _f(pred.get("allocated_gib")),
                 _pct(pred.get("allocated_gib"), m_alloc), _f(m_resv), _f(pred.get("reserved_gib")),
                 _pct(pred.get("reserved_gib"), m_resv), _f(m_step and m_step * 1e3, 1),
                 _f(pred.get("step_s") and pred["step_s"] * 1e3, 1), _pct(pred.get("step_s"), m_step),
                 f"{mm:.1f}/{attn:.1f}/{other:.1f}" if prof else "", pred.get("parts", pred.get("error", ""))]
        if rec.get("exit") not in (0, None):
            cells[-1] = f"run: {rec.get('exit')}"
        print("| " + " | ".join(str(c) for c in cells) + " |")


def _f(x, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _pct(pred, meas) -> str:
    return "" if not pred or not meas else f"{(pred - meas) / meas:+.0%}"


if __name__ == "__main__":
    main()
