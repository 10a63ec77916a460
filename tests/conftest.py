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
