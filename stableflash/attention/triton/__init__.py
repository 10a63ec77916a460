"""Fused Triton flash attention: the `backend="triton"` of `flash_attention`.

Layout:
- `spec.py`: what a `Precision` and stabilizer make the kernels compile (the one registry of specialisations);
- `native.py`: production FA2 numerics, the fast path; `hopper.py`: its forward in Gluon on sm_90;
- `emulation.py`: every rounding site of any supported policy, bit-equal to the reference;
- `decoding.py`: a few queries against a long key/value cache, split along the keys (flash-decoding);
- `common.py`: helpers both share; `tuning.py`: autotuning and the tile picks; `options.py`: the user's switches;
- `launch.py`: allocation and launches (`kernel[grid](...)`); `ops.py`: the two `torch.library` ops.

Public here: `attention`, `supports`, `supports_policy`, `supports_masks`, `supports_softcap`, `decode_attention`,
`supports_decode`, `pick_tiles`, the tile picks' `tile_picks_state_dict` / `load_tile_picks` (what a checkpoint
keeps), and `KernelOptions` / `kernel_options` / `set_kernel_options`.
"""

from __future__ import annotations

import torch

from stableflash.attention import stabilize as stab_module
from stableflash.attention.precision import Precision, resolve
from stableflash.attention.reference import split_heads
from stableflash.attention.stats import AttentionStats
from stableflash.attention.triton.options import KernelOptions, current, kernel_options, set_kernel_options
from stableflash.attention.triton.spec import (
    HEAD_DIMS,
    INPUT_DTYPES,
    kernel_head_dim,
    spec_name,
    spec_named,
    unsupported_reason,
)

__all__ = ["attention", "supports", "supports_policy", "supports_masks", "supports_softcap", "decode_attention",
           "supports_decode", "pick_tiles", "tile_picks_state_dict", "load_tile_picks", "HEAD_DIMS", "kernel_head_dim",
           "KernelOptions", "kernel_options", "set_kernel_options"]


def supports(q: torch.Tensor) -> bool:
    """Whether the kernels take inputs shaped and typed like `q`: head dims up to 256 (those between `HEAD_DIMS`
    padded to the next inside the kernels), fp16 or bf16."""
    return kernel_head_dim(q.shape[-1]) is not None and q.dtype in INPUT_DTYPES


