"""The host side of the fused kernels: allocate the outputs, choose the kernel and its tile, launch.

Every launch is Triton's own `kernel[grid](...)`, from the two `torch.library` ops of `ops.py`; nothing here caches
launches or replays Triton's launcher. Host time per call at small shapes is left to what PyTorch offers for it:
CUDA graphs (`torch.cuda.graphs`, `torch.compile(mode="reduce-overhead")`).

A native kernel's tile is the one `tuning.TILE_PICKS` holds for the launch, else the autotuner's pick, recorded there
(another tile sums in another order: a resumed run must launch the tiles it launched before).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from stableflash.attention.stats import STAT_COLUMNS
from stableflash.attention.triton import emulation, native, options
from stableflash.attention.triton.spec import INTERPRET, KernelSpec, kernel_head_dim, native_scales, spec_named
from stableflash.attention.triton.tuning import (
    DELTA_CONFIG,
    INTERPRETER_CONFIG,
    NATIVE_DKDV,
    NATIVE_DQ,
    NATIVE_FWD,
    TILE_PICKS,
    TMA_MIN_HEAD_DIM,
    WIDE_HEAD_DIM,
    Tunable,
    emulation_config,
)
from stableflash.numerics.rounding import draw_seed

try:  # Gluon, Triton's lower-level language (3.5 and later): the native forward on Hopper
    from stableflash.attention.triton import hopper
except ImportError:
    hopper = None


# -- launching ---------------------------------------------------------------------------------------------------------

def _launch(kernel, grid, args: tuple, meta: dict, config: triton.Config) -> None:
    """`kernel` on `grid(tile)` with runtime `args`, compile-time `meta` and a fixed tile."""
    kernel[grid(config.kwargs)](*args, **meta, **config.kwargs, num_warps=config.num_warps,
                                num_stages=config.num_stages)


def _launch_tuned(tunable: Tunable, grid, args: tuple, meta: dict, *, T: int, dtype, either: bool) -> None:
    """A native kernel with its picked tile, or autotuned (over TMA loads too when `either`) and the pick recorded;
    with `KernelOptions.autotune` off, its first candidate tile."""
    if INTERPRET:
        _launch(tunable.kernel, grid, args, {**meta, "TMA": False}, INTERPRETER_CONFIG)
        return
    tunable = tunable.at(meta["HEAD_DIM"])
    key = TILE_PICKS.key(tunable.name, "either" if either else "pointers", T, dtype, meta)
    picked = TILE_PICKS.get(key)
    if picked is not None:
        _launch(tunable.kernel, grid, args, meta, picked)
        return
    if not options.current().autotune:  # untuned and unrecorded: a later tuned launch still picks for itself
        _launch(tunable.kernel, grid, args, meta, tunable.first)
        return
    tuner = tunable.either if either else tunable.pointers
    tuner[grid](*args, **meta)
    TILE_PICKS.record(key, tuner.best_config)


def _scratch(size: int, alignment: int, stream):
    # torch's caching allocator hands out 512-byte aligned blocks, above the 128 bytes descriptors ask
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def _allow_device_descriptors() -> None:
    """TMA descriptors made in a kernel need global scratch from `triton.set_allocator`, a per-thread setting
    (autograd runs the backward on a thread of its own)."""
    triton.set_allocator(_scratch)


# -- memory -----------------------------------------------------------------------------------------------------------

def tma_streamable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can stream these (B, H, T, D) tensors' rows: one descriptor per head needs its base address and
    row stride 16-byte aligned (a model's heads are; a slice at an odd offset is not)."""
    return all(t.data_ptr() % 16 == 0 and t.stride(3) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:3])
               for t in tensors)


