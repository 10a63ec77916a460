"""Launchers and `torch.library` ops around the fused kernels.

The ops take the kernel specialisation as a string key (registered by
`register_spec`). Two pairs:
- `flash_fwd` / `flash_bwd` (`custom_op`): opaque to `torch.compile`, with fake
  implementations that only describe output shapes; used under the interpreter;
- `flash_fwd_traced` / `flash_bwd_traced` (`triton_op`): on a GPU, inductor traces
  into them and launches the kernels from its own generated code (no Python op
  per call: the compiled model's host work per attention call drops to that of
  any inductor kernel). `TRACEABLE = False` falls back to the opaque pair.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton
from triton.runtime import _allocation  # the allocator in effect: Triton has no public getter

from stableflash.attention.triton import kernels, replay
from stableflash.attention.triton.picks import TILE_PICKS, PickKey
from stableflash.attention.triton.spec import INTERPRET, LOG2E, PHYSICAL_TILE, KernelSpec

try:  # Gluon, Triton's lower-level language (3.5 and later): the native forward on Hopper
    from stableflash.attention.triton import hopper
except ImportError:
    hopper = None

_SPECS: dict[str, KernelSpec] = {}


def register_spec(spec: KernelSpec) -> str:
    key = repr(spec)
    _SPECS.setdefault(key, spec)
    return key


def _cfg(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


# Candidate tiles; the forward and dQ kernels need BLOCK_M % BLOCK_N == 0, the dK/dV kernel the reverse.
_FWD_CONFIGS = [_cfg(128, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 128, 8, 3), _cfg(128, 128, 8, 2),
                _cfg(64, 64, 4, 3), _cfg(128, 32, 4, 3)]
_DKDV_CONFIGS = [_cfg(32, 128, 4, 3), _cfg(32, 128, 4, 5), _cfg(64, 128, 8, 3), _cfg(64, 128, 4, 3),
                 _cfg(64, 64, 4, 3), _cfg(32, 64, 4, 3)]
_DQ_CONFIGS = [_cfg(128, 32, 4, 3), _cfg(128, 32, 4, 5), _cfg(128, 64, 8, 3), _cfg(128, 64, 4, 3),
               _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 3)]
_EMU_CONFIG = _cfg(PHYSICAL_TILE, PHYSICAL_TILE, 4, 2)
# fp32 matmul operands double the shared memory: at D = 128 the 64x64 dK/dV tile asked 246,272 bytes (H200: 232,448)
_EMU_CONFIG_FP32_D128 = _cfg(PHYSICAL_TILE // 2, PHYSICAL_TILE // 2, 4, 2)


def _emu_config(ops_fp32: bool, head_dim: int) -> triton.Config:
    """The one tile of the emulated kernels and the `dp_p` δ pass (the logical tiles are built from it)."""
    return _EMU_CONFIG_FP32_D128 if ops_fp32 and head_dim >= 128 else _EMU_CONFIG


def _prune(configs, named_args, **meta):
    """Emulated numerics use one fixed physical tile (the logical tiles are built from it). At D = 128, tiles larger
    than 128x64 need 8 warps (with 4 they spill heavily); with 8, 128x128 is the fastest forward tile on an H200
    (+7-9% over 128x64: results/kernel-variants/dq-atomic-h200-ad6a0aa.json)."""
    def arg(name):
        return meta.get(name, named_args.get(name))

    if arg("EMU"):
        return [_emu_config(arg("OPS_FP32"), arg("HEAD_DIM"))]
    big_d = arg("HEAD_DIM") >= 128
    return [c for c in configs
            if not (big_d and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 128 * 64 and c.num_warps < 8)] or configs


def _tuned(kernel, configs, restore=(), extra_key=()):
    if INTERPRET:
        return None
    # the statistics kernel adds counts with atomics, on the eager path into the caller's running totals:
    # autotuning's trial runs must leave them as they found them
    return triton.autotune(configs, key=["T", "HEAD_DIM", "CAUSAL", "EMU", "OPS_FP32", *extra_key],
                           prune_configs_by={"early_config_prune": _prune}, restore_value=list(restore))(kernel)


def _either_load(configs):
    """Each tile twice: streamed tiles through pointers (cp.async) and by TMA, for the autotuner to choose."""
    return [triton.Config({**c.kwargs, "TMA": tma}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in configs for tma in (False, True)]


_fwd = _tuned(kernels._attn_fwd, _FWD_CONFIGS, restore=("STAT_COUNTS",), extra_key=("STAB", "STATS"))
_dkdv = _tuned(kernels._attn_bwd_dkdv, _DKDV_CONFIGS)
_dq = _tuned(kernels._attn_bwd_dq, _DQ_CONFIGS)
# At D >= 128 the native kernels autotune the load path too (on an H200 TMA gained 2-5% on 8-warp tiles and lost 2%
# on 64x64/4 warps; at D = 64 it lost 1-10% everywhere, so it is not tried there: results/kernel-variants/)
_fwd_either = _tuned(kernels._attn_fwd, _either_load(_FWD_CONFIGS), restore=("STAT_COUNTS",),
                     extra_key=("STAB", "STATS"))
_dkdv_either = _tuned(kernels._attn_bwd_dkdv, _either_load(_DKDV_CONFIGS))
_dq_either = _tuned(kernels._attn_bwd_dq, _either_load(_DQ_CONFIGS))
TMA_MIN_HEAD_DIM = 128
AUTOTUNE_TMA = os.environ.get("STABLEFLASH_TMA", "1") != "0"
"""STABLEFLASH_TMA=0: pointer loads everywhere (to compare, or to rule TMA out when something looks wrong)."""


HOPPER_FORWARD = os.environ.get("STABLEFLASH_GLUON", "1") != "0"
"""STABLEFLASH_GLUON=0: the Triton forward on Hopper too (to compare, or to rule the Gluon forward out)."""


def _address(t: torch.Tensor) -> int:
    if is_fake(t):  # while torch.compile traces: storages start 16-byte aligned
        return t.storage_offset() * t.element_size()
    return t.data_ptr()


def tma_streamable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can stream these (B, H, T, D) tensors' rows: one descriptor per head needs its base address and
    row stride 16-byte aligned (a model's heads are; a slice at an odd offset is not)."""
    return all(_address(t) % 16 == 0 and t.stride(3) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:3])
               for t in tensors)


