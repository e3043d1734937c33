"""``hf-cgpu``: one command with subcommands; each runs through ``errors.run_main`` (a user error: one line, exit 2)."""

from __future__ import annotations

import importlib
import sys

from .errors import USER_ERROR_EXIT, run_main

COMMANDS = {
    "generate": ("hf_cgpu.generate", "continue text with a saved GPT"),
    "sample": ("hf_cgpu.flow.sample", "sample images from a saved FlowMatchPipeline"),
    "eval": ("hf_cgpu.evaluation.cli", "evaluate a saved model: LM loss/perplexity/bits per char, or image FD"),
    "budget": ("hf_cgpu.budget.cli", "memory and time ledger: what fits on your card, how long it takes"),
    "bench": ("hf_cgpu.bench", "measure this GPU's bandwidth and bf16 matmul rate (MFU denominator)"),
    "push": ("hf_cgpu.hub", "push a trained directory to the Hub with a model card"),
    "verify": ("hf_cgpu.verify", "check a model or checkpoint folder against its checksum manifest"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
        msg = "usage: hf-cgpu COMMAND [ARGS]\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"hf-cgpu: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
            return USER_ERROR_EXIT
        print(msg)
        return 0
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return run_main(module.main, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
