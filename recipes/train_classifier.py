"""Train the CIFAR-10 classifier whose features `hf-cgpu eval` uses to score image generators (the one loop).

    accelerate launch --config_file accelerate_config.yaml recipes/train_classifier.py --preset cifar10 \
        --dataset ../shared/data/cifar10 --output_dir runs/classifier
    python recipes/train_classifier.py --preset tiny --dataset ../shared/data/cifar10 --output_dir runs/clf_tiny  # CPU
    hf-cgpu eval runs/flow --classifier runs/classifier --dataset ../shared/data/cifar10
    hf-cgpu train classifier --preset tiny --dataset ../shared/data/cifar10 --output_dir runs/clf_tiny  # as a command
"""

import sys

from hf_cgpu.errors import run_main
from hf_cgpu.recipes import RECIPES, parse, run

RECIPE = RECIPES["classifier"]


def main(argv=None):
    clf, train = parse(RECIPE, argv)  # ClassifierSettings + TrainSettings: command line > --preset > defaults
    run(RECIPE, clf, train)  # ClassifierTask: the ResNet, accuracy on the test split, its weights
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
