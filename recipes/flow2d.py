"""2D flow-matching toy on CPU: 8 Gaussians on a circle, sampled with our Euler and Heun schedulers.

    time python recipes/flow2d.py --output_dir outputs/flow2d

Prints the within-0.3 fraction and per-mode counts for 2, 5, 10, 20 and 100 network evaluations and writes
all_results.json and flow2d_samples.png into --output_dir. Every Toy2DSettings field is a --flag.
"""

import sys

from hf_cgpu.flow.toy2d import Toy2DSettings, run_flow2d
from hf_cgpu.settings import parse_settings


def main(argv=None) -> int:
    (settings,) = parse_settings((Toy2DSettings,), argv, description=__doc__)
    results = run_flow2d(settings)
    print(f"train {results['train_seconds']:.1f}s; best within 0.3 at <= 20 NFE: "
          f"{results['best_within_at_20_nfe_or_less']:.1%}; wrote {settings.output_dir}/all_results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
