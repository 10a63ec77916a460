"""Eager launch plans (`triton/launch.py`): a call with a signature seen before launches what the deciding call
launched, with its own arguments, and decides nothing. Stand-in kernels on the CPU: no GPU needed."""

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from stableflash.attention.precision import resolve  # noqa: E402
from stableflash.attention.triton import compiled, launch  # noqa: E402
from stableflash.attention.triton.spec import spec_name  # noqa: E402
from stableflash.attention.triton.tuning import TILE_PICKS, Tunable  # noqa: E402


class StandInKernel:
    """A JIT function's name and parameters; `kernel[grid](...)` records the compiling launch and returns a compiled
    kernel whose launcher records the later ones."""

    def __init__(self, real, log):
        self.__name__, self.arg_names, self.params, self.log = real.__name__, real.arg_names, real.params, log

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append((self.__name__, tuple(grid) + (1,) * (2 - len(grid)), args))
            return SimpleNamespace(run=self._launcher, function=None, packed_metadata=None)
        return run

    def _launcher(self, x, y, z, stream, function, packed, metadata, enter, exit_, *values):
        assert len(values) == len(self.arg_names)  # every parameter's value, in order
        self.log.append((self.__name__, (x, y), values))


@pytest.fixture
def stand_ins(monkeypatch):
    log = []
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "hopper", None)
    monkeypatch.setattr(compiled, "_device", lambda: 0)
    monkeypatch.setattr(compiled, "_stream", lambda device: 0)
    monkeypatch.setattr(launch, "COMPILED", compiled.CompiledLaunches())
    monkeypatch.setattr(launch, "PLANS", launch.Plans())
    tile = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "TMA": False}, num_warps=4, num_stages=2)
    monkeypatch.setattr(TILE_PICKS, "get", lambda key: tile)  # a pick for every launch: no autotuning
    for name in ("NATIVE_FWD", "NATIVE_DQ", "NATIVE_DKDV"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, Tunable(StandInKernel(real.kernel, log), real.key, None, None))
    for name in ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv", "attn_bwd_delta_dpp"):
        monkeypatch.setattr(launch.emulation, name, StandInKernel(getattr(launch.emulation, name), log))
    return log


def _inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, 3, 77, 64, generator=generator, dtype=torch.bfloat16) for _ in range(4))
    return q, k, v, dout


def _call(name, stats, seed):
    q, k, v, dout = _inputs(seed)
    out, o_saved, lse, _, _ = launch.forward(q, k, v, True, 0.125, name, stats, 1e-3)
    launch.backward(dout, q, k, v, o_saved if o_saved.numel() else out, lse, True, 0.125, name)
    return q, out


