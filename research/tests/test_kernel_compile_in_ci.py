"""The sm_90 compile checks (test_kernel_compile.py) in the default run.

That run turns Triton's interpreter on where there is no GPU (tests/conftest.py), which replaces the JIT functions
those checks compile, so it skips them. Here a child process without the interpreter runs them: every run of the
README's test command compiles the shipped kernels for the H200 too, no GPU needed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

COMPILE_CHECKS = Path(__file__).with_name("test_kernel_compile.py")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="without the interpreter test_kernel_compile.py runs in this process")
def test_the_kernels_compile_for_sm90_in_a_child_without_the_interpreter():
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", str(COMPILE_CHECKS)],
                           env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=1200)
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else child.stderr[-2000:]
    assert child.returncode == 0 and " passed" in summary and "failed" not in summary, child.stdout[-4000:]
