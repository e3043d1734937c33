"""DPO preference tuning that continues an SFT LoRA adapter (hf-cgpu train lora's output) with the one loop.

    python recipes/train_dpo.py --model EleutherAI/pythia-1.4b --adapter runs/pythia-lora \
        --dataset prefs/ --output_dir runs/pythia-dpo
    ... --preset qlora      # 4-bit nf4 base
    hf-cgpu train dpo --model EleutherAI/pythia-1.4b ...   # the same, as a command
Writes the continued adapter (adapter_config.json + adapter_model.safetensors), the tokenizer, all_results.json with
the held-out reward accuracy and margin; the SFT adapter folder is only read.
"""

import sys

from hf_cgpu.errors import run_main
from hf_cgpu.recipes import RECIPES, parse, run

RECIPE = RECIPES["dpo"]


def main(argv=None):
    cfg, train = parse(RECIPE, argv)  # DPOSettings + TrainSettings: command line > --preset > defaults
    run(RECIPE, cfg, train)  # DPOTask: the SFT adapter continued, its reference log-probabilities computed once
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
