"""Eager launches of already compiled kernels: the one seam below Triton's `kernel[grid](...)`.

Triton's `JITFunction.run` binds and specialises every argument on every call: on the H200's host an eager
forward+backward at (16, 12, 1024, 64), three launches, spent ~0.9 ms of host time on ~0.39 ms of GPU work
(results/kernel-library/). Here the first launch of each specialisation goes through Triton, which compiles it and
returns the compiled kernel; later launches call that kernel's own `compiled[grid](*values)` with the value of every
parameter in order, as `JITFunction.run` passes them. The key holds what Triton specialises on: the kernel, its
compile-time arguments and tile, the device, integer arguments (exactly), and tensors by dtype and 16-byte alignment.
"""

from __future__ import annotations

import torch
import triton


def _device() -> int:
    return torch.cuda.current_device()


class CompiledLaunches:
    def __init__(self):
        self._cache: dict[tuple, tuple] = {}

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()

    def launch(self, kernel, grid, args: tuple, meta: dict, config: triton.Config) -> None:
        """Launch `kernel` on `grid(config.kwargs)` with runtime `args` (positional, in order) and compile-time `meta`."""
        # exact type tests: the arguments are tensors, ints and floats, and `isinstance` per argument costs more
        key = (kernel, config, _device(), *meta.items(),
               *[a if type(a) is int else (a.dtype, a.data_ptr() % 16 == 0) for a in args if type(a) is not float])
        hit = self._cache.get(key)
        dims = grid(config.kwargs)
        if hit is None:
            compiled = kernel[dims](*args, **meta, **config.kwargs, num_warps=config.num_warps,
                                    num_stages=config.num_stages)
            self._cache[key] = (compiled, trailing_values(kernel, len(args), meta, config))
            return
        compiled, trailing = hit
        compiled[(dims[0], dims[1] if len(dims) > 1 else 1, 1)](*args, *trailing)


def trailing_values(kernel, num_args: int, meta: dict, config: triton.Config) -> tuple:
    """The values of `kernel`'s parameters after its first `num_args`, in order: from `meta`, the tile, or the
    parameter's default. A KeyError names a parameter left without one."""
    values = {p.name: p.default for p in kernel.params if p.has_default}
    values.update(meta)
    values.update(config.all_kwargs())
    return tuple(values[name] for name in kernel.arg_names[num_args:])


COMPILED = CompiledLaunches()
