"""The fused kernels' tests on the CPU, under Triton's interpreter (no GPU needed).

Runs tests/attention/test_triton.py in a fresh process with TRITON_INTERPRET=1: the
variable must be set before the kernels are defined, so it cannot share this process.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-W", "ignore::DeprecationWarning",
                           "-p", "no:cacheprovider", str(ROOT / "tests/attention/test_triton.py")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "passed" in done.stdout and "failed" not in done.stdout
