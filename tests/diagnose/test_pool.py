"""Runs in worker processes: every task's result comes back under its own index."""

import math

import pytest

from stableflash.diagnose.pool import run_all


def test_every_task_comes_back_under_its_index():
    tasks = [5, 0, 7, 3]
    assert dict(run_all(math.factorial, tasks, jobs=2)) == {i: math.factorial(n) for i, n in enumerate(tasks)}
    assert list(run_all(math.factorial, tasks)) == [(i, math.factorial(n)) for i, n in enumerate(tasks)]


def test_a_failing_task_raises_and_bad_jobs_are_refused():
    with pytest.raises(ValueError, match="factorial"):
        dict(run_all(math.factorial, [3, -1], jobs=2))
    with pytest.raises(ValueError, match="jobs: expected a positive int"):
        list(run_all(math.factorial, [1], jobs=0))
