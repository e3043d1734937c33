"""2D flow-matching toy on CPU: 8 Gaussians on a circle, trained by the one loop, sampled with our Euler and Heun
schedulers.

    time python recipes/flow2d.py --output_dir outputs/flow2d
    hf-cgpu flow2d --output_dir outputs/flow2d      # the same, as a command

Prints the within-0.3 fraction and per-mode counts for 2, 5, 10, 20 and 100 network evaluations and writes
all_results.json and flow2d_samples.png into --output_dir. Every Toy2DSettings and TrainSettings field is a --flag;
the training side defaults to --preset toy.
"""

import sys

from hf_cgpu.errors import run_main
from hf_cgpu.recipes import RECIPES, parse, run

RECIPE = RECIPES["flow2d"]


def main(argv=None):
    toy, train = parse(RECIPE, argv)  # Toy2DSettings + TrainSettings: command line > --preset > defaults
    run(RECIPE, toy, train)  # Toy2DTask: fresh points each step; every sampler at every budget, table, plot
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
