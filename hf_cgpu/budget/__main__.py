"""``python -m hf_cgpu.budget`` = ``hf-cgpu budget``."""

import sys

from ..errors import run_main
from .cli import main

sys.exit(run_main(main))
