"""Train the CIFAR-10 classifier whose features `hf-cgpu eval` uses to score image generators (the one loop).

    accelerate launch --config_file accelerate_config.yaml recipes/train_classifier.py --preset cifar10 \
        --dataset ../shared/data/cifar10 --output_dir runs/classifier
    python recipes/train_classifier.py --preset tiny --dataset ../shared/data/cifar10 --output_dir runs/clf_tiny  # CPU
    hf-cgpu eval runs/flow --classifier runs/classifier --dataset ../shared/data/cifar10
    hf-cgpu train classifier --preset tiny --dataset ../shared/data/cifar10 --output_dir runs/clf_tiny  # as a command
"""

import json
import sys

from hf_cgpu.errors import run_main
from hf_cgpu.settings import TrainSettings, parse_settings
from hf_cgpu.tasks.classifier import ClassifierSettings, ClassifierTask
from hf_cgpu.train import fit
from hf_cgpu.train.parallel import is_main_process


def main(argv=None):
    clf, train = parse_settings((ClassifierSettings, TrainSettings), argv, family="classifier", description=__doc__)
    results = fit(ClassifierTask(clf), train)
    if is_main_process():  # one copy of the figures, not one per process
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
