"""Test configuration. Without a CUDA GPU the kernel tests run on the CPU under Triton's interpreter: it must be on
before Triton defines a kernel, so it is set here, before any test module imports the package."""

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
