"""Test configuration. Without a CUDA GPU the kernel tests run on the CPU under Triton's interpreter: it must be on
before Triton defines a kernel, so it is set here, before any test module imports the package.

Each test starts with torch's global generators (CPU and CUDA) seeded afresh, from STABLEFLASH_TEST_SEED when set:
the seed is printed (a failure's captured output shows it) and kept in the report's properties, so a failure on
fresh random draws reruns with the same draws by `STABLEFLASH_TEST_SEED=N pytest NODEID`.

With STABLEFLASH_FAILURES=FILE each failure is appended to FILE as one JSON line (its test, phase, torch seed and
error) as it happens: a run cut short by a time limit (the GPU suite's calls) still says why each failed test
failed, where pytest's own report comes only at the end."""

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "PYTEST_XDIST_WORKER" in os.environ:  # one worker per core (`-n auto`): more threads would only contend
    torch.set_num_threads(1)

import pytest

from stableflash.train.config import load_config
from stableflash.train.data import prepare_embedded


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    prepare_embedded(root / "shakespeare-char")
    return root


@pytest.fixture
def tiny(data_dir):
    def make(*overrides):
        return load_config("tiny-cpu", [f"data.data_dir={data_dir}", "run.progress=false", *overrides])
    return make


@pytest.fixture(autouse=True)
def _fresh_torch_seed(request):
    seed = int(os.environ.get("STABLEFLASH_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    request.node.user_properties.append(("torch_seed", seed))
    print(f"torch seed {seed} (rerun with STABLEFLASH_TEST_SEED={seed})")


_failures_file = None  # STABLEFLASH_FAILURES, in the process that runs the tests (an xdist worker, or pytest alone)


def pytest_configure(config):
    global _failures_file
    distributing = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    _failures_file = None if distributing else os.environ.get("STABLEFLASH_FAILURES")


def pytest_runtest_logreport(report):
    if _failures_file and report.failed:
        with open(_failures_file, "a") as f:
            seed = dict(report.user_properties).get("torch_seed")
            f.write(json.dumps({"test": report.nodeid, "when": report.when, "torch_seed": seed,
                                "error": str(report.longrepr)[-4000:]}) + "\n")
