"""Eager calls replayed from a plan: the same kernels, arguments and allocations as the call that made it.

At (16,12,1024,64) a forward+backward takes ~0.4 ms on an H200 and its eager host path more (docs/kernel-notes.md),
so the eager benchmark reads host time. Most of that host time is the same for every call whose tensors agree in
shape, strides, dtype, device and alignment and whose other arguments are equal: choosing kernels, building their
~60 arguments and the launch cache's key. The first such call runs the launchers as usual while this module records
what they launch (`record`, fed by `ops._Launches`); later calls allocate the same outputs and launch the same
compiled kernels with their own tensors in place of the first call's (`Plan.replay`). Same kernels, same
arguments: the same bits. What a plan cannot see, its callers keep out of the planned call: work other than
launches (a plan allocates uninitialised memory, so the statistics' zeroed totals are made before it), and
copies of inputs (`describe`, `Plan.build`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

_recording = threading.local()  # per thread: autograd runs CUDA backwards on a thread of its own


class Launch(NamedTuple):
    """One kernel launch as `ops._Launches` made it: compiled kernel, grid (x, y), arguments, trailing constexprs."""
    kernel: object
    grid: tuple[int, int]
    args: tuple
    constexprs: tuple


@contextlib.contextmanager
def record():
    """Collects the launches this thread makes inside the block (`note`) into the list it yields."""
    _recording.launches = launches = []
    try:
        yield launches
    finally:
        _recording.launches = None


def note(kernel, grid: tuple, args: tuple, constexprs: tuple) -> None:
    """Called by the launcher for every launch; kept only inside `record`."""
    launches = getattr(_recording, "launches", None)
    if launches is not None:
        launches.append(Launch(kernel, (grid[0], grid[1] if len(grid) > 1 else 1), args, constexprs))


# where a tensor of a replayed call comes from: the call's own tensors, a fresh allocation, or the plan itself (an
# empty placeholder, e.g. the statistics' targets without statistics: shared by every call, as nothing is written to it)
_FROM_CALL, _NEW, _PLAN = 0, 1, 2
_UNSEEN = object()


class _SharesMemory(Exception):
    """A tensor the call made itself shares memory with one it was given: not something a plan can allocate."""


class Plan(NamedTuple):
    """What one call allocated and launched, with each tensor named by where it comes from (pool, index)."""
    allocations: tuple[tuple[tuple, tuple, torch.dtype], ...]  # (shape, strides, dtype) of each tensor allocated
    launches: tuple[tuple[Launch, tuple[tuple[int, int, int], ...]], ...]  # launch, its (position, pool, index) slots
    outputs: tuple[tuple[int, int], ...]
    placeholders: tuple[torch.Tensor, ...]  # empty tensors the call made, passed to every replay as they are
    scratch: bool  # some kernel makes TMA descriptors in global scratch: Triton's allocator must be set on the thread

    @classmethod
    def build(cls, tensors: tuple, outputs: tuple, launches: list[Launch]) -> Plan | None:
        """From one call: its tensors, the tensors it returned and its recorded launches. A tensor among neither the
        call's nor its outputs is one the call allocated for itself (e.g. the backward's δ). None if such a tensor
        shares memory with the call's (a view or copy of an input, which a fresh allocation would not reproduce)."""
        where = {id(t): (_FROM_CALL, i) for i, t in enumerate(tensors)}
        call_memory = {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}
        allocations, placeholders = [], []

        def source(t: torch.Tensor) -> tuple[int, int]:
            if id(t) not in where:
                if t.numel() == 0:
                    where[id(t)] = (_PLAN, len(placeholders))
                    placeholders.append(t)
                    return where[id(t)]
                if t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() in call_memory:
                    raise _SharesMemory
                where[id(t)] = (_NEW, len(allocations))
                allocations.append((tuple(t.shape), t.stride(), t.dtype))
            return where[id(t)]

        try:
            named_outputs = tuple(source(t) for t in outputs)
            planned = []
            for launch in launches:
                slots = tuple((pos, *source(a)) for pos, a in enumerate(launch.args) if isinstance(a, torch.Tensor))
                # the template keeps no tensor of this call alive: each is put in by position at replay
                template = tuple(None if isinstance(a, torch.Tensor) else a for a in launch.args)
                planned.append((launch._replace(args=template), slots))
        except _SharesMemory:
            return None
        scratch = any(getattr(launch.kernel.metadata, "global_scratch_size", 0) > 0 for launch in launches)
        return cls(tuple(allocations), tuple(planned), named_outputs, tuple(placeholders), scratch)

    def replay(self, tensors: tuple, stream: int) -> tuple:
        device = tensors[0].device
        pools = (tensors, [torch.empty_strided(shape, strides, dtype=dtype, device=device)
                           for shape, strides, dtype in self.allocations], self.placeholders)
        for launch, slots in self.launches:
            args = list(launch.args)
            for pos, pool, index in slots:
                args[pos] = pools[pool][index]
            kernel = launch.kernel
            kernel.run(*launch.grid, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args,
                       *launch.constexprs)
        return tuple(pools[pool][index] for pool, index in self.outputs)


