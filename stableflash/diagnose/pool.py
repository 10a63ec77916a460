"""Independent training runs in parallel worker processes.

The small models of a failure search leave an H200 mostly idle: one process is bound by the
host's kernel launches. Several processes share the GPU and finish a sweep several times sooner.
Workers are spawned (CUDA does not survive a fork) and use one CPU thread each, so that a dozen of
them do not oversubscribe the host's cores. On a CPU a run's last bits can depend on its thread count, so a
CPU run in a worker matches one in this process at one thread (`torch.set_num_threads(1)`), not necessarily
at the default.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def run_all(fn: Callable[[Any], Any], tasks: Sequence[Any], jobs: int = 1) -> Iterator[tuple[int, Any]]:
    """Yield (index of the task, fn(task)) as each finishes; `jobs` = 1 runs them here, in order.

    `fn` must be a module-level function (it is pickled by name); an exception it raises is
    raised here, so a caller that must not lose the other runs catches inside `fn`."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: expected a positive int, got {jobs!r}")
    if jobs == 1 or len(tasks) <= 1:
        for index, task in enumerate(tasks):
            yield index, fn(task)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=context, initializer=_one_thread) as pool:
        futures = {pool.submit(fn, task): index for index, task in enumerate(tasks)}
        for future in as_completed(futures):
            yield futures[future], future.result()
