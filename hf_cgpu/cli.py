"""``hf-cgpu``: one command with subcommands; each runs through ``errors.run_main`` (a user error: one line, exit 2).

A subcommand's module is imported only when it runs, so ``hf-cgpu --help`` and ``hf-cgpu budget`` import neither
torch nor transformers. A new subcommand is one more row of ``COMMANDS``.
"""

from __future__ import annotations

import importlib
import sys

from .errors import USER_ERROR_EXIT, run_main

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("hf_cgpu.recipes:train_main", "train a model: {recipes} (the recipes' settings)"),
    "budget": ("hf_cgpu.commands.budget:main", "memory and time ledger: what fits on your card, how long it takes"),
    "bench": ("hf_cgpu.bench:main", "measure this GPU's bandwidth and bf16 matmul rate (MFU denominator)"),
    "generate": ("hf_cgpu.generate:main", "continue text with a saved GPT (or any causal LM)"),
    "sample": ("hf_cgpu.flow.sample:main", "sample images from a saved FlowMatchPipeline"),
    "eval": ("hf_cgpu.evaluation.cli:main", "evaluate a saved model: LM loss/perplexity/bits per char, or image FD"),
    "export": ("hf_cgpu.gguf_export:main", "write a fine-tuned run or a model as one GGUF file (llama.cpp, Ollama)"),
    "push": ("hf_cgpu.hub.push:main", "push a trained directory to the Hub with a model card"),
    "verify": ("hf_cgpu.verify:main", "check a model or checkpoint folder against its checksum manifest"),
    "flow2d": ("hf_cgpu.recipes:flow2d_main", "the 2D flow-matching toy on CPU (seconds): table + scatter plot"),
}
"""name -> ("module:function", one line of help); the function takes the remaining argv and returns an exit code.
``{recipes}`` in a help line stands for the names of the recipe registry (``hf_cgpu.recipes.RECIPES``)."""


def usage() -> str:
    from .recipes import RECIPES  # torch-free: the registry's names, so a new recipe is listed without an edit here

    width, recipes = max(map(len, COMMANDS)) + 2, ", ".join(RECIPES)
    lines = [f"  {name:<{width}}{help_.format(recipes=recipes)}" for name, (_, help_) in COMMANDS.items()]
    return ("usage: hf-cgpu COMMAND [ARGS]   (hf-cgpu COMMAND --help: its options)\n\ncommands:\n" + "\n".join(lines)
            + "\n\nA user error ends in one line `error: ...` and exit code 2; HF_CGPU_DEBUG=1 shows its traceback.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        return run_main(lambda _: print(usage()))
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)} (hf-cgpu --help)",
              file=sys.stderr)
        return USER_ERROR_EXIT
    module, _, function = COMMANDS[argv[0]][0].partition(":")
    return run_main(getattr(importlib.import_module(module), function or "main"), argv[1:])


if __name__ == "__main__":
    sys.exit(main())