def _scratch(size: int, alignment: int, stream):
    # torch's caching allocator hands out 512-byte aligned blocks, above the 128 bytes descriptors ask
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def ensure_scratch_allocator():
    """TMA descriptors made in the kernel need global scratch from `triton.set_allocator`, a per-thread setting
    (autograd runs the backward on its own thread); set ours where none is set (inductor sets its own)."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def trailing_constexprs(plain, num_args: int, meta: dict, config: triton.Config) -> tuple:
    """The values of `plain`'s parameters after its first `num_args`, in order, as the compiled kernel's launcher
    takes them: from `meta`, the tile, or the parameter's default. A KeyError names a parameter left without one."""
    values = {p.name: p.default for p in plain.params if p.has_default}
    values.update(meta)
    values.update(config.all_kwargs())
    return tuple(values[name] for name in plain.arg_names[num_args:])


def _pick_key(tuned, plain, args, meta: dict) -> PickKey | None:
    """The launch's key in `TILE_PICKS` (None for a launch that is not autotuned, or traced with a symbolic T)."""
    T = args[plain.arg_names.index("T")]
    if tuned is None or not isinstance(T, int):
        return None
    candidates = "either" if tuned in (_fwd_either, _dkdv_either, _dq_either) else "pointers"
    return TILE_PICKS.key(plain.__name__, candidates, T, args[0].dtype, meta)


def _picked(tuned, plain, args, meta: dict) -> tuple[PickKey | None, triton.Config | None]:
    """The launch's key in `TILE_PICKS` and the pick held for it (None where there is none)."""
    key = _pick_key(tuned, plain, args, meta)
    return key, (TILE_PICKS.get(key) if key is not None else None)


def pin_tiles(state: list[dict]) -> None:
    """Launch the tiles of `state` (a `TILE_PICKS.state_dict()`, e.g. a checkpoint's) instead of autotuning; the
    launches this process has cached are forgotten so that the next ones take them."""
    TILE_PICKS.load_state_dict(state)
    _launches.cache.clear()
    _eager_plans.clear()


