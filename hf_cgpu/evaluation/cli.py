"""``hf-cgpu eval DIR ...``: a saved FlowMatchPipeline (``model_index.json``) gets the image metrics, any other
model folder (or Hub id) is evaluated as a causal language model."""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    target = next((a for a in argv if not a.startswith("-")), None)
    if target is not None and (Path(target) / "model_index.json").is_file():
        from .flow import main as flow_main

        return flow_main(argv)
    from .text import main as text_main

    return text_main(argv)
