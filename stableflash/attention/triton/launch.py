"""The host side of the fused kernels: allocate the outputs, choose the kernel and its tile, launch.

`forward` and `backward` serve every caller: the eager `autograd.Function` and the `torch.library` ops (`ops.py`).
With `traced=True` (inside a `triton_op` under torch.compile) each launch goes through `wrap_triton`, so that inductor
sees the kernel and launches it from its own code; eagerly, the first launch of a specialisation goes through Triton
and later ones through the compiled kernel (`compiled.py`). Both take the tile from `tuning.TILE_PICKS` where a pick
is held, else autotune (eagerly: once, and record the pick). An eager call whose signature was seen before skips the
deciding: it launches the bound launches its `Plan` holds with its own arguments.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from torch.library import wrap_triton

from stableflash.attention.triton import emulation, options
from stableflash.attention.triton.compiled import COMPILED, BoundLaunch, current_stream
from stableflash.attention.triton.spec import INTERPRET, KernelSpec, spec_named
from stableflash.attention.triton.tuning import (
    INTERPRETER_CONFIG,
    NATIVE_DKDV,
    NATIVE_DQ,
    NATIVE_FWD,
    TILE_PICKS,
    TMA_MIN_HEAD_DIM,
    Tunable,
    emulation_config,
)
from stableflash.numerics.rounding import draw_seed

try:  # Gluon, Triton's lower-level language (3.5 and later): the native forward on Hopper
    from stableflash.attention.triton import hopper
except ImportError:
    hopper = None


# -- launching ---------------------------------------------------------------------------------------------------------

def _run(kernel, grid, args, meta: dict, config: triton.Config, traced: bool) -> BoundLaunch | None:
    """Launch `kernel` with a fixed tile: traced, through `wrap_triton`; eagerly on a GPU, through the compiled
    kernel once Triton has compiled it (`compiled.py`), returning that launch bound to it."""
    if traced or INTERPRET:
        launcher = wrap_triton(kernel) if traced else kernel
        meta = _with_defaults(kernel, len(args), meta, config.kwargs) if traced else meta
        launcher[grid(config.kwargs)](*args, **meta, **config.kwargs, num_warps=config.num_warps,
                                      num_stages=config.num_stages)
        return None
    return COMPILED.launch(kernel, grid, args, meta, config)


def _with_defaults(kernel, num_args: int, meta: dict, tiled) -> dict:
    """`meta` with the defaults of the kernel's compile-time parameters it leaves out (but the tile's, `tiled`):
    `wrap_triton` hands inductor exactly the arguments given, where `kernel[grid]` fills in the defaults."""
    defaults = {p.name: p.default for p in kernel.params[num_args:]
                if p.has_default and p.name not in meta and p.name not in tiled}
    return {**defaults, **meta}


def pick_key(tunable: Tunable, T, dtype, meta: dict, either: bool):
    """The launch's key in `TILE_PICKS`; None for a traced launch with a symbolic T (inductor autotunes it)."""
    if not isinstance(T, int):
        return None
    return TILE_PICKS.key(tunable.kernel.__name__, "either" if either else "pointers", T, dtype, meta)


def _run_tuned(tunable: Tunable, grid, args, meta: dict, *, T, dtype, either: bool, traced: bool) -> BoundLaunch | None:
    """Launch a native kernel with its picked tile (returning the bound launch, as `_run`), or autotune it (over TMA
    loads too when `either`)."""
    if INTERPRET:
        return _run(tunable.kernel, grid, args, {**meta, "TMA": False}, INTERPRETER_CONFIG, traced)
    key = pick_key(tunable, T, dtype, meta, either)
    picked = TILE_PICKS.get(key) if key is not None else None
    if picked is not None:
        return _run(tunable.kernel, grid, args, meta, picked, traced)
    tuner = tunable.either if either else tunable.pointers
    if traced:
        tiled = {name for c in tuner.configs for name in c.kwargs}
        wrap_triton(tuner)[grid](*args, **_with_defaults(tunable.kernel, len(args), meta, tiled))
        return None
    tuner[grid](*args, **meta)
    if key is not None:
        TILE_PICKS.record(key, tuner.best_config)
    return None


