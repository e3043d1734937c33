"""Pretrain the hf_cgpu GPT from scratch: tokenizer, packing, the one loop, save, continue a few prompts.

    accelerate launch --config_file accelerate_config.yaml recipes/train_gpt.py --preset 124m \
        --dataset ../shared/data/zh-poetry --output_dir runs/gpt124m
    accelerate launch --cpu recipes/train_gpt.py --preset tiny --output_dir runs/tiny   # CPU demo
    hf-cgpu train gpt --preset tiny --output_dir runs/tiny                               # the same, as a command
"""

import json
import sys

from hf_cgpu.errors import run_main
from hf_cgpu.settings import TrainSettings, parse_settings
from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings
from hf_cgpu.train import fit
from hf_cgpu.train.parallel import is_main_process


def main(argv=None):
    gpt, train = parse_settings((GPTSettings, TrainSettings), argv, family="gpt", description=__doc__)
    results = fit(CausalLMTask(gpt), train)  # saves the model, tokenizer, card and the continuations
    if is_main_process():  # one copy of the figures, not one per process
        print(json.dumps(results, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
