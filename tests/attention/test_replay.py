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


def test_empty_placeholders_are_passed_as_the_plan_holds_them_not_allocated():
    """Empty tensors a call makes (the statistics' targets without statistics) hold nothing a kernel could write:
    every replay passes the first call's, and allocates only the tensors that have elements."""
    q = torch.randn(3, 4)
    out, placeholder = torch.empty(3, 4), torch.empty(0, dtype=torch.int64)
    kernel = StandInKernel()
    plan = replay.Plan.build((q,), (out, placeholder), [replay.Launch(kernel, (1, 1), (q, out, placeholder), ())])
    assert len(plan.allocations) == 1 and plan.placeholders == (placeholder,)
    new_q = torch.randn(3, 4)
    new_out, returned = plan.replay((new_q,), stream=0)
    (_, args), = kernel.calls
    assert returned is placeholder and args[2] is placeholder and args[0] is new_q and args[1] is new_out
    assert new_out is not out and new_out.shape == (3, 4)


def test_signatures_whose_calls_pass_a_view_of_an_input_as_their_own_tensor_run_the_launchers(monkeypatch):
    """A tensor the call made that shares an input's memory (a view or in-place copy) is not something a plan can
    allocate afresh: that signature is marked unplannable and runs its launchers every call; others replay."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("Stream", (), {"cuda_stream": 0}))
    plans = replay.EagerPlans(lambda: None, device_types=("cpu",))
    kernel, runs = StandInKernel(), []

    def call(q, view):
        def run():
            runs.append(view)
            out = torch.empty_like(q)
            replay.note(kernel, (1,), (q, q[:, :1] if view else torch.empty(3), out), ())
            return (out,)
        return plans(run, ("static", view), (q,))

    for view in (False, True):
        for _ in range(3):
            call(torch.randn(2, 4), view)
    assert runs == [False, True, True, True] and list(plans.plans.values())[1] is None
    assert len(kernel.calls) == 2  # the first signature's second and third calls, replayed


def test_calls_with_aliased_inputs_copied_inputs_or_launch_hooks_are_not_planned():
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    assert replay.describe((q, k)) is not None
    assert replay.describe((q, q)) is None  # a plan names tensors by position
    assert replay.describe((q, k.transpose(2, 3))) is None  # the launchers would copy it: not an allocation to replay
    hook = triton.knobs.runtime.launch_enter_hook
    assert replay.launch_hooks() == (None, None)
    hook.add(print)
    try:
        assert replay.launch_hooks()[0] is hook and replay.describe((q, k)) is None
    finally:
        hook.remove(print)
    assert replay.describe((q, k)) is not None


def test_switched_restores_the_setting_it_found():
    plans = replay.EagerPlans(lambda: None, enabled=False)  # as STABLEFLASH_REPLAY=0 sets it
    with plans.switched(True):
        assert plans.enabled
    assert not plans.enabled
    with pytest.raises(RuntimeError), plans.switched(True):
        raise RuntimeError
    assert not plans.enabled


def test_launches_are_recorded_only_inside_record():
    replay.note("kernel", (3,), (1,), ())
    with replay.record() as launches:
        replay.note("kernel", (3,), (1,), ())
        replay.note("kernel", (3, 2), (2,), ("C",))
    replay.note("kernel", (3,), (1,), ())
    assert [(launch.grid, launch.args) for launch in launches] == [((3, 1), (1,)), ((3, 2), (2,))]


class RecordingLaunchCache(dict):
    """`ops._Launches.cache` holding one stand-in kernel for every launch, so launches run on the CPU: no compile."""

    def __init__(self):
        super().__init__()
        self.kernel = StandInKernel()

    def get(self, key, default=None):
        return self.kernel, {"BLOCK_M": 64, "BLOCK_N": 64}, ()


def test_eager_calls_replay_the_launchers_arguments_with_their_own_tensors(monkeypatch):
    """Through `FlashAttention` (forward and backward, SFA and statistics): the second call of a signature runs no
    launcher and passes its kernels what the launchers would: its own inputs where the first call's were, fresh
    tensors shaped like the first call's allocations elsewhere (one δ shared by the two backward kernels), and the
    same integers and floats."""
    from stableflash import SFA
    from stableflash.attention import precision, stabilize
    from stableflash.attention.triton import _kernel_key, ops

    cache = RecordingLaunchCache()
    monkeypatch.setattr(ops._launches, "cache", cache)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("Stream", (), {"cuda_stream": 7}))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    plans = replay.EagerPlans(ops.ensure_scratch_allocator, device_types=("cpu",))
    monkeypatch.setattr(ops, "_eager_plans", plans)
    B, H, T, D = 2, 3, 40, 64
    key = _kernel_key(precision.resolve("fa2").cache_key, stabilize.cache_key(SFA()), torch.bfloat16, D, T)

    def call():
        q, k, v = (torch.randn(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3))
        targets = ops.fresh_stat_targets(H, "cpu")
        dout = torch.randn_like(q)
        cache.kernel.calls.clear()
        ops.FlashAttention.apply(q, k, v, True, 0.125, key, True, 1e-3, targets).backward(dout)
        return (q, k, v, *targets, dout), [args for _, args in cache.kernel.calls]

    launched, forward = [], ops.forward
    monkeypatch.setattr(ops, "forward", lambda *a, **kw: launched.append("forward") or forward(*a, **kw))
    first_inputs, first = call()
    second_inputs, second = call()
    assert launched == ["forward"] and len(plans.plans) == 2 and len(first) == len(second) == 3
    first_ids = {id(t): i for i, t in enumerate(first_inputs)}
    fresh = {}  # the first call's allocations -> the second call's
    for args1, args2 in zip(first, second):
        assert len(args1) == len(args2)
        for a1, a2 in zip(args1, args2):
            if not isinstance(a1, torch.Tensor):
                assert a1 == a2
            elif id(a1) in first_ids:
                assert a2 is second_inputs[first_ids[id(a1)]]
            else:
                assert fresh.setdefault(id(a1), a2) is a2 and all(a2 is not t for t in second_inputs)
                assert (a2.shape, a2.stride(), a2.dtype) == (a1.shape, a1.stride(), a1.dtype)
    def tensor_ids(args):
        return {id(a) for a in args if isinstance(a, torch.Tensor)}

    # δ: allocated by the backward, written by the dQ kernel and read by the dK/dV kernel (mapped once, above)
    delta = (tensor_ids(first[1]) & tensor_ids(first[2])) - tensor_ids(first[0]) - set(first_ids)
    assert len(delta) == 1
