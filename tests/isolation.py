"""The first lines of a child script that must run where hf_cgpu cannot be imported (the trust_remote_code tests)."""

import os
import subprocess
import sys
import textwrap

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


def run_without_hf_cgpu(body: str, cwd) -> str:
    """Run ``body`` (indented code is dedented) in a fresh Python where hf_cgpu cannot be imported, its remote-code
    modules cached under ``cwd``; assert it exits 0 and printed OK; return its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(os.path.join(cwd, "modules")), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", WITHOUT_HF_CGPU + textwrap.dedent(body)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-2000:]
    return res.stdout
