"""`flash_attention`: the one public attention function, and its backends."""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
import torch.nn.functional as F

from stableflash.attention import stabilize as stabilizers
from stableflash.attention.mask import ScoreMods, Visibility
from stableflash.attention.precision import Precision, resolve
from stableflash.attention.reference import reference_attention, repeat_kv
from stableflash.attention.stabilize import check_stabilize
from stableflash.attention.stats import AttentionStats, biasable_in_tile, tail_limit
from stableflash.numerics.formats import get_format

BACKENDS = ("auto", "reference", "triton", "math", "sdpa")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_TORCH_SDPA = F.scaled_dot_product_attention  # torch's own, also where `sdpa.route_sdpa` has replaced it


def _check_inputs(q, k, v):
    """q (B, H, Tq, D), k and v (B, H_kv, Tk, D) with H_kv dividing H (GQA/MQA), in the (B, H, T, D) layout."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected rank 4 (B, H, T, D), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name}: expected dtype float16, bfloat16, float32 or float64, got {t.dtype}")
    B, H, Tq, D = q.shape
    if k.shape[0] != B or k.shape[-1] != D:
        raise ValueError(f"k: expected batch {B} and head dim {D} as q's, got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} does not match k's {tuple(k.shape)}")
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"k: its {k.shape[1]} heads must divide q's {H} (grouped-query attention)")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} does not match q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: device {t.device} does not match q's {q.device}")
    if D < 1:
        raise ValueError(f"q: expected head dim D >= 1, got shape {tuple(q.shape)}")


def _check_mask_arguments(window, key_padding_mask, q, k):
    if window is not None:
        if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(isinstance(w, int) for w in window)
                and all(w >= -1 for w in window)):
            raise ValueError(f"window: expected (left, right) ints >= -1 (-1: unbounded), got {window!r}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask: expected a bool tensor (True = a real key)")
        if tuple(key_padding_mask.shape) != (q.shape[0], k.shape[-2]):
            raise ValueError(f"key_padding_mask: expected shape (B, Tk) = {(q.shape[0], k.shape[-2])}, "
                             f"got {tuple(key_padding_mask.shape)}")


def _without_queries_or_keys(q, k, v, policy: Precision, stats):
    """Attention where Tq or Tk is 0: an empty O, or O = 0 and lse = -inf (each row sees no key, as a fully masked
    row does); differentiable, with zero gradients (a softmax over no key weighs nothing). The rows count in the
    statistics, with nothing else."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    out = ((q @ k.transpose(-1, -2)).softmax(-1) @ v).to(policy.dtype("out", q.dtype))
    if stats is not None:
        stats.add(slice(None), rows=q.shape[0] * q.shape[2], repeated_max_rows=0, pbar_ones=0,
                  max_score=torch.tensor(-math.inf, device=q.device))
    return out, torch.full(q.shape[:-1], -math.inf, dtype=policy.compute_dtype(), device=q.device)


def _math_attention(q, k, v, scale, vis: Visibility, stats, mods: ScoreMods | None = None):
    """Plain softmax attention in the inputs' dtype (fully materialised scores): (O, lse (B, H, Tq) fp32)."""
    s = (q @ k.transpose(-1, -2)) * scale
    if mods is not None and mods.softcap > 0:
        s = mods.softcap * torch.tanh(s / mods.softcap)
    if mods is not None and mods.bias is not None:
        s = s + mods.bias.to(s.dtype)
    hidden = vis.hidden(0, q.shape[-2], 0, k.shape[-2], q.device)
    if hidden is not None:
        s = s.masked_fill(hidden, -math.inf)
    if stats is not None:
        rm = s.amax(-1, keepdim=True)
        repeated = (((rm - s) <= stats.eps) & torch.isfinite(s)).sum(-1) > 1
        B, H, T, _ = q.shape
        finite = torch.where(torch.isfinite(s), s, -math.inf)
        pbar = torch.exp(s - torch.where(torch.isneginf(rm), 0.0, rm))
        ones = (pbar == 1).sum(-1)
        # one tile, P̄V in the inputs' dtype
        limit = tail_limit(get_format(q.dtype).fraction_bits)
        biasable = biasable_in_tile(ones, pbar.float().sum(-1) - ones, limit)
        stats.add(slice(None), rows=B * T, repeated_max_rows=repeated.sum(dim=(0, 2)), pbar_ones=ones.sum(dim=(0, 2)),
                  max_score=finite.float().amax(dim=(0, 2, 3)),
                  repeated_max_rows_positive=(repeated & (rm.squeeze(-1) > 0)).sum(dim=(0, 2)),
                  biasable_rows=biasable.sum(dim=(0, 2)))
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s, dim=-1)
    # rows with no visible key (every score -inf) give 0, as the reference does, not NaN
    p = torch.where(torch.isneginf(s).all(-1, keepdim=True), 0.0, p)
    return p @ v, lse.detach()


