"""The benchmarks' shared pieces (benchmarks/common.py) and the cost study's arithmetic, on any machine."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import each other's folder as they do when run
from common import commit, parse_shapes, run_meta  # noqa: E402


def test_shapes_parse_from_the_command_line_or_default():
    assert parse_shapes("16,12,1024,64;1,16,16384,128", [(1, 1, 1, 1)]) == [(16, 12, 1024, 64), (1, 16, 16384, 128)]
    assert parse_shapes(None, [(1, 2, 3, 4)]) == [(1, 2, 3, 4)]


def test_the_commit_is_the_environments_then_the_checkouts(monkeypatch):
    monkeypatch.setenv("STABLEFLASH_COMMIT", "abc1234")
    assert commit() == run_meta()["commit"] == "abc1234"
    monkeypatch.delenv("STABLEFLASH_COMMIT")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True)
    assert commit() == (head.stdout.strip() if head.returncode == 0 else None)


def test_the_meta_names_the_package_tree_that_ran(tmp_path):
    """This checkout's package by default; another tree's where PYTHONPATH puts it first (a `BEFORE` run)."""
    assert run_meta()["package"] in ("stableflash", str(Path(__import__("stableflash").__file__).resolve().parent))
    other = tmp_path / "before" / "stableflash"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    done = subprocess.run([sys.executable, "-c", "from common import run_meta; print(run_meta()['package'])"],
                          cwd=BENCHMARKS, env={"PYTHONPATH": f"{other.parent}:{BENCHMARKS}", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == str(other.resolve()), done.stderr[-2000:]


def test_feature_cost_compares_per_round(monkeypatch):
    import feature_cost

    # a feature that takes 1.03 ms where the kernel without it takes 1.00 costs 2.9% of the throughput
    assert feature_cost.compare([1.03, 1.10], [1.00, 1.00], "cost") == pytest.approx([100 * (1 - 1 / 1.03), 100 / 11])
    assert feature_cost.compare([0.5], [1.0], "speedup") == [2.0]
    shape = (1, 2, 64, 64)
    times = {(shape, "stableflash", "g"): [1.0, 1.0, 1.0], (shape, "stableflash-sfa", "g"): [1.02, 1.05, 1.04],
             (shape, "stableflash-sfa-stats", "g"): [1.02, 1.05, 1.04], (shape, "sdpa-flash", "g"): [2.04, 2.1, 1.04]}
    rows = {r["comparison"]: r for r in feature_cost.summarise(times, shape, ["g"])}
    assert rows["sfa cost"]["median"] == pytest.approx(100 * (1 - 1 / 1.04))
    assert rows["sfa cost"]["min"] == pytest.approx(100 * (1 - 1 / 1.02))
    assert rows["stats cost"]["max"] == 0.0
    assert rows["sfa/fa2"]["per_round"] == pytest.approx([2.0, 2.0, 1.0]) and rows["sfa/fa2"]["median"] == 2.0
    with pytest.raises(ValueError):  # rounds that do not pair up are a bug, not a shorter table
        feature_cost.compare([1.0], [1.0, 1.0], "cost")


def test_a_failed_training_setting_is_its_rows_not_the_benchmarks(capsys):
    """train_throughput: a setting that failed (here the baseline's second round) keeps its error in its row; the
    others' ratios and the round summary are computed from the rows that ran."""
    pytest.importorskip("triton")
    import train_throughput

    rows = [{"setting": "sdpa", "steps": 10, "tokens_per_s": 100.0, "first_loss": 5.0, "last_loss": 4.0},
            {"setting": "triton-fa2-sfa", "steps": 10, "tokens_per_s": 110.0, "first_loss": 5.0, "last_loss": 4.0},
            {"setting": "sdpa", "steps": 10, "error": "RuntimeError: out of memory"},
            {"setting": "triton-fa2-sfa", "steps": 10, "tokens_per_s": 120.0, "first_loss": 5.0, "last_loss": 4.0}]
    train_throughput.add_ratios(rows)
    assert rows[1]["ratio_to_sdpa"] == pytest.approx(1.1) and rows[3]["ratio_to_sdpa"] == pytest.approx(1.2)
    assert rows[3]["ratio_to_round_sdpa"] is None  # its round's baseline failed
    assert train_throughput.round_summary(rows) == {"triton-fa2-sfa": {"rounds": 1, "median": pytest.approx(1.1),
                                                                       "min": pytest.approx(1.1),
                                                                       "max": pytest.approx(1.1)}}
    train_throughput.print_table({"rows": rows})
    assert "failed: RuntimeError: out of memory" in capsys.readouterr().out
