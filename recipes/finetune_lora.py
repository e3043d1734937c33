"""LoRA / QLoRA fine-tuning of an open causal LM (default EleutherAI/pythia-1.4b) with the one loop.

    accelerate launch --config_file accelerate_config.yaml recipes/finetune_lora.py --preset lora \
        --model EleutherAI/pythia-1.4b --dataset ../shared/data/zh-poetry --output_dir runs/pythia-lora
    ... --preset qlora      # 4-bit nf4 base
    hf-cgpu train lora --model EleutherAI/pythia-1.4b ...   # the same, as a command
Writes adapter_config.json + adapter_model.safetensors (+ merged/ with --merge), the tokenizer, all_results.json.
"""

import sys

from hf_cgpu.errors import run_main
from hf_cgpu.recipes import RECIPES, parse, run

RECIPE = RECIPES["lora"]


def main(argv=None):
    cfg, train = parse(RECIPE, argv)  # FinetuneSettings + TrainSettings: command line > --preset > defaults
    run(RECIPE, cfg, train)  # FinetuneTask: the base in the tier's form, adapters, the adapter and its card
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