def _scratch(size: int, alignment: int, stream):
    # torch's caching allocator hands out 512-byte aligned blocks, above the 128 bytes descriptors ask
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def _allow_device_descriptors() -> None:
    """TMA descriptors made in a kernel need global scratch from `triton.set_allocator`, a per-thread setting
    (autograd runs the backward on a thread of its own). Set wherever TMA may run, traced too: a traced op also
    runs eagerly (e.g. under `torch.library.opcheck`)."""
    triton.set_allocator(_scratch)


# -- plans ------------------------------------------------------------------------------------------------------------

class Plan(NamedTuple):
    """What an eager call decided: its branch (which kernels, which arguments) and its launches bound to compiled
    kernels, in order; `scratch` where one makes TMA descriptors (Triton's allocator must be set on the thread)."""
    branch: str
    launches: tuple[BoundLaunch, ...]
    scratch: bool


class Plans:
    """Eager calls' decisions by signature. At (16, 12, 1024, 64) a forward+backward is ~0.39 ms of GPU work, and
    deciding it afresh (the spec's kernels, the Gluon and TMA choices, the tile pick, the compiled kernel's lookup)
    cost more host time than that (results/kernel-library/). The signature holds everything the decision reads: the
    spec, causal, statistics, the options, the tile picks' version, and every caller-given tensor's shape, strides,
    dtype, device and 16-byte alignment (the outputs are allocated from these). A call whose decision made no bound
    launch (an autotuning or first compiling call) leaves no plan: the next one decides again."""

    MAX_PLANS = 1024  # a run with ever new shapes would otherwise keep one per shape

    def __init__(self):
        self._plans: dict[tuple, Plan] = {}

    def key(self, static: tuple, tensors: tuple) -> tuple:
        return (static, options.current(), TILE_PICKS.version,
                *[(t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors])

    def get(self, key: tuple) -> Plan | None:
        return self._plans.get(key)

    def keep(self, key: tuple, branch: str, launches: list, scratch: bool) -> None:
        if all(launch is not None for launch in launches):
            if len(self._plans) >= self.MAX_PLANS:
                self._plans.clear()
            self._plans[key] = Plan(branch, tuple(launches), scratch)

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


PLANS = Plans()


def _launch_planned(plan: Plan, launch_args: tuple) -> None:
    if plan.scratch:
        _allow_device_descriptors()
    stream = current_stream()
    for launch, args in zip(plan.launches, launch_args, strict=True):
        launch(args, stream)


# -- memory -----------------------------------------------------------------------------------------------------------

def _address(t: torch.Tensor) -> int:
    try:
        return t.data_ptr()
    except RuntimeError:  # a fake tensor, while torch.compile traces: storages start 16-byte aligned
        return t.storage_offset() * t.element_size()


def tma_streamable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can stream these (B, H, T, D) tensors' rows: one descriptor per head needs its base address and
    row stride 16-byte aligned (a model's heads are; a slice at an odd offset is not)."""
    return all(_address(t) % 16 == 0 and t.stride(3) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:3])
               for t in tensors)