def _shape_of(args):
    return tuple(("tensor", a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("preset", ["fa2", "paper"])
def test_a_planned_call_launches_what_its_deciding_call_launched(stand_ins, preset, stats, monkeypatch):
    name = spec_name(resolve(preset), None, torch.bfloat16, 64, 77)
    _call(name, stats, 0)  # decides, compiles through `kernel[grid](...)`
    decided = list(stand_ins)
    assert len(launch.PLANS) == 2  # the forward's and the backward's
    stand_ins.clear()

    def no_deciding(*args, **kwargs):
        raise AssertionError("a planned call decided again")

    monkeypatch.setattr(launch, "_forward_branch", no_deciding)
    monkeypatch.setattr(launch, "_run", no_deciding)
    for seed in (1, 2):
        q, out = _call(name, stats, seed)
        assert [(kernel, grid) for kernel, grid, _ in stand_ins] == [(kernel, grid) for kernel, grid, _ in decided]
        for (_, _, now), (_, _, then) in zip(stand_ins, decided, strict=True):
            # runtime arguments like the deciding call's, then compile-time values only
            assert _shape_of(now[:len(then)]) == _shape_of(then)
            assert not any(isinstance(a, torch.Tensor) for a in now[len(then):])
        assert stand_ins[0][2][0] is q and stand_ins[0][2][3] is out
        stand_ins.clear()


def test_changed_tile_picks_or_another_signature_decide_again(stand_ins):
    name = spec_name(resolve("fa2"), None, torch.bfloat16, 64, 77)
    _call(name, False, 0)
    assert len(launch.PLANS) == 2
    TILE_PICKS.version += 1  # as a recorded or loaded pick does
    _call(name, False, 0)
    assert len(launch.PLANS) == 4
    q, k, v, _ = _inputs(0)
    launch.forward(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, True, 0.125, name, False, 1e-3)  # strides
    assert len(launch.PLANS) == 5


class TracedLaunch:
    """`wrap_triton`'s stand-in: inductor takes exactly the arguments a traced launch passes, so every parameter of
    the kernel (the autotuner's: but its tile) must be among them."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            fn = self.kernel.fn if isinstance(self.kernel, triton.runtime.Autotuner) else self.kernel
            tiled = {name for c in getattr(self.kernel, "configs", ()) for name in c.kwargs}
            given = set(fn.arg_names[:len(args)]) | set(kwargs) | tiled
            missing = [name for name in fn.arg_names if name not in given]
            assert not missing, f"{fn.__name__}: a traced launch leaves out {missing}"
            self.log.append(fn.__name__)
        return launch_


@pytest.mark.parametrize("preset, picked", [("fa2", True), ("fa2", False), ("paper", True)],
                         ids=["fa2, picked tile", "fa2, autotuned", "paper (emulation)"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_traced_launches_pass_every_parameter(monkeypatch, preset, picked, masked, kv_heads):
    log = []
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "wrap_triton", lambda kernel: TracedLaunch(kernel, log))
    tile = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "TMA": False}, num_warps=4, num_stages=2)
    monkeypatch.setattr(TILE_PICKS, "get", lambda key: tile if picked else None)
    name = spec_name(resolve(preset), None, torch.bfloat16, 64, 77)
    q, k, v, dout = _inputs(0)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    keep = torch.ones(q.shape[0], k.shape[-2], dtype=torch.bool)
    band = launch.band_of(q, k, True, (9, 0), keep) if masked else None
    out, o_saved, lse, _, _ = launch.forward(q, k, v, True, 0.125, name, True, 1e-3, traced=True, band=band)
    launch.backward(dout, q, k, v, o_saved if o_saved.numel() else out, lse, True, 0.125, name, traced=True,
                    band=band)
    assert log[0] == "attn_fwd" and log[-2:] == ["attn_bwd_dq", "attn_bwd_dkdv"]


def test_a_planned_call_asks_for_the_stream_once(stand_ins, monkeypatch):
    asked = []
    monkeypatch.setattr(compiled, "_stream", lambda device: asked.append(device) or 0)
    name = spec_name(resolve("fa2"), None, torch.bfloat16, 64, 77)
    _call(name, False, 0)  # decides
    asked.clear()
    _call(name, False, 1)
    assert len(asked) == 2  # the forward's one launch and the backward's two: once per call


def test_shared_empties_are_made_once(stand_ins):
    name = spec_name(resolve("fa2"), None, torch.bfloat16, 64, 77)
    q, k, v, _ = _inputs(0)
    first, again = (launch.forward(q, k, v, True, 0.125, name, False, 1e-3, shared_empties=True) for _ in range(2))
    assert all(a is b and a.numel() == 0 for a, b in zip(first[1:2] + first[3:], again[1:2] + again[3:]))
    fresh = launch.forward(q, k, v, True, 0.125, name, False, 1e-3)
    assert fresh[1] is not first[1] and fresh[3] is not first[3]


def test_every_switch_a_native_launch_passes_is_in_its_autotuners_key(monkeypatch):
    """A masked, padded, packed or grouped launch is tuned for itself: each compile-time switch the launcher passes
    (the band's, `GROUP`) is part of the autotuner's key, so it never reuses the plain launch's pick."""
    passed = []
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "hopper", None)
    monkeypatch.setattr(launch, "_run_tuned", lambda tunable, grid, args, meta, **kw: passed.append((tunable, meta)))
    name = spec_name(resolve("fa2"), None, torch.bfloat16, 64, 77)
    generator = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, 77, 64, generator=generator, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 77, 64, generator=generator, dtype=torch.bfloat16) for _ in range(2))  # GQA
    keep = torch.ones(2, 77, dtype=torch.bool)
    segments = launch.packed_segments([0, 30, 77], [0, 30, 77], q.device)
    for band in (None, launch.band_of(q, k, True, (16, 0), None), launch.band_of(q, k, False, (-1, -1), keep),
                 launch.band_of(q[:1], k[:1], True, (-1, -1), None, segments)):
        qb, kb, vb, db = (t[:1] if band is not None and band.packed else t for t in (q, k, v, dout))
        lse = torch.zeros(qb.shape[:3], dtype=torch.float32)
        launch.forward(qb, kb, vb, True, 0.125, name, False, 1e-3, band=band)
        launch.backward(db, qb, kb, vb, qb, lse, True, 0.125, name, band=band)
    switches = {"MASK", "PAD", "SEG", "GROUP"}
    assert switches <= {name for _, meta in passed for name in meta}  # every form was launched
    for tunable, meta in passed:
        missing = (set(meta) & switches) - set(tunable.key)
        assert not missing, f"{tunable.kernel.__name__} is tuned without {sorted(missing)} in its key"