def supports_policy(policy: Precision, stabilize, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernels run `policy` (and, with a head override, the other heads' policy) with `stabilize`."""
    return unsupported_reason(policy, stabilize, dtype) is None


def supports_softcap(policy: Precision, stabilize, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels cap scores (softcap) for this call: production FA2 numerics (the native kernels)."""
    width = kernel_head_dim(head_dim)
    if not (width is not None and dtype in INPUT_DTYPES and policy.head_override is None
            and supports_policy(policy, stabilize, dtype)):
        return False
    return spec_named(spec_name(policy, stabilize, dtype, width, 1)).native


def supports_masks(policy: Precision, stabilize, dtype: torch.dtype, head_dim: int, packed: bool = False) -> bool:
    """Whether the kernels run Tk != Tq, windows and key padding under `policy` (any policy they run, without a
    per-head override), and with `packed` a packed batch of sequences in one call (production FA2 numerics only:
    the reference has no packed form to be bit-equal to, so emulated policies take one call per sequence)."""
    width = kernel_head_dim(head_dim)
    if not (width is not None and dtype in INPUT_DTYPES and policy.head_override is None
            and supports_policy(policy, stabilize, dtype)):
        return False
    return not packed or spec_named(spec_name(policy, stabilize, dtype, width, 1)).native


def supports_decode(policy: Precision, stabilize, dtype: torch.dtype, head_dim: int, rows: int) -> bool:
    """Whether decoding calls take `decode_attention`: the `decode_kernel` option on, production FA2 numerics without
    a stabilizer or a per-head override, fp16/bf16, head dims up to 256, and at most `decoding.MAX_ROWS` query rows
    per key/value head (`rows`: the group's heads times the queries)."""
    from stableflash.attention.triton.decoding import MAX_ROWS
    if not (current().decode_kernel and dtype in INPUT_DTYPES and head_dim <= 256 and rows <= MAX_ROWS
            and stabilize is None and policy.head_override is None and supports_policy(policy, None, dtype)):
        return False
    return spec_named(spec_name(policy, None, dtype, 64, 1)).native


def decode_attention(q, k_cache, v_cache, *, seen, first=None, cache_rows=None, longest: int | None = None,
                     block_table=None, scale: float, window: tuple[int, int] = (-1, -1), causal: bool = False,
                     softcap: float = 0.0, splits: int = 0):
    """Queries q (B, TQ, H, D) against a key/value cache, forward only (`decoding.py`): sequence b sees cache
    positions first[b]..seen[b] - 1 of cache row cache_rows[b] ((B_cache, Tmax, H_kv, D) caches), or of its pages
    through `block_table` (B, pages) of (num_pages, page_size, H_kv, D) caches; its queries sit at the last TQ
    positions (causal and `window` aligned to the bottom right). `seen` one int (`first`, `cache_rows` None): each
    sequence sees that many positions of its own row. `longest`: at least max(seen - first), which sizes the splits
    (default: read back from the GPU); `splits`: how many splits of a sequence's keys run as programs of their own
    (0: enough for two programs per SM; at most one per key tile). Returns (out (B, TQ, H, D), lse (B, H, TQ) fp32,
    natural log; a query that sees no key: 0 and -inf)."""
    from stableflash.attention.triton import decoding

    left, right = window
    if causal:
        right = 0 if right < 0 else min(0, right)
    if q.shape[2] % k_cache.shape[2]:
        raise ValueError(f"k_cache: {k_cache.shape[2]} key/value heads do not divide q's {q.shape[2]} heads")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache, v_cache: expected q's dtype {q.dtype}, got {k_cache.dtype} and {v_cache.dtype}")
    if not isinstance(seen, int) and (first is None or cache_rows is None):
        raise ValueError("first, cache_rows: pass both with per-sequence `seen` (or `seen` as one int)")
    if isinstance(seen, int):
        longest = seen
    elif longest is None:
        longest = int((seen - first).max()) if len(seen) else 0
    if not (isinstance(splits, int) and splits >= 0):
        raise ValueError(f"splits: expected an int >= 0 (0: chosen), got {splits!r}")
    return decoding.decode(q, k_cache, v_cache, seen, first, cache_rows, longest, block_table, scale, (left, right),
                           softcap, splits)


def tile_picks_state_dict() -> list[dict]:
    """The autotuner's picks so far, as plain data: what a checkpoint keeps so that a resumed run launches the same
    tiles (another tile sums in another order)."""
    from stableflash.attention.triton.tuning import TILE_PICKS
    return TILE_PICKS.state_dict()


def load_tile_picks(state: list[dict]) -> int:
    """Launch the tiles of `state` (a `tile_picks_state_dict()`) instead of autotuning; returns how many picks were
    left out as not this version's kernels'."""
    from stableflash.attention.triton.tuning import TILE_PICKS
    return TILE_PICKS.load_state_dict(state)


def pick_tiles(shape: tuple[int, int, int, int], *, precision="fa2", stabilize=None, dtype=torch.bfloat16,
               device="cuda") -> int:
    """Autotune the kernels eagerly for causal attention of `shape` (B, H, T, D) under `precision` and `stabilize`:
    the forward with and without statistics, and the backward, on random inputs laid out as a model's heads
    ((B, T, H, D) in memory). Every later launch takes these picks, a torch.compile'd one as a fixed tile. Shapes
    and policies the kernels do not run are left alone. The global RNG is left untouched. Returns how many picks
    are held."""
    from stableflash.attention.triton.tuning import TILE_PICKS

    B, H, T, D = shape
    if kernel_head_dim(D) is None or not supports_policy(resolve(precision), stabilize, dtype):
        return len(TILE_PICKS)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, dtype=dtype, device=device, generator=generator).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    eps = stabilize.eps if isinstance(stabilize, stab_module.SFA) else AttentionStats(H).eps
    for stats in (None, AttentionStats(H, eps=eps)):
        out = attention(q, k, v, causal=True, scale=D**-0.5, policy=resolve(precision), stabilize=stabilize,
                        stats=stats)
        out.float().sum().backward()
    return len(TILE_PICKS)


def attention(q, k, v, *, causal: bool, scale: float, policy: Precision, stabilize=None,
              stats: AttentionStats | None = None, window: tuple[int, int] = (-1, -1),
              key_padding: torch.Tensor | None = None, segments: torch.Tensor | None = None,
              softcap: float = 0.0, return_lse: bool = False):
    """Fused attention; a per-head policy override runs each group of heads through its own kernel. Tk != Tq, a
    window, key padding and packed sequences (`segments`: `launch.packed_segments`, q, k, v one batch row of the
    packed sequences) run the kernels' masked form (`supports_masks`). With `return_lse`, (O, lse (B, H, Tq) fp32
    natural log, not differentiable)."""
    from stableflash.attention.triton import launch

    band = launch.band_of(q, k, causal, window, key_padding, segments)
    # checked eagerly; compiled calls come through `flash_attention`, which checks by the policy's key
    if band is not None and not torch.compiler.is_compiling() and not supports_masks(
            policy, stabilize, q.dtype, q.shape[-1], packed=band.packed):
        raise ValueError("backend: 'triton' runs Tk != Tq, windows and key padding only without a per-head policy "
                         "override, and packed sequences only under production FA2 numerics (precision 'fa2'); "
                         "use backend='reference' or 'auto'")
    if softcap > 0 and not torch.compiler.is_compiling() and not supports_softcap(policy, stabilize, q.dtype,
                                                                                   q.shape[-1]):
        raise ValueError("softcap: the 'triton' backend caps scores only under production FA2 numerics without a "
                         "per-head policy override; use backend='reference' or 'auto'")
    if kernel_head_dim(q.shape[-1]) is None:
        raise ValueError(f"q: the triton backend takes head dims up to {HEAD_DIMS[-1]}, got {q.shape[-1]}")
    return split_heads(q, k, v, policy, lambda q, k, v, pol, heads: _attention(
        q, k, v, causal=causal, scale=scale, policy=pol, stabilize=stabilize, stats=stats, heads=heads, band=band,
        softcap=float(softcap), return_lse=return_lse))


def _attention(q, k, v, *, causal, scale, policy, stabilize, stats, heads, band, softcap, return_lse):
    from stableflash.attention.triton import ops
    if stats is not None and isinstance(stabilize, stab_module.SFA) and stabilize.eps != stats.eps:
        raise ValueError(f"stats: the triton backend counts near-maxima with SFA's eps ({stabilize.eps}); "
                         f"build AttentionStats with eps={stabilize.eps}")
    _, H, T, D = q.shape
    # at the kernels' head dim: they pad a narrower one inside themselves
    name = spec_name(policy, stabilize, q.dtype, kernel_head_dim(D), max(T, k.shape[-2]))  # untiled: one tile of each
    call = ops.Call(causal, float(scale), float(stats.eps) if stats is not None else None,
                    None if band is None else (band.left, band.right, band.packed), softcap)
    out, _, lse, counts, smax = ops.flash_fwd(q, k, v, None if band is None else band.keep, name, call.encode())
    if stats is not None:
        stats.add_counts(heads, counts, smax)
    if not return_lse:
        return out
    return out, lse.detach() / spec_named(name).units  # the kernels' units (base 2 natively): natural