def triton_installed_for(q: torch.Tensor) -> bool:
    """Whether Triton kernels can launch on q's device: CUDA, and Triton installed (looked up once, at import)."""
    return q.is_cuda and _HAS_TRITON


def triton_available(q: torch.Tensor) -> bool:
    """Whether the fused Triton kernels can run on these inputs (CUDA, Triton installed, head dim and dtype)."""
    if not triton_installed_for(q):
        return False
    from stableflash.attention import triton as triton_backend
    return triton_backend.supports(q)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    stabilize=None,
    precision: str | Precision = "fa2",
    backend: str = "auto",
    stats: AttentionStats | None = None,
    window: tuple[int, int] | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    layout: str = "bhtd",
):
    """Scaled dot-product attention with controllable numerics.

    Args:
        q, k, v: q (B, H, Tq, D), k and v (B, H_kv, Tk, D) of one floating dtype and device; H_kv dividing H is
            grouped-query (or multi-query) attention. `layout="bthd"` takes (B, T, H, D) instead, and returns it.
        causal: mask keys after each query, aligned to the bottom right when Tk != Tq (as flash-attn). Default
            True here; `stableflash.sdpa` and the flash-attn calls keep their libraries' default, False.
        window: (left, right) as flash-attn's `window_size`: query i sees keys i + Tk - Tq - left ... + right
            (-1: unbounded).
        key_padding_mask: (B, Tk) bool, True where the key is real.
        attn_mask: SDPA's mask, broadcastable to (B, H, Tq, Tk): bool (True: the query sees the key), or float,
            added to the scaled scores (-inf hides a key). Combined with `causal`, `window` and the padding.
        softcap: > 0 caps the scaled scores as softcap · tanh(S / softcap) before masks and `attn_mask`'s bias.
        scale: score scale; default 1/sqrt(D).
        stabilize: None, `SFA(beta, eps)` (stabilized flash attention), `SFA.official()` or `ClampPbar()`.
        precision: a `Precision` or a preset name: "fa2" (default, production
            FlashAttention-2 rounding), "bf16", "paper", "fp32", "fp64".
        backend: "reference" (tiled PyTorch, every rounding per `precision`),
            "triton" (fused GPU kernel), "math" (plain softmax attention in the
            inputs' dtype), "sdpa" (torch's scaled_dot_product_attention), or
            "auto": the Triton kernel where it supports the arguments; else, for a call with `attn_mask` under `fa2`
            without SFA, statistics or `return_lse`, SDPA (fast, dense masks); else the reference.
        stats: an `AttentionStats` to add this call's per-head counters to.
        return_lse: also return each row's log-sum-exp of the (modified) scores, (B, H, Tq), natural log, fp32 (fp64
            under fp64 numerics), -inf for a row that sees no key (not differentiable; "sdpa" cannot give it).

    Returns:
        O, shaped like q, in the dtype of the policy's `out` site ("math" and
        "sdpa": the inputs' dtype); with `return_lse`, (O, lse). Differentiable with respect to q, k, v.
        Rows that see no key give O = 0 and zero gradients (lse -inf): so does every row where Tk = 0, and
        Tq = 0 gives an empty O; no backend runs for those.

    GQA runs in the fused kernels too (k and v are read per group, not repeated); so do Tk != Tq, windows and key
    padding, under every policy the kernels run but a per-head override (there "auto" takes the reference and
    "triton" refuses them). `softcap` runs in the kernels under production FA2 numerics (elsewhere in the
    reference and "math"); `attn_mask` in the reference, "math" and "sdpa".
    """
    if layout not in ("bhtd", "bthd"):
        raise ValueError(f"layout: expected 'bhtd' (B, H, T, D) or 'bthd' (B, T, H, D), got {layout!r}")
    if layout == "bthd":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name}: expected a rank-4 (B, T, H, D) tensor")
        result = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                                 scale=scale, stabilize=stabilize, precision=precision, backend=backend, stats=stats,
                                 window=window, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                 softcap=softcap, return_lse=return_lse)
        return (result[0].transpose(1, 2), result[1]) if return_lse else result.transpose(1, 2)
    _check_inputs(q, k, v)
    _check_mask_arguments(window, key_padding_mask, q, k)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    policy = resolve(precision)
    stabilize = check_stabilize(stabilize)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    D = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: expected a finite number >= 0 (0: no cap), got {softcap!r}")
    dense, bias = _split_attn_mask(attn_mask, q, k)
    if stats is not None:
        if not isinstance(stats, AttentionStats):
            raise TypeError(f"stats: expected an AttentionStats, got {type(stats).__name__}")
        stats.check(q.shape[1])
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        out, lse = _without_queries_or_keys(q, k, v, policy, stats)
        return (out, lse) if return_lse else out

    shaped = dense is not None or bias is not None  # what only the reference, math and sdpa take
    capped = softcap > 0
    masked = (k.shape[-2] != q.shape[-2] or key_padding_mask is not None or dense is not None
              or (window is not None and tuple(window) != (-1, -1)))
    grouped = k.shape[1] != q.shape[1]
    # the fused kernels take grouped-query attention as such (no repeated k and v) and masks (Tk != Tq, windows, key
    # padding) in their masked form, one policy for every head
    policy_key, stabilize_key = policy.key, stabilizers.key_of(stabilize)
    kernels_take = (not shaped and not (grouped and policy.head_override is not None)
                    and (not masked or (triton_available(q)
                                        and _triton_takes(policy_key, stabilize_key, q.dtype, q.shape[-1], True)))
                    and (not capped or (triton_available(q)
                                        and _triton_caps(policy_key, stabilize_key, q.dtype, q.shape[-1]))))
    if backend == "auto":
        backend = "reference"
        if kernels_take and triton_available(q) and _triton_takes(policy_key, stabilize_key, q.dtype, q.shape[-1],
                                                                  False):
            backend = "triton"
        elif (q.is_cuda and attn_mask is not None and softcap == 0 and policy == resolve("fa2") and stabilize is None
              and stats is None and not return_lse):
            backend = "sdpa"
    if backend == "triton" and shaped:
        raise ValueError("backend: 'triton' takes no attn_mask; use backend='reference' or 'auto'")
    if backend == "triton" and not kernels_take and q.is_cuda:
        raise ValueError("backend: 'triton' runs Tk != Tq, windows, key padding and GQA only without a per-head "
                         "policy override, and softcap only under production FA2 numerics; use backend='reference' "
                         "or 'auto' (which takes the reference for them)")
    # the kernels and the reference read k and v per group (the reference sums dK, dV in the policy's formats); the
    # others, and a per-head policy (which splits the heads), take them repeated
    if grouped and (backend in ("math", "sdpa") or policy.head_override is not None):
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    # the backends other than the kernels take a masked call's mask as a description (the kernels: `band_of`)
    vis = Visibility(q.shape[-2], k.shape[-2], causal=causal, window=tuple(window or (-1, -1)),
                     key_padding=key_padding_mask, dense=dense) if masked and backend != "triton" else None
    mods = ScoreMods(float(softcap), bias) if softcap > 0 or bias is not None else None
    if backend in ("math", "sdpa"):
        if stabilize is not None:
            raise ValueError(f"stabilize: backend {backend!r} computes plain softmax; use backend='reference' or 'triton'")
        if policy != resolve("fa2"):
            raise ValueError(f"precision: backend {backend!r} has fixed numerics; use backend='reference' or 'triton'")
        vis = vis or Visibility(q.shape[-2], k.shape[-2], causal=causal)
        if backend == "math":
            out, lse = _math_attention(q, k, v, scale, vis, stats, mods)
            return (out, lse) if return_lse else out
        if stats is not None or return_lse or softcap > 0:
            raise ValueError("stats, return_lse, softcap: backend 'sdpa' gives none of them; use 'math', 'reference' "
                             "or 'triton'")
        return _sdpa(q, k, v, scale, vis, bias)
    if backend == "triton":
        if not q.is_cuda or not _HAS_TRITON:
            raise ValueError("backend: 'triton' needs CUDA tensors and the triton package; "
                             "use backend='reference' or 'auto'")
        from stableflash.attention import triton as triton_backend
        if _decodes(q, k, v, policy, stabilize, stats, key_padding_mask):
            out, lse = triton_backend.decode_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       seen=k.shape[2], scale=scale, causal=causal, softcap=softcap,
                                                       window=tuple(window or (-1, -1)))
            return (out.transpose(1, 2), lse) if return_lse else out.transpose(1, 2)
        return triton_backend.attention(q, k, v, causal=causal, scale=scale, policy=policy, stabilize=stabilize,
                                        stats=stats, window=tuple(window or (-1, -1)), key_padding=key_padding_mask,
                                        softcap=softcap, return_lse=return_lse)
    out, lse = reference_attention(q, k, v, scale=scale, causal=vis or causal, policy=policy, stabilize=stabilize,
                                   stats=stats, mods=mods)
    return (out, lse) if return_lse else out


