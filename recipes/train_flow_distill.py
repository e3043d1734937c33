"""Distill a trained flow pipeline into one that samples in 1 or 2 network evaluations (shortcut model, the teacher's
guidance baked in); saves a FlowMatchPipeline.

    accelerate launch recipes/train_flow_distill.py --preset cifar10 --teacher runs/flow \
        --dataset ../shared/data/cifar10 --output_dir runs/flow-distill
    hf-cgpu sample runs/flow-distill --class_labels 3      # 2 Euler steps, one network call each
    hf-cgpu train flow-distill --preset cifar10 --teacher runs/flow --dataset ../shared/data/cifar10 \
        --output_dir runs/flow-distill   # as a command
"""

import sys

from hf_cgpu.errors import run_main
from hf_cgpu.recipes import RECIPES, parse, run

RECIPE = RECIPES["flow-distill"]


def main(argv=None):
    distill, train = parse(RECIPE, argv)  # FlowDistillSettings + TrainSettings: command line > --preset > defaults
    run(RECIPE, distill, train)  # FlowDistillTask: the student UNet, sample grids, a FlowMatchPipeline and its card
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