class _Launches:
    """Launches a kernel with as little host work as possible once its tile is known.

    Triton's `Autotuner.run` and `JITFunction.run` bind and specialise all ~50 arguments (most of them
    rounding codes) on every call: ~0.2 ms of Python per launch, so a forward+backward at T = 1024 spent
    more time on the host than on the GPU (measured on an H200: docs/kernel-notes.md). The first call for
    each (kernel, device, compile-time arguments, integer arguments, pointer alignments, dtypes) goes through
    Triton (autotuning once); later calls reuse the compiled kernel and its tile and call its launcher
    directly, the way Triton's own `CompiledKernel.__getitem__` does. Every launch is also shown to `replay.note`
    (kept while an eager call is being planned).
    """

    def __init__(self):
        self.cache: dict[tuple, tuple] = {}

    def __call__(self, tuned, plain, grid, args, meta, config=None):
        if INTERPRET:
            cfg = config or (_emu_config(meta["OPS_FP32"], meta["HEAD_DIM"]) if meta["EMU"] else _cfg(64, 64, 4, 2))
            plain[grid(cfg.kwargs)](*args, **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            return
        # what the compiled kernel depends on: integers exactly, tensors by dtype and 16-byte alignment (exact type
        # tests: the arguments are tensors, ints and floats, and `isinstance` twice per argument cost more)
        key = (plain, config, torch.cuda.current_device(), tuple(meta.values()),
               *[a if type(a) is int else (a.dtype, a.data_ptr() % 16 == 0) for a in args if type(a) is not float])
        hit = self.cache.get(key)
        if hit is None:
            pick_key = None
            if config is None:
                pick_key, config = _picked(tuned, plain, args, meta)
            if config is None:
                compiled = tuned[grid](*args, **meta)
                config = tuned.best_config
                if pick_key is not None:
                    TILE_PICKS.record(pick_key, config)
            else:
                compiled = plain[grid(config.kwargs)](*args, **meta, **config.kwargs, num_warps=config.num_warps,
                                                      num_stages=config.num_stages)
            constexprs = trailing_constexprs(plain, len(args), meta, config)
            self.cache[key] = (compiled, config.kwargs, constexprs)
            replay.note(compiled, grid(config.kwargs), args, constexprs)
            return
        compiled, tile, constexprs = hit
        g = grid(tile)
        stream = torch.cuda.current_stream().cuda_stream
        enter, exit_ = replay.launch_hooks()
        metadata = compiled.launch_metadata(g, stream, *args, *constexprs) if enter is not None else None
        compiled.run(g[0], g[1] if len(g) > 1 else 1, 1, stream, compiled.function, compiled.packed_metadata, metadata,
                     enter, exit_, *args, *constexprs)
        replay.note(compiled, g, args, constexprs)


_launches = _Launches()


def _launch(tuned, plain, grid, *args, config=None, **meta):
    """Autotuned launch on a GPU (cached, see `_Launches`), or with the tile `config`; under the interpreter a
    64x64 tile unless `config` says otherwise."""
    _launches(tuned, plain, grid, args, meta, config)


def _traced_launch(tuned, plain, grid, *args, config=None, **meta):
    """`_launch` through `wrap_triton`: under torch.compile the kernel becomes a node of the graph (inductor
    autotunes it over the same candidate tiles and launches it itself, unless `TILE_PICKS` holds a pick for it:
    then that tile, fixed); eagerly, a plain Triton launch."""
    if config is None:
        _, config = _picked(tuned, plain, args, meta)
    if config is None:
        wrap_triton(tuned)[grid](*args, **meta)
    else:
        wrap_triton(plain)[grid(config.kwargs)](*args, **meta, **config.kwargs, num_warps=config.num_warps,
                                                num_stages=config.num_stages)


def _ceil_div(a: int, b: int) -> int:
    """Grid sizes on the host: `triton.cdiv` is a constexpr function in Triton 3.6, ~8 µs a call from Python."""
    return -(-a // b)


def _strides(t):
    return t.stride()[:3]  # one call: the launches' strides are a visible part of their host time


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


_FWD_CODES = ("R_QK", "R_SCORES", "R_ROW_MAX", "R_SUB", "R_PBAR", "R_PBAR_OP", "R_TILE_SUM", "R_PV", "R_RESCALE",
              "R_L1", "R_L2", "R_ROW_SUM", "R_A1", "R_A2", "R_ACC", "R_L_SAVED", "R_DIV", "R_LSE",
              "R_LSE_ADD")
_BWD_CODES = ("R_QK", "R_SCORES", "R_P_SUB", "R_P", "R_DP", "R_DS1", "R_DS2", "R_DS", "R_DS_OP")


@functools.cache
def _meta(key: str):
    """Compile-time arguments of each kernel for one spec, built once (launches are latency-bound at small sizes).

    δ: the `dp_p` formula needs every key of a row (its own pass, `delta`); otherwise the dQ kernel computes
    rowsum(dO * O) for its rows (`delta` is None)."""
    spec = _SPECS[key]
    codes = dict(spec.codes)
    # SFA's native forward runs 2-6% faster with the grid's axes swapped, the plain one up to 3% slower (on an
    # H200: results/kernel-variants-h200-*.json)
    fwd = dict(EMU=spec.emu, OPS_FP32=spec.ops_fp32, SAVE_OS=spec.save_fp32_o, STAB=spec.stab,
               HEADS_FIRST=spec.stab == 1 and not spec.emu,
               BETA=spec.beta, LOW=spec.low, HIGH=spec.high, BOUNDED=spec.bounded, CLAMP_CEIL=spec.clamp_ceiling,
               TILE_CLAMP=spec.tile_clamp, **{n: codes[n] for n in _FWD_CODES},
               TMA=False)  # pointer loads unless the launch lets the autotuner choose (`_tma_candidate`)
    bwd = dict(EMU=spec.emu, OPS_FP32=spec.ops_fp32, **{n: codes[n] for n in _BWD_CODES}, TMA=False)
    delta = None
    if spec.delta_dpp:
        delta = dict(EMU=spec.emu, OPS_FP32=spec.ops_fp32,
                     **{n: codes[n] for n in ("R_QK", "R_SCORES", "R_P_SUB", "R_P", "R_DP", "R_DPP", "R_TERMS", "R_DELTA")})
        dq = dict(DELTA_HERE=False, R_TERMS=0, R_DELTA=0, R_DQ_PART=codes["R_DQ_PART"], R_DQ=codes["R_DQ"])
    else:
        dq = dict(DELTA_HERE=True, R_TERMS=codes["R_TERMS"], R_DELTA=codes["R_DELTA"],
                  R_DQ_PART=codes["R_DQ_PART"], R_DQ=codes["R_DQ"])
    dkdv = dict(R_P_OP=codes["R_P_OP"], **{n: codes[n] for n in ("R_DV_PART", "R_DV", "R_DK_PART", "R_DK")})
    return spec, fwd, delta, bwd, dkdv, dq


def _tma_candidate(spec: KernelSpec, head_dim: int) -> bool:
    """Whether the autotuner also tries TMA loads: native kernels on a GPU, head dims where TMA was measured faster."""
    return AUTOTUNE_TMA and not (INTERPRET or spec.emu) and head_dim >= TMA_MIN_HEAD_DIM


def _choose_load_path(meta: dict, spec: KernelSpec, head_dim: int, pinned: bool, *streamed: torch.Tensor) -> bool:
    """Whether the autotuner chooses between pointer and TMA loads for this launch (not when the tiles or the
    switches are `pinned` by the caller): then `meta` (the launch's own copy) loses TMA, which the tile carries.
    Sets the scratch allocator wherever TMA may run."""
    either = not pinned and _tma_candidate(spec, head_dim) and tma_streamable(*streamed)
    if either:
        meta.pop("TMA")
    if either or meta["TMA"]:
        ensure_scratch_allocator()
    return either


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def hopper_forward_tile(spec: KernelSpec, head_dim: int, stats: bool, seq_len: int) -> hopper.Tile | None:
    """The Gluon forward's tile for these numerics and length (`hopper.FORWARD_TILES`), or None for the Triton
    forward: the Gluon kernel runs production FA2 numerics, plain or SFA, with or without the statistics."""
    if hopper is None or spec.emu or spec.save_fp32_o or spec.stab not in (0, 1):
        return None
    choice = hopper.FORWARD_TILES.get((head_dim, spec.stab == 1 or stats))
    return choice.tile if choice is not None and seq_len >= choice.min_seq_len else None


def _hopper_tile(spec: KernelSpec, q, k, v, stats: bool, pinned: bool) -> hopper.Tile | None:
    """`hopper_forward_tile` where this launch can take it: on sm_90, with TMA-streamable rows, where the caller pins
    no tile or study switch."""
    if not HOPPER_FORWARD or INTERPRET or pinned or not q.is_cuda:
        return None
    tile = hopper_forward_tile(spec, q.shape[-1], stats, q.shape[-2])
    if tile is None or spec.out_dtype != q.dtype or not _is_hopper(q.device.index) or not tma_streamable(q, k, v):
        return None
    return tile


@functools.cache
def _hopper_constants(key: str, head_dim: int, dtype: torch.dtype, causal: bool, tile, stats: bool):
    """The Gluon forward's compile-time arguments and launch config for one spec (built once: layouts included)."""
    spec = _SPECS[key]
    constants = hopper.constants(head_dim, dtype, causal, tile, stab=spec.stab, beta=spec.beta, low=spec.low,
                                 high=spec.high, bounded=spec.bounded, stats=stats)
    return constants, triton.Config({}, num_warps=tile.warps)


def empty_in_layout_of(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty (B, H, T, D) tensor in `t`'s memory order: (B, T, H, D) when `t` is a model's heads viewed out of
    its (B, T, H·D) activations (the model's transpose back is then free, as with SDPA), else contiguous."""
    B, H, T, D = t.shape
    if t.stride(1) < t.stride(2):
        return t.new_empty(B, T, H, D, dtype=dtype).transpose(1, 2)
    return t.new_empty(B, H, T, D, dtype=dtype)


def forward(q, k, v, causal: bool, scale: float, key: str, stats: bool, stats_eps: float, tile=None, launch=_launch,
            stat_targets=None, **variants):
    """Returns (out, o_saved (empty unless saved separately), lse (B,H,T) fp32, counts (H,3) int64, max (H,) fp32).

    lse is in base-2 units for the native kernels and natural units under emulation: only the backward reads it.
    With `stats`, per head: rows with a repeated maximum, P̄ = 1 entries and rows seen, and the largest score, added
    to `stat_targets` = (counts, max) where given (`AttentionStats.kernel_targets`: the running totals themselves),
    else to fresh zeros and -inf; without `stats` both are empty. `variants`: the forward kernel's study switches (`TMA`;
    benchmarks/kernel_switches.py), with a fixed `tile`. Without either, on sm_90 the Gluon forward runs where
    `_hopper_tile` has a tile (traced, as the opaque op: inductor launches only Triton kernels); elsewhere, at
    D >= 128, the autotuner also chooses between pointer and TMA loads (`_tma_candidate`).
    """
    spec, meta, *_ = _meta(key)
    meta = {**meta, **variants}
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    B, H, T, D = q.shape
    pinned = tile is not None or bool(variants)
    hopper_tile = _hopper_tile(spec, q, k, v, stats, pinned) if launch in (_launch, _traced_launch) else None
    if hopper_tile is not None and launch is _traced_launch:
        # under torch.compile the Gluon forward runs as the opaque op, a node of the graph of its own (it decides
        # again when it runs); the backward stays traced
        return flash_fwd(q, k, v, causal, scale, key, stats, stats_eps)
    either = hopper_tile is None and _choose_load_path(meta, spec, D, pinned, k, v)
    out = empty_in_layout_of(q, spec.out_dtype)
    o_saved = empty_in_layout_of(q, torch.float32) if spec.save_fp32_o else out.new_empty(0)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    if stats and stat_targets is not None:
        counts, smax = stat_targets
    elif stats:
        counts, smax = fresh_stat_targets(H, q.device)
    else:
        counts = torch.empty(0, dtype=torch.int64, device=q.device)
        smax = torch.empty(0, dtype=torch.float32, device=q.device)
    units = 1.0 if spec.emu else LOG2E
    eps_u = spec.eps if spec.stab == 1 else stats_eps * units
    if hopper_tile is not None:
        ensure_scratch_allocator()  # device-side descriptors
        constants, config = _hopper_constants(key, D, q.dtype, causal, hopper_tile, stats)
        launch(None, hopper._attn_fwd_hopper, lambda _: hopper.grid(B * H, T, hopper_tile), q, k, v, out, lse, counts,
               smax, *_strides(q), *_strides(k), *_strides(v), *_strides(out), H, T, scale * units, eps_u,
               **constants, config=config)
        return out, o_saved, lse, counts, smax

    def grid(m):  # (heads, query tiles) for SFA's native kernel (see `_meta`), else (query tiles, heads)
        tiles = _ceil_div(T, m["BLOCK_M"])
        return (B * H, tiles) if meta["HEADS_FIRST"] else (tiles, B * H)

    tuned = _fwd_either if either else _fwd
    launch(tuned, kernels._attn_fwd, grid, q, k, v, out, o_saved if spec.save_fp32_o else out, lse, counts, smax,
           *_strides(q), *_strides(k), *_strides(v), *_strides(out), H, T, scale * units, eps_u, spec.logical_n,
           **meta, CAUSAL=causal, HEAD_DIM=D, STATS=stats, config=tile)
    return out, o_saved, lse, counts, smax


def backward(dout, q, k, v, o_saved, lse, causal: bool, scale: float, key: str, tiles=(None, None), launch=_launch,
             **variants):
    """dQ, dK, dV (each in its input's memory order); `tiles` = (dK/dV config, dQ config) forces the tiles
    instead of autotuning (benchmarks). `variants`: the dQ and dK/dV kernels' study switches (`TMA`;
    benchmarks/kernel_switches.py). Without either, at D >= 128 the autotuner also chooses the load path."""
    spec, _, delta_meta, meta, dkdv_meta, dq_meta = _meta(key)
    meta = {**meta, **variants}
    q, k, v, dout, o_saved = (_last_dim_contiguous(t) for t in (q, k, v, dout, o_saved))
    B, H, T, D = q.shape
    either = _choose_load_path(meta, spec, D, any(t is not None for t in tiles) or bool(variants), q, k, v, dout)
    units = 1.0 if spec.emu else LOG2E
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout))
    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    if delta_meta is not None:
        launch(None, kernels._attn_bwd_delta_dpp, lambda m: (_ceil_div(T, m["BLOCK_M"]), B * H),
               q, k, v, dout, lse, delta, *strides, H, T, scale * units, spec.logical_n, HEAD_DIM=D, CAUSAL=causal,
               **delta_meta, config=_emu_config(spec.ops_fp32, D))
    dq = empty_in_layout_of(q, q.dtype)
    dk = empty_in_layout_of(k, k.dtype)
    dv = empty_in_layout_of(k, v.dtype)  # dK's strides: the kernel writes both through one set
    # dQ first: it writes δ (unless the dp_p pass did) for the dK/dV kernel
    launch(_dq_either if either else _dq, kernels._attn_bwd_dq, lambda m: (_ceil_div(T, m["BLOCK_M"]), B * H),
           q, k, v, dout, o_saved, lse, delta, dq, *strides, *_strides(o_saved), *_strides(dq), H, T,
           scale * units, scale, spec.logical_n, HEAD_DIM=D, CAUSAL=causal, **meta, **dq_meta, config=tiles[1])
    launch(_dkdv_either if either else _dkdv, kernels._attn_bwd_dkdv, lambda m: (_ceil_div(T, m["BLOCK_N"]), B * H),
           q, k, v, dout, lse, delta, dk, dv, *strides, *_strides(dk), H, T, scale * units, scale, spec.logical_m,
           HEAD_DIM=D, CAUSAL=causal, **meta, **dkdv_meta, config=tiles[0])
    return dq, dk, dv


def fresh_stat_targets(num_heads: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed counters (H, 3) int64 and maxima (H,) at -inf for the forward kernel's statistics to add to."""
    return (torch.zeros(num_heads, 3, dtype=torch.int64, device=device),
            torch.full((num_heads,), float("-inf"), dtype=torch.float32, device=device))


_eager_plans = replay.EagerPlans(ensure_scratch_allocator, enabled=os.environ.get("STABLEFLASH_REPLAY", "1") != "0")
"""STABLEFLASH_REPLAY=0: every eager call runs the launchers (`replay`; to compare, or to rule replay out)."""


class FlashAttention(torch.autograd.Function):
    """Eager path: the same launchers without the custom-op dispatch (cheaper per call), each call after the first
    of its signature replayed from a plan (`replay`); with `stats`, the kernel adds its counts to `stat_targets` in
    place (no output, no kernel after it)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, key, stats, stats_eps, stat_targets):
        if stats and stat_targets is None:  # zeroed here, not by `forward`: a plan allocates, it does not fill
            stat_targets = fresh_stat_targets(q.shape[1], q.device)
        output = _eager_plans(lambda: forward(q, k, v, causal, scale, key, stats, stats_eps, stat_targets=stat_targets),
                              ("fwd", key, causal, scale, stats, stats_eps, HOPPER_FORWARD, AUTOTUNE_TMA),
                              (q, k, v, *(stat_targets or ())))
        _setup_context(ctx, (q, k, v, causal, scale, key, stats, stats_eps), output)
        return output[0]

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, o_saved, lse = ctx.saved_tensors
        dq, dk, dv = _eager_plans(lambda: backward(dout, q, k, v, o_saved, lse, ctx.causal, ctx.scale, ctx.key),
                                  ("bwd", ctx.key, ctx.causal, ctx.scale, AUTOTUNE_TMA), (dout, q, k, v, o_saved, lse))
        return dq, dk, dv, None, None, None, None, None, None


# -- torch.library ops ------------------------------------------------------------------------------

TRACEABLE = True
"""Under torch.compile on a GPU, use the `triton_op` pair (inductor launches the kernels); False: the opaque pair."""

_FwdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_BwdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("stableflash::flash_fwd", mutates_args=())
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, key: str,
              stats: bool, stats_eps: float) -> _FwdOutputs:
    return forward(q, k, v, causal, scale, key, stats, stats_eps)


@flash_fwd.register_fake
def _(q, k, v, causal, scale, key, stats, stats_eps):
    spec = _SPECS[key]
    B, H, T, _ = q.shape
    out = empty_in_layout_of(q, spec.out_dtype)
    o_saved = empty_in_layout_of(q, torch.float32) if spec.save_fp32_o else q.new_empty(0)
    return (out, o_saved, q.new_empty(B, H, T, dtype=torch.float32), q.new_empty(H, 3, dtype=torch.int64),
            q.new_empty(H, dtype=torch.float32))


@torch.library.custom_op("stableflash::flash_bwd", mutates_args=())
def flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_saved: torch.Tensor,
              lse: torch.Tensor, causal: bool, scale: float, key: str) -> _BwdOutputs:
    return backward(dout, q, k, v, o_saved, lse, causal, scale, key)


@flash_bwd.register_fake
def _(dout, q, k, v, o_saved, lse, causal, scale, key):
    return empty_in_layout_of(q, q.dtype), empty_in_layout_of(k, k.dtype), empty_in_layout_of(k, v.dtype)


def _setup_context(ctx, inputs, output):
    """What the backward needs (shared by the custom op's autograd and `FlashAttention`)."""
    q, k, v, causal, scale, key, _, _ = inputs
    out, o_saved, lse, _, _ = output
    ctx.save_for_backward(q, k, v, o_saved if o_saved.numel() else out, lse)
    ctx.causal, ctx.scale, ctx.key = causal, scale, key


def _backward(ctx, dout, *_):
    q, k, v, o_saved, lse = ctx.saved_tensors
    dq, dk, dv = flash_bwd(dout, q, k, v, o_saved, lse, ctx.causal, ctx.scale, ctx.key)
    return dq, dk, dv, None, None, None, None, None


flash_fwd.register_autograd(_backward, setup_context=_setup_context)


# triton_op: the function is also the fake implementation (it only allocates and launches), and under
# torch.compile it is traced into, so inductor sees each `wrap_triton` launch
@triton_op("stableflash::flash_fwd_traced", mutates_args=())
def flash_fwd_traced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, key: str,
                     stats: bool, stats_eps: float) -> _FwdOutputs:
    return forward(q, k, v, causal, scale, key, stats, stats_eps, launch=_traced_launch)


@triton_op("stableflash::flash_bwd_traced", mutates_args=())
def flash_bwd_traced(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_saved: torch.Tensor,
                     lse: torch.Tensor, causal: bool, scale: float, key: str) -> _BwdOutputs:
    return backward(dout, q, k, v, o_saved, lse, causal, scale, key, launch=_traced_launch)


def _backward_traced(ctx, dout, *_):
    q, k, v, o_saved, lse = ctx.saved_tensors
    dq, dk, dv = flash_bwd_traced(dout, q, k, v, o_saved, lse, ctx.causal, ctx.scale, ctx.key)
    return dq, dk, dv, None, None, None, None, None


flash_fwd_traced.register_autograd(_backward_traced, setup_context=_setup_context)


def compiled_forward_op():
    """The forward op for traced (torch.compile) code: the `triton_op` on a GPU, the opaque op under the
    interpreter (there inductor cannot launch kernels) or when `TRACEABLE` is off."""
    return flash_fwd_traced if TRACEABLE and not INTERPRET else flash_fwd