def _split_attn_mask(attn_mask, q, k):
    """SDPA's `attn_mask` as (dense visibility, bias): a bool mask is which keys each query sees, a float one a bias
    added to the scores; each broadcast to 4 dims (B or 1, H or 1, Tq, Tk)."""
    if attn_mask is None:
        return None, None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected a tensor, got {type(attn_mask).__name__}")
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        torch.broadcast_shapes(attn_mask.shape, shape)
    except RuntimeError:
        raise ValueError(f"attn_mask: shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Tq, Tk) = "
                         f"{shape}") from None
    mask = attn_mask.to(q.device)
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dtype == torch.bool:
        return mask, None
    if not mask.is_floating_point():
        raise TypeError(f"attn_mask: expected a bool or floating tensor, got {mask.dtype}")
    return None, mask


def _aligned_for_sdpa(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where its data or a row stride is not 16-byte aligned or its last dim is strided:
    torch's cuDNN attention reads such views wrong (a bf16 view at an offset of 3 elements gave all NaN, torch 2.11
    on an H200) where its other kernels refuse them."""
    size = t.element_size()
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1]):
        return t
    return t.contiguous()


def _sdpa(q, k, v, scale, vis: Visibility, bias):
    """torch's SDPA with our masks as one dense mask (its own `is_causal` where causality is the only one). A row
    that sees no key gives O = 0 and zero gradients, as in the other backends (SDPA alone gives NaN): it is shown
    its first key, and its output replaced by 0 (so no gradient reaches that key)."""
    q, k, v = (_aligned_for_sdpa(t) for t in (q, k, v))
    only_causal = (vis.causal and vis.q_len == vis.k_len and vis.window == (-1, -1) and vis.key_padding is None
                   and vis.dense is None and bias is None)
    if only_causal or not (vis.banded or vis.key_padding is not None or vis.dense is not None or bias is not None):
        return _TORCH_SDPA(q, k, v, is_causal=only_causal, scale=scale)
    hidden = vis.hidden(0, q.shape[-2], 0, k.shape[-2], q.device)
    mask, empty = None, None
    if hidden is not None:
        empty = hidden.all(-1, keepdim=True)
        first = torch.arange(k.shape[-2], device=q.device) == 0
        mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill(hidden & ~(empty & first),
                                                                                     -math.inf)
    if bias is not None:
        mask = bias.to(q.dtype) if mask is None else mask + bias.to(q.dtype)
    out = _TORCH_SDPA(q, k, v, attn_mask=mask, scale=scale)
    return out if empty is None else out.masked_fill(empty, 0.0)


def wants_gradient(*tensors: torch.Tensor) -> bool:
    """Whether autograd records a call on these tensors: the decoding kernel has no backward."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _decodes(q, k, v, policy: Precision, stabilize, stats, key_padding_mask) -> bool:
    """Whether an eager call is a decoding step that the split-KV kernel runs (`triton.decode_attention`): a few
    query rows per key/value head against more keys, no padding mask or statistics, no gradient wanted. The flash
    kernels would give it one query tile per head, too few programs to read the keys at the memory's speed."""
    if torch.compiler.is_compiling() or stats is not None or key_padding_mask is not None:
        return False
    if k.shape[2] <= q.shape[2] or wants_gradient(q, k, v):
        return False
    from stableflash.attention.triton.options import current
    rows = q.shape[2] * (q.shape[1] // k.shape[1])
    return _decodes_by_key(policy.key, stabilizers.key_of(stabilize), q.dtype, q.shape[-1], rows,
                           current().decode_kernel)


@functools.lru_cache(maxsize=1024)  # asked on every eager decoding call; keyed by the option supports_decode reads
def _decodes_by_key(policy_key: str, stabilize_key: str | None, dtype: torch.dtype, head_dim: int, rows: int,
                    switched_on: bool) -> bool:
    from stableflash.attention import triton as triton_backend
    return triton_backend.supports_decode(Precision.from_key(policy_key), stabilizers.from_key(stabilize_key), dtype,
                                          head_dim, rows)


@torch.compiler.assume_constant_result
def _triton_takes(policy_key: str, stabilize_key: str | None, dtype: torch.dtype, head_dim: int, masked: bool) -> bool:
    """Whether the kernels run the policy (`triton.supports_policy`), masked calls too where `masked`
    (`triton.supports_masks`). Under torch.compile evaluated once, at trace time (by the keys: dynamo cannot pass
    dataclass instances)."""
    return _takes_by_key(policy_key, stabilize_key, dtype, head_dim, masked)


@torch.compiler.assume_constant_result
def _triton_caps(policy_key: str, stabilize_key: str | None, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels cap scores under the policy (`triton.supports_softcap`); as `_triton_takes`."""
    return _caps_by_key(policy_key, stabilize_key, dtype, head_dim)


@functools.lru_cache(maxsize=1024)
def _caps_by_key(policy_key: str, stabilize_key: str | None, dtype: torch.dtype, head_dim: int) -> bool:
    from stableflash.attention import triton as triton_backend
    return triton_backend.supports_softcap(Precision.from_key(policy_key), stabilizers.from_key(stabilize_key), dtype,
                                           head_dim)


@functools.lru_cache(maxsize=1024)  # asked on every `backend="auto"` call on CUDA
def _takes_by_key(policy_key: str, stabilize_key: str | None, dtype: torch.dtype, head_dim: int, masked: bool) -> bool:
    from stableflash.attention import triton as triton_backend
    policy, stabilize = Precision.from_key(policy_key), stabilizers.from_key(stabilize_key)
    if masked:
        return triton_backend.supports_masks(policy, stabilize, dtype, head_dim)
    return triton_backend.supports_policy(policy, stabilize, dtype)
