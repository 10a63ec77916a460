"""Eager launches of already compiled kernels: the one seam below Triton's `kernel[grid](...)`.

Triton's `JITFunction.run` binds and specialises every argument on every call: on the H200's host an eager
forward+backward at (16, 12, 1024, 64), three launches, spent ~0.9 ms of host time on ~0.39 ms of GPU work
(results/kernel-library/). Here the first launch of each specialisation goes through Triton, which compiles it and
returns the compiled kernel; later launches call that kernel's launcher with the value of every parameter in order,
as `JITFunction.run` passes them. The key holds what Triton specialises on: the kernel, its compile-time arguments
and tile, the device, integer arguments (exactly, but for those marked `do_not_specialize`), and tensors by dtype
and 16-byte alignment.

Where no profiler hook is registered the launcher is called directly, without launch metadata: Triton 3.6 keeps its
launch hooks as chains that are never None, so `compiled[grid](...)` builds a metadata dict and calls two empty chains
from C on every launch. With a hook registered (a profiler) the launch goes through `compiled[grid](...)` as usual.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import triton


@functools.cache
def _driver():
    return triton.runtime.driver.active


def _device() -> int:
    return _driver().get_current_device()


def _stream(device: int) -> int:
    # the raw handle, as Triton's own launches take it (`torch.cuda.current_stream` builds a Stream object per call)
    return _driver().get_current_stream(device)


def current_stream() -> int:
    """The current device's current CUDA stream handle: taken once for a call's launches."""
    return _stream(_device())


def _hooks_registered() -> bool:
    """Whether a launch enter or exit hook is set (a non-empty chain, or a plain callable in older Triton)."""
    runtime = triton.knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class BoundLaunch(NamedTuple):
    """A compiled kernel with its grid and the values of its parameters after the runtime ones: launched again with
    another call's runtime arguments (`launch.py`'s plans)."""
    compiled: object
    grid: tuple[int, int]
    trailing: tuple

    def __call__(self, args: tuple, stream: int | None = None) -> None:
        compiled, (x, y) = self.compiled, self.grid
        if _hooks_registered():
            compiled[(x, y, 1)](*args, *self.trailing)
        else:
            compiled.run(x, y, 1, current_stream() if stream is None else stream, compiled.function,
                         compiled.packed_metadata, None, None, None, *args, *self.trailing)


class CompiledLaunches:
    def __init__(self):
        self._cache: dict[tuple, tuple] = {}
        self._unspecialised: dict[object, frozenset[int]] = {}  # per kernel: positions Triton does not specialise

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()

    def launch(self, kernel, grid, args: tuple, meta: dict, config: triton.Config) -> BoundLaunch:
        """Launch `kernel` on `grid(config.kwargs)` with runtime `args` (positional, in order) and compile-time `meta`;
        returns the launch, bound to its compiled kernel, grid and trailing values."""
        free = self._unspecialised.get(kernel)
        if free is None:
            free = self._unspecialised[kernel] = frozenset(p.num for p in kernel.params if p.do_not_specialize)
        # exact type tests: the arguments are tensors, ints and floats, and `isinstance` per argument costs more
        key = (kernel, config, _device(), *meta.items(),
               *[None if type(a) is float or i in free else a if type(a) is int else (a.dtype, a.data_ptr() % 16 == 0)
                 for i, a in enumerate(args)])
        hit = self._cache.get(key)
        dims = grid(config.kwargs)
        if hit is None:
            compiled = kernel[dims](*args, **meta, **config.kwargs, num_warps=config.num_warps,
                                    num_stages=config.num_stages)
            hit = self._cache[key] = (compiled, trailing_values(kernel, len(args), meta, config))
            return BoundLaunch(compiled, (dims[0], dims[1] if len(dims) > 1 else 1), hit[1])
        bound = BoundLaunch(hit[0], (dims[0], dims[1] if len(dims) > 1 else 1), hit[1])
        bound(args)
        return bound


def trailing_values(kernel, num_args: int, meta: dict, config: triton.Config) -> tuple:
    """The values of `kernel`'s parameters after its first `num_args`, in order: from `meta`, the tile, or the
    parameter's default. A KeyError names a parameter left without one."""
    values = {p.name: p.default for p in kernel.params if p.has_default}
    values.update(meta)
    values.update(config.all_kwargs())
    return tuple(values[name] for name in kernel.arg_names[num_args:])


COMPILED = CompiledLaunches()