def empty_in_layout_of(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty (B, H, T, D) tensor in `t`'s memory order: (B, T, H, D) when `t` is a model's heads viewed out of
    its (B, T, H·D) activations (the model's transpose back is then free, as with SDPA), else contiguous."""
    B, H, T, D = t.shape
    if t.stride(1) < t.stride(2):
        return t.new_empty(B, T, H, D, dtype=dtype).transpose(1, 2)
    return t.new_empty(B, H, T, D, dtype=dtype)


def fresh_stat_targets(num_heads: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed counters (H, 3) int64 and maxima (H,) at -inf for the forward kernel's statistics to add to."""
    return (torch.zeros(num_heads, 3, dtype=torch.int64, device=device),
            torch.full((num_heads,), float("-inf"), dtype=torch.float32, device=device))


class Band(NamedTuple):
    """A masked call's visibility as the kernels take it (`native.py`, `MASK`): the band's bounds on the distance
    d = j - (i + Tk - Tq) (per sequence in a packed batch; -1: unbounded; causal folded into `right`), and `keep`: the
    key-padding bytes (B, Tk), or with `packed` the table of a packed batch's sequences (`packed_segments`)."""
    left: int
    right: int
    keep: torch.Tensor | None
    packed: bool = False


def packed_segments(q_offsets: list[int], k_offsets: list[int], device) -> torch.Tensor:
    """The (4, Tq + Tk) int32 table of a packed batch (`common.py`) whose sequence s holds queries
    q_offsets[s]:q_offsets[s+1] and keys k_offsets[s]:k_offsets[s+1]: for each query, then each key, its sequence,
    the other side's first position and end in that sequence, and the sequence's shift (keys' end - queries' end)."""
    qo, ko = torch.tensor(q_offsets), torch.tensor(k_offsets)
    sequences = torch.arange(len(q_offsets) - 1)
    shift = ko[1:] - qo[1:]
    q_seq, k_seq = (torch.repeat_interleave(sequences, o.diff()) for o in (qo, ko))
    queries = torch.stack([q_seq, ko[:-1][q_seq], ko[1:][q_seq], shift[q_seq]])
    keys = torch.stack([k_seq, qo[:-1][k_seq], qo[1:][k_seq], shift[k_seq]])
    return torch.cat([queries, keys], dim=1).to(device=device, dtype=torch.int32).contiguous()


def band_of(q, k, causal: bool, window: tuple[int, int], keep: torch.Tensor | None,
            segments: torch.Tensor | None = None) -> Band | None:
    """The band of a call with Tk != Tq, a window, key padding or packed sequences (`segments`, from
    `packed_segments`: then q, k and v hold one batch row of them) by `mask.Visibility`'s rule; None for the plain
    (square, causal or not) call the kernels run without a mask."""
    if k.shape[-2] == q.shape[-2] and tuple(window) == (-1, -1) and keep is None and segments is None:
        return None
    left, right = window
    if causal:
        right = 0 if right < 0 else min(0, right)
    if segments is not None:
        return Band(left, right, segments, packed=True)
    if keep is not None:
        keep = keep.to(torch.uint8).contiguous()  # a cast, not a view: inductor cannot lower bool viewed as bytes
    return Band(left, right, keep)


def _band_args(band: Band | None, T: int, TK: int, placeholder: torch.Tensor) -> tuple:
    """The kernels' (KEEP, stride_keep, TK, LEFT, RIGHT); a call without a band passes a placeholder pointer."""
    if band is None:
        return placeholder, 0, T, -1, -1
    if band.keep is None:
        return placeholder, 0, TK, band.left, band.right
    return band.keep, band.keep.stride(0), TK, band.left, band.right  # packed: the table's row stride


def _band_meta(band: Band | None, native: bool = True) -> dict:
    """The masked form's compile-time switches (absent without a band: the plain kernels' picks keep their keys);
    the emulation kernels take no packed sequences (`SEG`)."""
    if band is None:
        return {}
    meta = {"CAUSAL": False, "MASK": True, "PAD": band.keep is not None}
    return {**meta, "SEG": band.packed} if native else meta


def _check_band(band: Band | None, spec: KernelSpec) -> None:
    if band is not None and band.packed and not spec.native:
        raise ValueError(f"the fused kernels run packed sequences only under production FA2 numerics, not {spec.name!r}")


def _plan_key(traced: bool, static: tuple, band: Band | None, *tensors) -> tuple | None:
    """The call's key in `PLANS` (None where no plan is kept: traced, or under the interpreter): `static`, the
    band's bounds and form, the caller's tensors and the band's own."""
    if traced or INTERPRET:
        return None
    if band is None:
        return PLANS.key((*static, None), tensors)
    caller = tensors if band.keep is None else (*tensors, band.keep)
    return PLANS.key((*static, band.left, band.right, band.packed), caller)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _strides(t):
    return t.stride()[:3]


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _tma_candidates(spec: KernelSpec, head_dim: int, *streamed: torch.Tensor) -> bool:
    """Whether the autotuner also tries TMA loads: native kernels on a GPU, at head dims where TMA measured faster."""
    return (spec.native and not INTERPRET and options.current().tma and head_dim >= TMA_MIN_HEAD_DIM
            and tma_streamable(*streamed))


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def hopper_forward_tile(spec: KernelSpec, q, k, v, stats: bool):
    """The Gluon forward's tile for this call (`hopper.FORWARD_TILES`), or None for the Triton forward: on sm_90,
    production FA2 numerics, plain or SFA, with or without the statistics, TMA-streamable rows."""
    if hopper is None or INTERPRET or not spec.native or not options.current().hopper_forward or not q.is_cuda:
        return None
    choice = hopper.FORWARD_TILES.get((q.shape[-1], spec.stab == 1 or stats))
    if choice is None or q.shape[-2] < choice.min_seq_len or spec.stab == 2 or spec.out_dtype != q.dtype:
        return None
    if not _is_hopper(q.device.index) or not tma_streamable(q, k, v):
        return None
    return choice.tile


@functools.cache
def _hopper_constants(name: str, head_dim: int, dtype: torch.dtype, causal: bool, tile, stats: bool):
    """The Gluon forward's compile-time arguments and launch config for one spec (built once: layouts included)."""
    spec = spec_named(name)
    constants = hopper.constants(head_dim, dtype, causal, tile, stab=spec.stab, beta=spec.beta, low=spec.low,
                                 high=spec.high, bounded=spec.bounded, stats=stats)
    return constants, triton.Config({}, num_warps=tile.warps)


# -- forward and backward ---------------------------------------------------------------------------------------------

def _forward_branch(spec: KernelSpec, q, k, v, stats: bool, traced: bool):
    """Which forward runs: ("emulation", None), ("hopper", its tile) or ("native", None)."""
    if not spec.native:
        return "emulation", None
    tile = None if traced else hopper_forward_tile(spec, q, k, v, stats)  # traced: `ops` runs it as an opaque op
    return ("hopper", tile) if tile is not None else ("native", None)


@functools.cache
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def forward(q, k, v, causal: bool, scale: float, name: str, stats: bool, stats_eps: float, stat_targets=None,
            traced: bool = False, band: Band | None = None, shared_empties: bool = False):
    """Returns (out, o_saved (empty unless saved separately), lse (B,H,T) fp32, counts (H,3) int64, max (H,) fp32).

    With `shared_empties` the empty ones are placeholders made once per device and dtype, not fresh tensors: for the
    eager Function, which hands out only `out` (an allocation costs the host ~7 µs, a planned call ~0.1 ms in all).

    lse is in the kernels' units (base 2 natively, natural under emulation): only the backward reads it. With
    `stats`, per head: rows with a repeated maximum, P̄ = 1 entries and rows seen, and the largest score, added to
    `stat_targets` = (counts, max) where given (`AttentionStats.kernel_targets`: the running totals themselves),
    else to fresh zeros and -inf; without `stats` both are empty. A `band` (`band_of`: Tk != Tq, a window, key
    padding, packed sequences) runs the kernels' masked form; packed sequences only native specs'."""
    spec = spec_named(name)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    B, H, T, D = q.shape
    out = empty_in_layout_of(q, spec.out_dtype)
    empty = _placeholder if shared_empties else (lambda device, dtype: torch.empty(0, dtype=dtype, device=device))
    o_saved = empty_in_layout_of(q, torch.float32) if spec.save_fp32_o else empty(q.device, out.dtype)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    if stats:
        counts, smax = stat_targets if stat_targets is not None else fresh_stat_targets(H, q.device)
    else:
        counts, smax = empty(q.device, torch.int64), empty(q.device, torch.float32)
    eps = spec.eps if spec.stab == 1 else stats_eps * spec.units
    G = H // k.shape[1]  # query heads per key/value head (grouped-query attention)
    tensors = (q, k, v, out, lse, counts, smax, *_strides(q), *_strides(k), *_strides(v), *_strides(out))
    _check_band(band, spec)
    key = _plan_key(traced, ("forward", name, causal, stats), band, q, k, v, counts, smax)
    plan = PLANS.get(key) if key is not None else None
    if plan is not None:
        branch, tile = plan.branch, None
    elif band is not None:  # the Gluon forward takes no mask
        branch, tile = ("native" if spec.native else "emulation"), None
    else:
        branch, tile = _forward_branch(spec, q, k, v, stats, traced)
    if branch == "emulation":
        seed = draw_seed() if spec.stochastic else 0  # where the reference draws it: the same bits
        args = (*tensors[:4], o_saved if spec.save_fp32_o else out, *tensors[4:], H, G, T, scale * spec.units, eps,
                spec.logical_n, seed, *_band_args(band, T, k.shape[-2], lse), spec.logical_m)
    elif branch == "hopper":
        args = (*tensors, H, G, T, scale * spec.units, eps)
    else:
        args = (*tensors, H, G, T, scale * spec.units, eps, *_band_args(band, T, k.shape[-2], lse))
    if plan is not None:
        _launch_planned(plan, (args,))
        return out, o_saved, lse, counts, smax

    launch = dict(HEAD_DIM=D, CAUSAL=causal, STATS=stats)
    if branch == "emulation":
        scratch = False
        bound = _run(emulation.attn_fwd, lambda m: (_ceil_div(T, m["BLOCK_M"]), B * H), args,
                     {**spec.forward_constants, **launch, **_band_meta(band, native=False)},
                     emulation_config(spec.ops_fp32, D), traced)
    elif branch == "hopper":
        scratch = True
        _allow_device_descriptors()
        constants, config = _hopper_constants(name, D, q.dtype, causal, tile, stats)
        bound = _run(hopper.attn_fwd, lambda _: hopper.grid(B * H, T, tile), args, constants, config, traced)
    else:
        meta = {**spec.forward_constants, **launch, **_band_meta(band)}
        scratch = _tma_candidates(spec, D, k, v)
        if scratch:
            _allow_device_descriptors()

        def grid(m):  # (heads, query tiles) for SFA's native kernel (see `KernelSpec.forward_constants`)
            tiles = _ceil_div(T, m["BLOCK_M"])
            return (B * H, tiles) if meta["HEADS_FIRST"] else (tiles, B * H)

        bound = _run_tuned(NATIVE_FWD, grid, args, meta, T=T, dtype=q.dtype, either=scratch, traced=traced)
    if key is not None:
        PLANS.keep(key, branch, [bound], scratch)
    return out, o_saved, lse, counts, smax


def backward(dout, q, k, v, o_saved, lse, causal: bool, scale: float, name: str, traced: bool = False,
             band: Band | None = None):
    """dQ, dK, dV, each in its input's memory order. `o_saved` is the O that δ = rowsum(dO ∘ O) reads.

    With grouped-query attention (k and v with H / G heads) the native dK/dV kernel sums each group's query heads
    in its programs (`GROUP`, with `KernelOptions.group_sum_in_program`); otherwise, and under emulation, it writes
    one query head's share per program into (B, H, Tk, D) buffers, summed over each group here (flash-attn 2's
    order, and the reference's: each head's rounded share)."""
    spec = spec_named(name)
    _check_band(band, spec)
    q, k, v, dout, o_saved = (_last_dim_contiguous(t) for t in (q, k, v, dout, o_saved))
    B, H, T, D = q.shape
    G, TK = H // k.shape[1], k.shape[-2]
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout))
    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    dq = empty_in_layout_of(q, q.dtype)
    shares = G > 1 and not (spec.native and options.current().group_sum_in_program)
    if shares:  # one query head's share each, in the input dtype (flash-attn 2's order), summed over the group below
        dk, dv = (torch.empty(B, H, TK, D, dtype=t.dtype, device=t.device) for t in (k, v))
    else:
        dk = empty_in_layout_of(k, k.dtype)
        dv = empty_in_layout_of(k, v.dtype)  # dK's strides: the kernel writes both through one set
    # dQ first: it writes δ (unless the dp_p pass did) for the dK/dV kernel
    dq_args = (q, k, v, dout, o_saved, lse, delta, dq, *strides, *_strides(o_saved), *_strides(dq), H, G, T,
               scale * spec.units, scale)
    dkdv_args = (q, k, v, dout, lse, delta, dk, dv, *strides, *_strides(dk), H, G, T, scale * spec.units, scale)
    masking = _band_args(band, T, TK, lse)
    if spec.native:
        launch_args = ((*dq_args, *masking), (*dkdv_args, *masking))
    else:
        delta_pass = () if spec.delta_constants is None else (
            (q, k, v, dout, lse, delta, *strides, H, G, T, scale, spec.logical_n, *masking),)
        seed = draw_seed() if spec.backward_stochastic else 0  # where the reference's backward draws its own
        launch_args = (*delta_pass, (*dq_args, spec.logical_n, seed, *masking),
                       (*dkdv_args, spec.logical_m, *masking))
    key = _plan_key(traced, ("backward", name, causal), band, dout, q, k, v, o_saved, lse)
    plan = PLANS.get(key) if key is not None else None
    if plan is not None:
        _launch_planned(plan, launch_args)
    else:
        launch = {"HEAD_DIM": D, "CAUSAL": causal, **_band_meta(band, spec.native)}

        def rows(m):
            return _ceil_div(T, m["BLOCK_M"]), B * H

        in_program = G > 1 and not shares  # one program per key/value head (`GROUP`), else per query head

        def cols(m):  # grouped: (heads, key tiles), each head's heaviest causal key tiles first
            tiles = _ceil_div(TK, m["BLOCK_N"])
            return (B * H // G, tiles) if in_program else (tiles, B * H)

        if spec.native:
            scratch = _tma_candidates(spec, D, q, k, v, dout)
            if scratch:
                _allow_device_descriptors()
            grouped = {"GROUP": G} if in_program else {}  # absent otherwise: MHA's picks keep their keys
            bound = [_run_tuned(tunable, grid, args, meta, T=T, dtype=q.dtype, either=scratch, traced=traced)
                     for tunable, grid, args, meta in zip((NATIVE_DQ, NATIVE_DKDV), (rows, cols), launch_args,
                                                          (launch, {**launch, **grouped}))]
        else:
            scratch = False
            config = emulation_config(spec.ops_fp32, D)
            kernels = [(emulation.attn_bwd_dq, rows, spec.dq_constants),
                       (emulation.attn_bwd_dkdv, cols, spec.dkdv_constants)]
            if spec.delta_constants is not None:
                kernels.insert(0, (emulation.attn_bwd_delta_dpp, rows, spec.delta_constants))
            bound = [_run(kernel, grid, args, {**constants, **launch}, config, traced)
                     for (kernel, grid, constants), args in zip(kernels, launch_args, strict=True)]
        if key is not None:
            PLANS.keep(key, "native" if spec.native else "emulation", bound, scratch)
    if shares:
        dk, dv = (torch.sum(t.unflatten(1, (H // G, G)), dim=2, out=empty_in_layout_of(k, t.dtype)) for t in (dk, dv))
    return dq, dk, dv
