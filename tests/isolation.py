"""The first lines of a child script that must run where hf_cgpu cannot be imported (the trust_remote_code tests)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WITHOUT_HF_CGPU = f"""
import sys
sys.path = [p for p in sys.path if not p.startswith({REPO!r}) and p not in ('', '.')]
sys.modules['hf_cgpu'] = None  # also defeats an editable install's import hook
try:
    import hf_cgpu
    raise SystemExit('hf_cgpu importable: the test would prove nothing')
except ImportError:
    pass
"""
