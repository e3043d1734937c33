"""Pretrain the hf_cgpu GPT from scratch: tokenizer, packing, the one loop, save, generate.

    accelerate launch --config_file accelerate_config.yaml recipes/train_gpt.py --preset 124m \
        --dataset ../shared/data/zh-poetry --output_dir runs/gpt124m
    accelerate launch --cpu recipes/train_gpt.py --preset tiny --output_dir runs/tiny   # CPU demo
"""

import json
import sys
from pathlib import Path

from accelerate import PartialState
from transformers import AutoModelForCausalLM

from hf_cgpu.errors import run_main
from hf_cgpu.generate import continue_texts
from hf_cgpu.hub import render_model_card
from hf_cgpu.settings import TrainSettings, parse_settings
from hf_cgpu.tasks.causal_lm import CausalLMTask, GPTSettings
from hf_cgpu.train import fit
from hf_cgpu.train.artifacts import update_results


def main(argv=None):
    gpt, train = parse_settings((GPTSettings, TrainSettings), argv, family="gpt", description=__doc__)
    task = CausalLMTask(gpt)
    results = fit(task, train)
    out = Path(train.output_dir)
    state = PartialState()
    state.wait_for_everyone()  # the main process has written the model
    if state.is_main_process:  # continue the prompts with the saved model (the weights the card describes)
        model = AutoModelForCausalLM.from_pretrained(out).to(state.device)
        samples = continue_texts(model, task.tokenizer, task.sample_prompts(), gpt.max_new_tokens)
        update_results(out, samples=samples)  # atomically, and into the model folder's manifest
        render_model_card("gpt", out)  # again, now with the continuations
        print("\n".join(f"--- sample {i + 1}\n{s}" for i, s in enumerate(samples)))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
