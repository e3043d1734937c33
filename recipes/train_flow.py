"""Train a flow-matching UNet on CIFAR-10 (class-conditional by default) with the one loop; saves a FlowMatchPipeline.

    accelerate launch --config_file accelerate_config.yaml recipes/train_flow.py --preset cifar10 \
        --dataset ../shared/data/cifar10 --output_dir runs/flow
    hf-cgpu sample runs/flow --class_labels 3 --guidance_scale 2 --num_inference_steps 20
    hf-cgpu train flow --preset cifar10 --dataset ../shared/data/cifar10 --output_dir runs/flow   # as a command
"""

import sys

from hf_cgpu.errors import run_main
from hf_cgpu.recipes import RECIPES, parse, run

RECIPE = RECIPES["flow"]


def main(argv=None):
    flow, train = parse(RECIPE, argv)  # FlowSettings + TrainSettings: command line > --preset > defaults
    run(RECIPE, flow, train)  # FlowMatchingTask: the UNet, sample grids, a FlowMatchPipeline and its card
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
