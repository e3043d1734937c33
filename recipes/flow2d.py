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
from hf_cgpu.settings import TrainSettings, parse_settings
from hf_cgpu.tasks.flow_toy2d import Toy2DSettings, run_flow2d


def main(argv=None) -> int:
    toy, train = parse_settings((Toy2DSettings, TrainSettings), argv, family="flow2d", description=__doc__,
                                default_preset="toy")
    results = run_flow2d(toy, train)
    print(f"train {results['train_seconds']:.1f}s; best within 0.3 at <= 20 NFE: "
          f"{results['best_within_at_20_nfe_or_less']:.1%}; wrote {train.output_dir}/all_results.json")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
