"""The test configuration's failure log (`tests/conftest.py`, STABLEFLASH_FAILURES), which the GPU suite's calls
rely on when a time limit cuts pytest before its report."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CASES = '''
def test_passes():
    pass

def test_fails():
    assert 1 == 2, "seed 7"
'''


def test_each_failure_is_logged_once_as_it_happens_under_xdist(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    log = tmp_path / "failures.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "test_cases.py"],
                          cwd=tmp_path, env={**os.environ, "STABLEFLASH_FAILURES": str(log)}, capture_output=True,
                          text=True, timeout=300)
    assert "1 failed, 1 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    [failure] = [json.loads(line) for line in log.read_text().splitlines()]
    assert failure["test"] == "test_cases.py::test_fails" and failure["when"] == "call"
    assert "seed 7" in failure["error"]
