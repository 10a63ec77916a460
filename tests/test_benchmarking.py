import subprocess
from pathlib import Path

from stableflash.benchmarking import commit, parse_shapes, run_meta


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