def empty_in_layout_of(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty (B, H, T, D) tensor in `t`'s memory order: (B, T, H, D) when `t` is a model's heads viewed out of
    its (B, T, H·D) activations (the model's transpose back is then free, as with SDPA), else contiguous."""
    B, H, T, D = t.shape
    if t.stride(1) < t.stride(2):
        return t.new_empty(B, T, H, D, dtype=dtype).transpose(1, 2)
    return t.new_empty(B, H, T, D, dtype=dtype)


def fresh_stat_targets(num_heads: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed counters (H, 5) int64 (`stats.STAT_COLUMNS`) and maxima (H,) at -inf for the forward's statistics."""
    return (torch.zeros(num_heads, len(STAT_COLUMNS), dtype=torch.int64, device=device),
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
        keep = keep.to(torch.uint8).contiguous()
    return Band(left, right, keep)


def _band_args(band: Band | None, T: int, TK: int, placeholder: torch.Tensor) -> tuple:
    """The kernels' `band` argument, (KEEP, stride_keep, TK, LEFT, RIGHT); a call without a band passes a placeholder
    pointer."""
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


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _strides(t) -> tuple[int, int, int]:
    """A kernel's `x_strides` argument: (batch, head, position) of a (B, H, T, D) tensor."""
    return t.stride()[:3]


def last_dim_contiguous(t):
    """t, or a contiguous copy where its last dim is strided: every kernel addresses the head dim as contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _tma_candidates(spec: KernelSpec, head_dim: int, *streamed: torch.Tensor) -> bool:
    """Whether the autotuner also tries TMA loads: native kernels on a GPU, at head dims where TMA measured faster."""
    return (spec.native and not INTERPRET and options.current().tma and TMA_MIN_HEAD_DIM <= head_dim < WIDE_HEAD_DIM
            and tma_streamable(*streamed))


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def hopper_forward_tile(spec: KernelSpec, q, k, v, stats: bool, softcap: float = 0.0):
    """The Gluon forward's tile for this call (`hopper.FORWARD_TILES`), or None for the Triton forward: on sm_90,
    production FA2 numerics, plain or SFA, with or without the statistics, no softcap, TMA-streamable rows."""
    if (hopper is None or INTERPRET or not spec.native or not options.current().hopper_forward or not q.is_cuda
            or softcap > 0):
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


def _head_dims(q, *others) -> tuple[int, dict]:
    """The kernels' head dim for q's, and the switches that pad q's inside the kernels where it is narrower (`D_IN`:
    columns past it read as 0 and are not stored; `STRIDE8`: every row stride is a multiple of 8 though some is not
    of 16, the only divisibility Triton's own specialisation proves (`common.row_strides`): those of q and `others`,
    the caller's tensors, and the outputs', laid out from the head dim). Absent otherwise, so the picks keep their
    keys."""
    d_in = q.shape[-1]
    width = kernel_head_dim(d_in)
    if width == d_in:
        return width, {}
    strides = [s for t in (q, *others) for s in t.stride()[:3]] + [d_in]
    stride8 = all(s % 8 == 0 for s in strides) and any(s % 16 for s in strides)
    return width, {"D_IN": d_in, **({"STRIDE8": True} if stride8 else {})}


def _check_softcap(softcap: float, spec: KernelSpec) -> None:
    if softcap > 0 and not spec.native:
        raise ValueError(f"softcap: the fused kernels cap scores only under production FA2 numerics, not {spec.name!r}")


def _scales(scale: float, softcap: float) -> tuple[float, float, dict]:
    """The native kernels' (scale, softcap) arguments (`spec.native_scales`) and switch: absent without a cap, so
    the plain kernels' tile picks keep their keys."""
    return (*native_scales(scale, softcap), {"SOFTCAP": True} if softcap > 0 else {})


# -- forward and backward ---------------------------------------------------------------------------------------------

def forward(q, k, v, causal: bool, scale: float, name: str, stats: bool, stats_eps: float, band: Band | None = None,
            softcap: float = 0.0):
    """Returns (out, o_saved (empty unless saved separately), lse (B,H,T) fp32, counts (H,5) int64, max (H,) fp32).

    lse is in the kernels' units (base 2 natively, natural under emulation): only the backward reads it. With
    `stats`, per head the counters of `STAT_COLUMNS` and the largest score; without, both are empty. A `band`
    (`band_of`: Tk != Tq, a window, key padding, packed sequences) runs the kernels' masked form; packed sequences only
    native specs'. `softcap` > 0 caps the scores (native specs only)."""
    spec = spec_named(name)
    _check_band(band, spec)
    _check_softcap(softcap, spec)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    B, H, T, _ = q.shape
    D, padded = _head_dims(q, k, v)
    out = empty_in_layout_of(q, spec.out_dtype)
    o_saved = empty_in_layout_of(q, torch.float32) if spec.save_fp32_o else q.new_empty(0, dtype=out.dtype)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    if stats:
        counts, smax = fresh_stat_targets(H, q.device)
    else:
        counts, smax = q.new_empty(0, dtype=torch.int64), q.new_empty(0, dtype=torch.float32)
    eps = spec.eps if spec.stab == 1 else stats_eps * spec.units
    G = H // k.shape[1]  # query heads per key/value head (grouped-query attention)
    tensors = (q, k, v, out, lse, counts, smax, _strides(q), _strides(k), _strides(v), _strides(out))
    launch = dict(HEAD_DIM=D, CAUSAL=causal, STATS=stats, **padded)

    if not spec.native:
        seed = draw_seed() if spec.stochastic else 0  # where the reference draws it: the same bits
        args = (*tensors[:4], o_saved if spec.save_fp32_o else out, *tensors[4:], H, G, T, scale * spec.units, eps,
                spec.logical_n, seed, _band_args(band, T, k.shape[-2], lse), spec.logical_m)
        _launch(emulation._attn_fwd, lambda m: (_ceil_div(T, m["BLOCK_M"]), B * H), args,
                {**spec.forward_constants, **launch, **_band_meta(band, native=False)},
                emulation_config(spec.ops_fp32, D))
        return out, o_saved, lse, counts, smax

    # the Gluon forward: no mask, no padded head dim
    tile = hopper_forward_tile(spec, q, k, v, stats, softcap) if band is None and not padded else None
    if tile is not None:
        _allow_device_descriptors()
        constants, config = _hopper_constants(name, D, q.dtype, causal, tile, stats)
        _launch(hopper._attn_fwd, lambda _: hopper.grid(B * H, T, tile), (*tensors, H, G, T, scale * spec.units, eps),
                constants, config)
        return out, o_saved, lse, counts, smax

    kernel_scale, kernel_softcap, capped = _scales(scale, softcap)
    meta = {**spec.forward_constants, **launch, **_band_meta(band), **capped}
    either = _tma_candidates(spec, D, k, v) and not padded
    if either:
        _allow_device_descriptors()

    def grid(m):  # (heads, query tiles) for SFA's native kernel (see `KernelSpec.forward_constants`)
        tiles = _ceil_div(T, m["BLOCK_M"])
        return (B * H, tiles) if meta["HEADS_FIRST"] else (tiles, B * H)

    _launch_tuned(NATIVE_FWD, grid, (*tensors, H, G, T, kernel_scale, eps, _band_args(band, T, k.shape[-2], lse),
                                     kernel_softcap), meta, T=T, dtype=q.dtype, either=either)
    return out, o_saved, lse, counts, smax


def backward(dout, q, k, v, o_saved, lse, causal: bool, scale: float, name: str, band: Band | None = None,
             softcap: float = 0.0, atomic_dq: bool = False, group_sum: bool = True):
    """dQ, dK, dV, each in its input's memory order. `o_saved` is the O that δ = rowsum(dO ∘ O) reads. With
    `atomic_dq` (`KernelOptions.atomic_dq` when the forward ran) the native dK/dV kernel adds dQ with atomics.

    With grouped-query attention (k and v with H / G heads) the native dK/dV kernel sums each group's query heads
    in its programs (`GROUP`, with `group_sum`: `KernelOptions.group_sum_in_program` when the forward ran);
    otherwise, and under emulation, it writes one query head's share per program into (B, H, Tk, D) buffers, summed
    over each group here (flash-attn 2's order, and the reference's: each head's rounded share)."""
    spec = spec_named(name)
    _check_band(band, spec)
    _check_softcap(softcap, spec)
    q, k, v, dout, o_saved = (last_dim_contiguous(t) for t in (q, k, v, dout, o_saved))
    B, H, T, D_IN = q.shape
    D, padded = _head_dims(q, k, v, dout, o_saved)
    G, TK = H // k.shape[1], k.shape[-2]
    strides = (_strides(q), _strides(k), _strides(v), _strides(dout))
    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    dq = empty_in_layout_of(q, q.dtype)
    shares = G > 1 and not (spec.native and group_sum)
    if shares:  # one query head's share each, in the input dtype (flash-attn 2's order), summed over the group below
        dk, dv = (torch.empty(B, H, TK, D_IN, dtype=t.dtype, device=t.device) for t in (k, v))
    else:
        dk = empty_in_layout_of(k, k.dtype)
        dv = empty_in_layout_of(k, v.dtype)  # dK's strides: the kernel writes both through one set
    # dQ first: it writes δ (unless the dp_p pass did) for the dK/dV kernel
    dq_args = (q, k, v, dout, o_saved, lse, delta, dq, *strides, _strides(o_saved), _strides(dq), H, G, T)
    dkdv_args = (q, k, v, dout, lse, delta, dk, dv, *strides, _strides(dk), H, G, T)
    atomic_dq = spec.native and atomic_dq
    dq_acc = torch.zeros(B, H, T, D, dtype=torch.float32, device=q.device) if atomic_dq else \
        torch.empty(0, dtype=torch.float32, device=q.device)  # what the dK/dV programs add dQ / scale into
    masking = _band_args(band, T, TK, lse)
    launch = {"HEAD_DIM": D, "CAUSAL": causal, **_band_meta(band, spec.native), **padded}

    def rows(m):
        return _ceil_div(T, m["BLOCK_M"]), B * H

    in_program = G > 1 and not shares  # one program per key/value head (`GROUP`), else per query head

    def cols(m):  # grouped: (heads, key tiles), each head's heaviest causal key tiles first
        tiles = _ceil_div(TK, m["BLOCK_N"])
        return (B * H // G, tiles) if in_program else (tiles, B * H)

    if spec.native:
        either = _tma_candidates(spec, D, q, k, v, dout) and not padded
        if either:
            _allow_device_descriptors()
        grouped = {"GROUP": G} if in_program else {}  # absent otherwise: MHA's picks keep their keys
        kernel_scale, kernel_softcap, capped = _scales(scale, softcap)
        scales = (kernel_scale, scale)  # the scores' (`_scales`), and dQ's and dK's natural one
        if atomic_dq:  # δ alone; dQ comes from the dK/dV programs
            _launch(native._attn_bwd_delta, rows, (o_saved, dout, delta, _strides(o_saved), _strides(dout), H, T),
                    {"HEAD_DIM": D, **padded}, DELTA_CONFIG)
        else:
            _launch_tuned(NATIVE_DQ, rows, (*dq_args, *scales, masking, kernel_softcap), {**launch, **capped}, T=T,
                          dtype=q.dtype, either=either)
        native_dkdv = (*dkdv_args[:8], dq_acc, *dkdv_args[8:])
        atomic = {"ATOMIC_DQ": True} if atomic_dq else {}  # absent when off: the picks keep their keys
        _launch_tuned(NATIVE_DKDV, cols, (*native_dkdv, *scales, masking, kernel_softcap),
                      {**launch, **grouped, **capped, **atomic}, T=T, dtype=q.dtype, either=either)
        if atomic_dq:  # scaled and cast in one pass over the fp32 sums (as the default's fp32 dQ * scale, then cast)
            torch.mul(dq_acc[..., :D_IN], scale, out=dq)
    else:
        config = emulation_config(spec.ops_fp32, D)
        if spec.delta_constants is not None:
            _launch(emulation._attn_bwd_delta_dpp, rows,
                    (q, k, v, dout, lse, delta, *strides, H, G, T, scale, spec.logical_n, masking),
                    {**spec.delta_constants, **launch}, config)
        seed = draw_seed() if spec.backward_stochastic else 0  # where the reference's backward draws its own
        scales = (scale * spec.units, scale)
        _launch(emulation._attn_bwd_dq, rows, (*dq_args, *scales, spec.logical_n, seed, masking),
                {**spec.dq_constants, **launch}, config)
        _launch(emulation._attn_bwd_dkdv, cols, (*dkdv_args, *scales, spec.logical_m, masking),
                {**spec.dkdv_constants, **launch}, config)
    if shares:
        dk, dv = (torch.sum(t.unflatten(1, (H // G, G)), dim=2, out=empty_in_layout_of(k, t.dtype)) for t in (dk, dv))
    return dq, dk, dv
