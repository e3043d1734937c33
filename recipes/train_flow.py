"""Train a flow-matching UNet on CIFAR-10 (class-conditional by default) with the one loop; saves a FlowMatchPipeline.

    accelerate launch --config_file accelerate_config.yaml recipes/train_flow.py --preset cifar10 \
        --dataset ../shared/data/cifar10 --output_dir runs/flow
    hf-cgpu sample runs/flow --class_labels 3 --guidance_scale 2 --num_inference_steps 20
    hf-cgpu train flow --preset cifar10 --dataset ../shared/data/cifar10 --output_dir runs/flow   # as a command
"""

import json
import sys

from hf_cgpu.errors import run_main
from hf_cgpu.settings import TrainSettings, parse_settings
from hf_cgpu.tasks.flow_images import FlowMatchingTask, FlowSettings
from hf_cgpu.train import fit
from hf_cgpu.train.parallel import is_main_process


def main(argv=None):
    flow, train = parse_settings((FlowSettings, TrainSettings), argv, family="flow", description=__doc__)
    results = fit(FlowMatchingTask(flow), train)
    if is_main_process():  # one copy of the figures, not one per process
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
