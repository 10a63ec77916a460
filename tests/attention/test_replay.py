"""Eager launch plans (`stableflash.attention.triton.replay`) with stand-in kernels: no GPU needed.

The GPU test that replayed calls give the launchers' bits is in test_triton.py."""

import gc
import weakref

import pytest
import torch

triton = pytest.importorskip("triton")
from stableflash.attention.triton import replay  # noqa: E402


class StandInKernel:
    """Takes a launch's arguments as Triton's compiled kernels do, and keeps them."""
    function = packed_metadata = "handle"

    class metadata:  # noqa: N801 (as Triton names it)
        global_scratch_size = 0

    def __init__(self):
        self.calls = []

    def run(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        self.calls.append(((grid_x, grid_y, grid_z, stream), args))


def _planned_call():
    """One call: inputs (q, counts), an output in transposed memory order, a scratch tensor of its own, two launches."""
    q, counts = torch.randn(2, 5, 3, 4).transpose(1, 2), torch.zeros(3, dtype=torch.int64)
    out = torch.empty(2, 5, 3, 4, dtype=torch.float16).transpose(1, 2)
    scratch = torch.empty(7)
    first, second = StandInKernel(), StandInKernel()
    launches = [replay.Launch(first, (4, 6), (q, out, scratch, 5, 0.25), ("C",)),
                replay.Launch(second, (2, 1), (scratch, counts, out, 3), ())]
    return (q, counts), (out, counts), launches, (first, second)


def test_a_plan_puts_each_calls_tensors_in_place_and_allocates_like_the_first_call():
    tensors, outputs, launches, (first, second) = _planned_call()
    plan = replay.Plan.build(tensors, outputs, launches)
    q, counts = torch.randn(2, 5, 3, 4).transpose(1, 2), torch.ones(3, dtype=torch.int64)
    out, returned_counts = plan.replay((q, counts), stream=11)
    assert returned_counts is counts  # an input returned stays the caller's tensor
    assert out.shape == (2, 3, 5, 4) and out.stride() == (60, 4, 12, 1) and out.dtype == torch.float16
    (grid, args), = first.calls
    assert grid == (4, 6, 1, 11) and args[0] is q and args[1] is out and args[3:] == (5, 0.25, "C")
    (grid, args2), = second.calls
    assert grid == (2, 1, 1, 11) and args2[0] is args[2] and args2[1] is counts and args2[2] is out
    assert args[2].shape == (7,) and args[2] is not q  # the call's own scratch: allocated afresh, shared by both


def test_a_plan_keeps_no_tensor_of_the_call_that_made_it():
    tensors, outputs, launches, _ = _planned_call()
    plan = replay.Plan.build(tensors, outputs, launches)
    watched = [weakref.ref(t) for t in (*tensors, *outputs, launches[0].args[2])]
    del tensors, outputs, launches
    gc.collect()
    assert all(ref() is None for ref in watched)
    assert not plan.scratch


def test_calls_with_aliased_inputs_copied_inputs_or_launch_hooks_are_not_planned():
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    assert replay.replayable((q, k))
    assert not replay.replayable((q, q))  # a plan names tensors by position
    assert not replay.replayable((q, k.transpose(2, 3)))  # the launchers would copy it: not an allocation to replay
    hook = triton.knobs.runtime.launch_enter_hook
    assert replay.launch_hooks() == (None, None)
    hook.add(print)
    try:
        assert replay.launch_hooks()[0] is hook and not replay.replayable((q, k))
    finally:
        hook.remove(print)
    assert replay.replayable((q, k))


def test_launches_are_recorded_only_inside_record():
    replay.note("kernel", (3,), (1,), ())
    with replay.record() as launches:
        replay.note("kernel", (3,), (1,), ())
        replay.note("kernel", (3, 2), (2,), ("C",))
    replay.note("kernel", (3,), (1,), ())
    assert [(launch.grid, launch.args) for launch in launches] == [((3, 1), (1,)), ((3, 2), (2,))]
