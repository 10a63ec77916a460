"""`stableflash reproduce micro`: the one-head reproduction runs, writes what it promises, and its arms differ."""

import json

import pytest

from stableflash.cli import main
from stableflash.diagnose.micro import MicroSetup, reproduce_micro, run_arm

FIELDS = {"wq_norm_first", "wq_norm_last", "signed_error_sum", "cum_delta_error", "pbar_ones"}


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro")
    arms = ("fp64", "paper", "paper+sfa", "paper+toward_zero")
    table = reproduce_micro(out, MicroSetup(steps=25), arms, progress=lambda line: None)
    return out, table


def test_writes_the_table_and_the_figure(short_run):
    out, table = short_run
    record = json.loads((out / "micro.json").read_text())
    assert set(record["arms"]) == {"fp64", "paper", "paper+sfa", "paper+toward_zero"}
    for row in record["arms"].values():
        assert FIELDS <= set(row)
    assert (out / "micro.png").stat().st_size > 10_000
    assert record["arms"] == json.loads(json.dumps(table))


def test_the_arms_measure_what_they_change(short_run):
    _, table = short_run
    assert table["fp64"]["signed_error_sum"] == 0 and table["fp64"]["cum_delta_error"] == 0
    assert table["paper"]["signed_error_sum"] > 0  # R is oriented by the paper arm
    # the sinks tie exactly: P̄ = 1 on every sink of every row, which SFA removes
    assert table["paper"]["pbar_ones"] > 4 * table["paper+sfa"]["pbar_ones"]
    # truncating P̄V's path shrinks O toward zero on V's positive dims: δ's error takes one sign
    assert table["paper+toward_zero"]["cum_delta_error"] < -5 * abs(table["paper"]["cum_delta_error"])
    assert table["paper"]["wq_norm_first"] == table["paper+sfa"]["wq_norm_first"]  # one initialisation


def test_stochastic_rounding_is_seeded():
    setup = MicroSetup(steps=3, seed=3)
    a, b = run_arm(setup, "paper+stochastic"), run_arm(setup, "paper+stochastic")
    assert a["norms"] == b["norms"] and a["delta_errors"] == b["delta_errors"]
    nearest = run_arm(setup, "paper")
    assert a["delta_errors"] != nearest["delta_errors"]


def test_cli_checks_its_arguments(tmp_path, capsys):
    assert main(["reproduce", "micro", "--out", str(tmp_path), "--steps", "1"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["reproduce", "micro", "--out", str(tmp_path), "--arms", "fp64,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["reproduce", "micro", "--out", str(tmp_path), "--arms", "fp64"]) == 2
    assert "'paper'" in capsys.readouterr().err
