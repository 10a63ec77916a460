"""A Triton cache manager under which processes sharing one cache compile each kernel once between them.

Triton's file cache has no lock around a compile: 16 pytest workers that miss the same kernel at once each compile it
(a third of a shard's compiles were such duplicates). Under this manager, a miss on a kernel's metadata takes a lock
file in that kernel's cache folder and holds it until the compile writes its group; a process that misses meanwhile
waits for the lock, looks again and loads what the first one wrote. Locks are per kernel, so different kernels still
compile in parallel.

A lock is released when the group is written, when the manager is collected (a compile that raised) or when its
process exits. A waiter gives up after `WAIT_S` and compiles anyway, so a holder kept alive by a stored traceback
costs time, never a hang.

    TRITON_CACHE_MANAGER=compile_once:CompileOnceCacheManager   (with this folder on the path)
"""

from __future__ import annotations

import fcntl
import os
import time

from triton.runtime.cache import FileCacheManager

WAIT_S = 120.0  # a compile of these kernels takes seconds; under the runner's 300 s per case; then compile anyway
POLL_S = 0.05


class CompileOnceCacheManager(FileCacheManager):
    """`FileCacheManager` whose miss on a group (a kernel's metadata) holds that kernel's lock until `put_group`."""

    def __init__(self, key, override=False, dump=False):
        super().__init__(key, override=override, dump=dump)
        self._locking = not (override or dump)  # the override and dump folders are read or written, never compiled to
        self._held = None

    def get_group(self, filename: str):
        group = super().get_group(filename)
        if group is not None or not self._locking or self._held is not None:
            return group
        lock = open(os.path.join(self.cache_dir, "compiling.lock"), "a")
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock.close()
                    return super().get_group(filename)
                time.sleep(POLL_S)
        group = super().get_group(filename)  # written while this process waited: load it
        if group is not None:
            lock.close()
            return group
        self._held = lock
        return None

    def put_group(self, filename: str, group) -> str:
        try:
            return super().put_group(filename, group)
        finally:
            self.release()

    def release(self) -> None:
        if self._held is not None:
            self._held.close()  # closing the file drops its flock
            self._held = None

    def __del__(self):
        self.release()
