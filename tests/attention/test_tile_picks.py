"""The autotuner's picks: kept, keyed like the autotuner's own cache, and launched instead of autotuning (eagerly
and under torch.compile), so that a resumed `fa2` run launches the tiles the interrupted one did.

The launches are recorded, not run (no GPU needed); tests/train/test_loop.py runs the whole round trip on a GPU."""

import json

import pytest
import torch

pytest.importorskip("triton")

from stableflash.attention.precision import resolve  # noqa: E402
from stableflash.attention.triton import ops  # noqa: E402
from stableflash.attention.triton.picks import TILE_PICKS, TilePicks  # noqa: E402
from stableflash.attention.triton.spec import build_spec  # noqa: E402

pytestmark = pytest.mark.skipif(ops._fwd is None, reason="the interpreter has no autotuner")


@pytest.fixture(autouse=True)
def empty_picks():
    saved = TILE_PICKS.state_dict()
    TILE_PICKS.clear()
    yield
    TILE_PICKS.clear()
    TILE_PICKS.load_state_dict(saved)


def recorded_launches(head_dim=64, T=100):
    """The forward's and backward's launches for fa2 numerics, as (tuned, plain, grid, args, meta) tuples."""
    key = ops.register_spec(build_spec(resolve("fa2"), None, torch.bfloat16, T))
    launches = []
    record = lambda tuned, plain, grid, *args, config=None, **meta: launches.append((tuned, plain, grid, args, meta))  # noqa: E731
    q, k, v, dout = (torch.randn(2, 3, T, head_dim, dtype=torch.bfloat16) for _ in range(4))
    out, _, lse, _, _ = ops.forward(q, k, v, True, 0.25, key, False, 1e-3, launch=record)
    ops.backward(dout, q, k, v, out, lse, True, 0.25, key, launch=record)
    return launches


def test_picks_survive_a_round_trip_through_json():
    picks = TilePicks()
    key = TilePicks.key("_attn_fwd", "either", 1000, torch.bfloat16, {"CAUSAL": True, "BETA": 0.5, "R_QK": 3})
    picks.record(key, ops._cfg(128, 64, 8, 3))
    again = TilePicks()
    again.load_state_dict(json.loads(json.dumps(picks.state_dict())))
    config = again.get(key)
    assert (config.kwargs, config.num_warps, config.num_stages) == ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3)


def test_a_pick_is_keyed_like_the_autotuners_cache():
    (tuned, plain, _, args, meta), *_ = recorded_launches()
    key = ops._pick_key(tuned, plain, args, meta)
    assert key[:4] == ("_attn_fwd", "pointers", 100, "torch.bfloat16")
    assert ops._pick_key(tuned, plain, args, {**meta, "CAUSAL": False}) != key  # another specialisation
    (_, _, _, longer, _), *_ = recorded_launches(T=101)
    assert ops._pick_key(tuned, plain, longer, meta) != key
    assert ops._pick_key(None, plain, args, meta) is None  # a launch with a fixed tile is not autotuned
    # at D = 128 the candidates include TMA loads: another candidate list, another pick
    (tuned128, plain128, _, args128, meta128), *_ = recorded_launches(head_dim=128)
    assert tuned128 is ops._fwd_either and ops._pick_key(tuned128, plain128, args128, meta128)[1] == "either"


def test_a_traced_launch_takes_the_pick_as_a_fixed_tile(monkeypatch):
    """Under torch.compile a picked launch goes to inductor as the plain kernel with the pick's tile, which
    inductor does not autotune again; without a pick, as the autotuner (inductor autotunes it)."""
    traced = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: traced.append((self.fn, kwargs))

    monkeypatch.setattr(ops, "wrap_triton", Recorder)
    for tuned, plain, grid, args, meta in recorded_launches():
        ops._traced_launch(tuned, plain, grid, *args, **meta)
    assert [fn for fn, _ in traced] == [ops._fwd, ops._dq, ops._dkdv]

    traced.clear()
    launches = recorded_launches()
    picks = [ops._cfg(64, 64, 4, 3), ops._cfg(128, 32, 4, 5), ops._cfg(32, 128, 4, 5)]
    for (tuned, plain, _, args, meta), pick in zip(launches, picks):
        TILE_PICKS.record(ops._pick_key(tuned, plain, args, meta), pick)
    for tuned, plain, grid, args, meta in launches:
        ops._traced_launch(tuned, plain, grid, *args, **meta)
    assert [fn for fn, _ in traced] == [plain for _, plain, *_ in launches]
    for (_, kwargs), pick in zip(traced, picks):
        assert {k: kwargs[k] for k in pick.kwargs} == pick.kwargs
        assert (kwargs["num_warps"], kwargs["num_stages"]) == (pick.num_warps, pick.num_stages)


def test_pinning_replaces_the_picks_and_forgets_cached_launches():
    key = TilePicks.key("_attn_fwd", "pointers", 64, torch.bfloat16, {})
    TILE_PICKS.record(key, ops._cfg(128, 64, 8, 3))
    ops._launches.cache["stale"] = None
    ops.pin_tiles([{"key": list(key), "kwargs": {"BLOCK_M": 64, "BLOCK_N": 64}, "num_warps": 4, "num_stages": 3}])
    assert TILE_PICKS.get(key).kwargs == {"BLOCK_M": 64, "BLOCK_N": 64} and "stale" not in ops._launches.cache
