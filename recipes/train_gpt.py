"""Pretrain the hf_cgpu GPT from scratch: tokenizer, packing, the one loop, save, continue a few prompts.

    accelerate launch --config_file accelerate_config.yaml recipes/train_gpt.py --preset 124m \
        --dataset ../shared/data/zh-poetry --output_dir runs/gpt124m
    accelerate launch --cpu recipes/train_gpt.py --preset tiny --output_dir runs/tiny   # CPU demo
    hf-cgpu train gpt --preset tiny --output_dir runs/tiny                               # the same, as a command
"""

import sys

from hf_cgpu.errors import run_main
from hf_cgpu.recipes import RECIPES, parse, run

RECIPE = RECIPES["gpt"]


def main(argv=None):
    gpt, train = parse(RECIPE, argv)  # GPTSettings + TrainSettings: command line > --preset > defaults
    run(RECIPE, gpt, train)  # CausalLMTask: tokenizer, packing, training, the model, its card and continuations
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
