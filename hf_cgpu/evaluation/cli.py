"""``hf-cgpu eval DIR ...``: a saved FlowMatchPipeline (``model_index.json``) gets the image metrics, any other
model folder (or Hub id) is evaluated as a causal language model. ``--help`` without a folder shows both modes, each
with its own flags; with one, the flags of its mode."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import about


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    target = next((a for a in argv if not a.startswith("-")), None)
    if target is not None and (Path(target) / "model_index.json").is_file():
        from .flow import main as flow_main

        return flow_main(argv)
    if target is None and any(a in ("-h", "--help") for a in argv):
        print(both_modes())
        raise SystemExit(0)  # as argparse ends every other --help
    from .text import main as text_main

    return text_main(argv)


def both_modes() -> str:
    """``hf-cgpu eval --help``: what the command does, an example per mode, then each mode's help."""
    from . import flow, text

    head = about("Evaluate a saved model: a language model on text, or an image generator (FlowMatchPipeline) in a "
                 "classifier's features; the folder decides the mode.",
                 "hf-cgpu eval runs/zh --dataset ../shared/data/zh-poetry",
                 "hf-cgpu eval runs/flow --classifier runs/classifier --dataset ../shared/data/cifar10 --sweep")
    return (f"usage: hf-cgpu eval MODEL_DIR [--SETTING VALUE ...]\n\n{head}\n\n"
            f"=== text mode: MODEL_DIR is a language model ===\n\n{text.parser().format_help()}\n"
            f"=== image mode: MODEL_DIR is a FlowMatchPipeline (model_index.json) ===\n\n"
            f"{flow.parser().format_help()}")
