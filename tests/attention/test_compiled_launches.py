"""The eager launch seam (`triton/compiled.py`) with stand-in kernels: no GPU needed.

The first launch of a specialisation goes through the kernel's `kernel[grid](...)`; later ones through the compiled
kernel's launcher with every parameter's value in the kernel's order, which is how `JITFunction.run` launches it:
directly, or through `compiled[grid](...)` where a profiler's launch hook is registered."""

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from stableflash.attention.triton import compiled  # noqa: E402


class StandInKernel:
    """A JIT function's parameters, and a `kernel[grid](...)` that records the call and returns a compiled kernel
    whose own `compiled[grid](*values)` records the launch."""

    def __init__(self, names, defaults, unspecialised=()):
        self.arg_names = list(names)
        self.params = [SimpleNamespace(num=i, name=n, has_default=n in defaults, default=defaults.get(n),
                                       do_not_specialize=n in unspecialised) for i, n in enumerate(names)]
        self.calls, self.launches = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return StandInCompiled(self)
        return run


class StandInCompiled:
    """A compiled kernel's launcher as Triton 3.6 calls it: grid, stream, function, packed metadata, launch metadata,
    the two hooks, then every parameter's value."""

    function, packed_metadata = "function", "packed"

    def __init__(self, owner):
        self.owner = owner

    def run(self, x, y, z, stream, function, packed, metadata, enter, exit_, *values):
        assert (stream, function, packed, metadata, enter, exit_) == (STREAM, "function", "packed", None, None, None)
        self.owner.launches.append(((x, y, z), values))

    def __getitem__(self, grid):
        return lambda *values: self.owner.launches.append(("hooked", grid, values))


STREAM = 1234


@pytest.fixture
def launches(monkeypatch):
    monkeypatch.setattr(compiled, "_device", lambda: 0)
    monkeypatch.setattr(compiled, "_stream", lambda device: STREAM)
    return compiled.CompiledLaunches()


def _kernel():
    return StandInKernel(["X", "T", "scale", "HEAD_DIM", "BLOCK_M", "CAUSAL", "EXTRA"], {"CAUSAL": True, "EXTRA": 7})


def test_the_first_launch_compiles_and_later_ones_pass_every_value_in_order(launches):
    kernel = _kernel()
    config = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=2)
    x = torch.zeros(64)

    def grid(tile):
        return (100 // tile["BLOCK_M"] + 1, 3)

    for scale in (0.5, 0.25):  # floats are runtime values: the same specialisation
        launches.launch(kernel, grid, (x, 100, scale), {"HEAD_DIM": 16}, config)
    assert len(kernel.calls) == 1
    assert kernel.calls[0][2] == {"HEAD_DIM": 16, "BLOCK_M": 64, "num_warps": 4, "num_stages": 2}
    assert kernel.launches == [((2, 3, 1), (x, 100, 0.25, 16, 64, True, 7))]


def test_what_triton_specialises_on_gives_a_new_entry(launches):
    kernel = _kernel()
    config = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=2)
    grid = lambda tile: (1, 1)  # noqa: E731
    base = torch.zeros(64)
    for args, meta in [((base, 100, 1.0), {"HEAD_DIM": 16}), ((base, 101, 1.0), {"HEAD_DIM": 16}),
                       ((base.half(), 100, 1.0), {"HEAD_DIM": 16}), ((base[1:], 100, 1.0), {"HEAD_DIM": 16}),
                       ((base, 100, 1.0), {"HEAD_DIM": 32})]:
        launches.launch(kernel, grid, args, meta, config)
    assert len(launches) == 5 and len(kernel.calls) == 5 and kernel.launches == []
    launches.launch(kernel, grid, (base, 100, 1.0), {"HEAD_DIM": 16}, triton.Config({"BLOCK_M": 32}, num_warps=4))
    assert len(launches) == 6  # another tile


def test_a_parameter_left_without_a_value_is_named(launches):
    kernel = StandInKernel(["X", "HEAD_DIM", "BLOCK_M"], {})
    with pytest.raises(KeyError, match="HEAD_DIM"):
        compiled.trailing_values(kernel, 1, {}, triton.Config({"BLOCK_M": 64}))


def test_a_registered_launch_hook_gets_the_launch(launches):
    kernel = _kernel()
    config = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=2)
    x = torch.zeros(64)
    seen = []
    hook = seen.append
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert compiled._hooks_registered()
        for _ in range(2):
            launches.launch(kernel, lambda tile: (5,), (x, 100, 0.5), {"HEAD_DIM": 16}, config)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert not compiled._hooks_registered()
    assert kernel.launches == [("hooked", (5, 1, 1), (x, 100, 0.5, 16, 64, True, 7))]


def test_an_int_triton_does_not_specialise_on_keeps_one_entry(launches):
    """A stochastic rounding seed changes every call (`do_not_specialize`): one compiled kernel for every value."""
    kernel = StandInKernel(["X", "T", "seed", "HEAD_DIM", "BLOCK_M"], {}, unspecialised=("seed",))
    config = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=2)
    x = torch.zeros(64)
    for seed in (1, 16, 12345):
        launches.launch(kernel, lambda tile: (1,), (x, 100, seed), {"HEAD_DIM": 16}, config)
    assert len(launches) == 1 and len(kernel.calls) == 1
    assert [values[2] for _, values in kernel.launches] == [16, 12345]
