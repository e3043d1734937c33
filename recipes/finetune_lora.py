"""LoRA / QLoRA fine-tuning of an open causal LM (default EleutherAI/pythia-1.4b) with the one loop.

    accelerate launch --config_file accelerate_config.yaml recipes/finetune_lora.py --preset lora \
        --model EleutherAI/pythia-1.4b --dataset ../shared/data/zh-poetry --output_dir runs/pythia-lora
    ... --preset qlora      # 4-bit nf4 base
    hf-cgpu train lora --model EleutherAI/pythia-1.4b ...   # the same, as a command
Writes adapter_config.json + adapter_model.safetensors (+ merged/ with --merge), the tokenizer, all_results.json.
"""

import json
import sys

from hf_cgpu.errors import run_main
from hf_cgpu.settings import TrainSettings, parse_settings
from hf_cgpu.tasks.finetune_lm import FinetuneSettings, FinetuneTask
from hf_cgpu.train import fit
from hf_cgpu.train.parallel import is_main_process


def main(argv=None):
    cfg, train = parse_settings((FinetuneSettings, TrainSettings), argv, family="finetune", description=__doc__,
                                default_preset="lora")
    results = fit(FinetuneTask(cfg), train)
    if is_main_process():  # one copy of the figures, not one per process
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