def launch_hooks() -> tuple:
    """Triton's launch enter and exit hooks (profilers), or (None, None) where none is registered. Triton 3.6 keeps
    each as a chain that is never None, so a launcher that passes them on builds every launch's metadata and calls
    two empty chains from C."""
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    if all(hook is None or (isinstance(hook, triton.knobs.HookChain) and not hook.calls) for hook in hooks):
        return None, None
    return hooks


def describe(tensors: tuple) -> tuple | None:
    """The tensors' part of a call's signature (each one's shape, strides, dtype, device and address modulo 16,
    which decide the kernels and their specialisation), or None where the call cannot be planned. It can be only
    where the tensors are distinct objects (a plan names tensors by position, so q is k must not be taken for two
    tensors), each has unit last stride (else the launchers copy it first, a copy a plan would take for an
    allocation), and no Triton launch hooks are registered (a plan launches without them). One pass: it runs before
    every eager call."""
    described = tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors)
    if (any(d[1][-1] != 1 for d in described) or len({id(t) for t in tensors}) != len(tensors)
            or launch_hooks() != (None, None)):
        return None
    return described


class EagerPlans:
    """Plans by call signature (the call's static arguments, the current device and `describe`'s tensors); None for
    a signature that cannot be planned (`Plan.build`), which then runs the launchers every call."""

    MAX_PLANS = 1024  # a run with ever new shapes would otherwise keep one per shape

    def __init__(self, ensure_scratch: Callable[[], None], enabled: bool = True, device_types: tuple = ("cuda",)):
        self.plans: dict[tuple, Plan | None] = {}
        self.ensure_scratch = ensure_scratch  # sets Triton's scratch allocator on this thread where none is set
        self.enabled = enabled  # False: every call runs the launchers (to compare, or to rule replay out)
        # where calls are planned: the interpreter's launches on the CPU are not (benchmarks/host_path_cpu.py plans
        # CPU calls to stand-in kernels)
        self.device_types = device_types

    def __call__(self, run: Callable[[], tuple], static: tuple, tensors: tuple) -> tuple:
        """`run()`'s result for this call: the normal path (recorded) the first time, the plan's replay after."""
        described = describe(tensors) if self.enabled and tensors[0].device.type in self.device_types else None
        if described is None:
            return run()
        device = torch.cuda.current_device()
        signature = (static, device, described)
        plan = self.plans.get(signature, _UNSEEN)
        if plan is None:
            return run()
        if plan is not _UNSEEN:
            if plan.scratch:
                self.ensure_scratch()
            return plan.replay(tensors, torch.cuda.current_stream(device).cuda_stream)
        with record() as launches:
            outputs = run()
        if launches:
            if len(self.plans) >= self.MAX_PLANS:
                self.plans.clear()
            self.plans[signature] = Plan.build(tensors, outputs, launches)
        return outputs

    def clear(self) -> None:
        self.plans.clear()

    @contextlib.contextmanager
    def switched(self, enabled: bool):
        """Inside the block calls are replayed (True) or run the launchers (False); the setting before it is restored
        after (benchmarks compare the two paths in one process)."""
        before, self.enabled = self.enabled, enabled
        try:
            yield
        finally:
            self.enabled = before
