"""The autotuner's picks: kept, keyed like the autotuner's own cache, and launched instead of autotuning, so that a
resumed `fa2` run launches the tiles the interrupted one did.

The launches are recorded, not run (no GPU needed); tests/train/test_loop.py runs the whole round trip on a GPU."""

import json

import pytest
import torch

pytest.importorskip("triton")

from stableflash.attention import triton as kernels  # noqa: E402
from stableflash.attention.precision import resolve  # noqa: E402
from stableflash.attention.triton import launch, tuning  # noqa: E402
from stableflash.attention.triton.spec import spec_name  # noqa: E402
from stableflash.attention.triton.tuning import TILE_PICKS, TilePicks  # noqa: E402
from tests.attention.conftest import no_tile_picks  # noqa: E402

# gpu: the GPU suite's selection; under the interpreter, test_launch.py runs this file in a child without it
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(tuning.NATIVE_FWD.pointers is None, reason="the interpreter has no autotuner")]


@pytest.fixture(autouse=True)
def empty_picks():
    with no_tile_picks():
        yield


def recorded_launches(monkeypatch, head_dim=64, T=100):
    """The forward's and backward's tuned launches for fa2 numerics, as dicts of `_launch_tuned`'s arguments."""
    launches = []

    def record(tunable, grid, args, meta, **kw):
        launches.append(dict(tunable=tunable, grid=grid, args=args, meta=meta, **kw))

    with monkeypatch.context() as patch:
        patch.setattr(launch, "_launch_tuned", record)
        name = spec_name(resolve("fa2"), None, torch.bfloat16, head_dim, T)
        q, k, v, dout = (torch.randn(2, 3, T, head_dim, dtype=torch.bfloat16) for _ in range(4))
        out, _, lse, _, _ = launch.forward(q, k, v, True, 0.25, name, False, 1e-3)
        launch.backward(dout, q, k, v, out, lse, True, 0.25, name)
    return launches


def _key(launched, **changes):
    r = {**launched, **changes}
    return TILE_PICKS.key(r["tunable"].name, "either" if r["either"] else "pointers", r["T"], r["dtype"],
                          r["meta"])


def test_picks_survive_a_round_trip_through_json():
    picks = TilePicks()
    key = TilePicks.key("attn_fwd", "either", 1000, torch.bfloat16, {"CAUSAL": True, "BETA": 0.5, "STAB": 1})
    picks.record(key, tuning.config(128, 64, 8, 3))
    again = TilePicks()
    assert again.load_state_dict(json.loads(json.dumps(picks.state_dict()))) == 0
    config = again.get(key)
    assert (config.kwargs, config.num_warps, config.num_stages) == ({"BLOCK_M": 128, "BLOCK_N": 64}, 8, 3)


def test_a_pick_is_keyed_like_the_autotuners_cache(monkeypatch):
    fwd, dq, dkdv = recorded_launches(monkeypatch)
    assert [r["tunable"] for r in (fwd, dq, dkdv)] == [tuning.NATIVE_FWD, tuning.NATIVE_DQ, tuning.NATIVE_DKDV]
    key = _key(fwd)
    assert key[:4] == ("attn_fwd", "pointers", 100, "torch.bfloat16")
    assert _key(fwd, meta={**fwd["meta"], "CAUSAL": False}) != key  # another specialisation
    assert _key(recorded_launches(monkeypatch, T=101)[0]) != key
    # at D = 128 the candidates include TMA loads: another candidate list, another pick
    wide = recorded_launches(monkeypatch, head_dim=128)[0]
    assert wide["either"] and _key(wide)[1] == "either"


def test_a_picked_launch_takes_its_tile_and_an_unpicked_one_autotunes_and_records(monkeypatch):
    """With a pick, the plain kernel launches with the pick's tile; without one, the autotuner launches, and its best
    config becomes the pick."""
    launched = []

    class Recorder:
        def __init__(self, fn, best=None):
            self.fn, self.best_config = fn, best

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.fn, kwargs))

    launches = recorded_launches(monkeypatch)
    best = tuning.config(64, 64, 4, 3, TMA=False)
    for r in launches:
        tunable = r["tunable"]._replace(kernel=Recorder(r["tunable"].kernel),
                                        pointers=Recorder(r["tunable"].pointers, best))
        launch._launch_tuned(tunable, r["grid"], r["args"], r["meta"], T=r["T"], dtype=r["dtype"], either=False)
    assert [fn for fn, _ in launched] == [r["tunable"].pointers for r in launches]
    assert [TILE_PICKS.get(_key(r)) for r in launches] == [best] * 3

    launched.clear()
    picks = [tuning.config(64, 64, 4, 3, TMA=False), tuning.config(128, 32, 4, 5, TMA=False),
             tuning.config(32, 128, 4, 5, TMA=False)]
    for r, pick in zip(launches, picks):
        TILE_PICKS.record(_key(r), pick)
        tunable = r["tunable"]._replace(kernel=Recorder(r["tunable"].kernel))
        launch._launch_tuned(tunable, r["grid"], r["args"], r["meta"], T=r["T"], dtype=r["dtype"], either=False)
    assert [fn for fn, _ in launched] == [r["tunable"].kernel for r in launches]
    for (_, kwargs), pick in zip(launched, picks):
        assert {k: kwargs[k] for k in pick.kwargs} == pick.kwargs
        assert (kwargs["num_warps"], kwargs["num_stages"]) == (pick.num_warps, pick.num_stages)


def test_loading_replaces_the_picks_and_leaves_out_other_versions_kernels():
    key = TilePicks.key("attn_fwd", "pointers", 64, torch.bfloat16, {})
    TILE_PICKS.record(key, tuning.config(128, 64, 8, 3))
    # an earlier version's pick, keyed by its function's name and compile-time switches this version does not have
    old = TilePicks.key("_attn_fwd", "pointers", 64, torch.bfloat16, {"EMU": False})
    state = [{"key": list(key), "kwargs": {"BLOCK_M": 64, "BLOCK_N": 64}, "num_warps": 4, "num_stages": 3},
             {"key": list(old), "kwargs": {"BLOCK_M": 64, "BLOCK_N": 64}, "num_warps": 4, "num_stages": 3}]
    assert kernels.load_tile_picks(state) == 1
    assert TILE_PICKS.get(key).kwargs == {"BLOCK_M": 64, "BLOCK_N": 64} and TILE_PICKS.get(old) is None
    assert kernels.tile_picks_state_dict() == state[:1]


def test_tma_streamable_needs_16_byte_aligned_rows():
    """TMA descriptors need 16-byte aligned bases and strides: a model's heads qualify, a misaligned view does not
    (the launch then keeps pointer loads rather than letting the autotuner pick TMA)."""
    B, T, H, D = 2, 77, 3, 128
    qkv = torch.randn(B, T, 3 * H * D, dtype=torch.bfloat16)
    heads = [t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2)]
    assert launch.tma_streamable(*heads)
    assert launch.tma_streamable(torch.randn(B, H, T, D, dtype=torch.bfloat16))
    shifted = torch.randn(B * H * T * D + 1, dtype=torch.bfloat16)[1:].view(B, H, T, D)  # base 2 bytes past 16
    assert not launch.tma_streamable(shifted)
    odd_rows = torch.randn(B, H, T, D + 4, dtype=torch.bfloat16)[..., :D]  # row stride 264 bytes
    assert not launch.tma_streamable(odd_rows)
