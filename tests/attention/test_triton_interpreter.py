"""The fused kernels' tests on the CPU, under Triton's interpreter (no GPU needed), reported test by test.

TRITON_INTERPRET=1 must be set before the kernels are defined, so tests/attention/test_triton.py runs in one
fresh process with it set; its tests are collected from that process too and each appears here as a test of its
own, passing, failing (with the kernel test's own message) or skipping as it did there.
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
TARGET = "tests/attention/test_triton.py"
ENV = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
RUN = not torch.cuda.is_available()  # on a GPU machine test_triton.py runs natively instead


def _collect() -> list[str]:
    if not RUN:
        return []
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", TARGET],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return [line.split("::", 1)[1] for line in done.stdout.splitlines() if line.startswith(TARGET + "::")]


TESTS = _collect()


WORKERS = max(1, min(4, len(os.sched_getaffinity(0))))
"""Processes the kernel tests are dealt out to: the interpreter runs a test on one core, and on CI's two cores
one process would leave the other idle for most of the suite's time."""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """One run of every kernel test under the interpreter, dealt out to WORKERS processes that run side by side:
    {test id: (outcome, message, seconds)}."""
    folder = tmp_path_factory.mktemp("interpreter")
    env = {**ENV, "OMP_NUM_THREADS": "1"}  # one core per process: more threads would only contend
    runs = []
    for worker in range(min(WORKERS, len(TESTS))):  # no process without tests: pytest without ids runs everything
        report = folder / f"report-{worker}.xml"
        ids = [f"{TARGET}::{test}" for test in TESTS[worker::WORKERS]]
        log = open(folder / f"log-{worker}.txt", "w")
        runs.append((report, log, subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-W", "ignore::DeprecationWarning", "-p", "no:cacheprovider",
             "--junitxml", str(report), *ids], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)))
    results = {}
    for report, log, process in runs:
        process.wait(timeout=1500)
        log.close()
        if not report.exists():  # the process died before writing its report: say what it printed
            raise RuntimeError(f"a kernel-test process wrote no report:\n{Path(log.name).read_text()[-3000:]}")
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for kind in ("failure", "error", "skipped"):
                node = case.find(kind)
                if node is not None:
                    outcome, message = kind, (node.get("message") or "") + "\n" + (node.text or "")
            results[case.get("name")] = (outcome, message, float(case.get("time", 0)))
    return results


@pytest.mark.slow
@pytest.mark.skipif(not RUN, reason="a CUDA GPU is here: test_triton.py runs on it")
@pytest.mark.parametrize("test", TESTS or ["(none collected)"])
def test_kernel_under_the_interpreter(outcomes, test):
    assert TESTS, "no kernel test was collected under the interpreter"
    assert test in outcomes, f"{test} did not run under the interpreter"
    outcome, message, seconds = outcomes[test]
    if outcome == "skipped":
        pytest.skip(message.strip().splitlines()[0] if message.strip() else "skipped under the interpreter")
    assert outcome == "passed", f"{test} under the interpreter ({seconds:.1f} s): {message[-3000:]}"
