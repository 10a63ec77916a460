"""Fused Triton flash attention: the `backend="triton"` of `flash_attention`.

`attention(...)` runs the forward and backward kernels of `kernels.py` through the
`stableflash::flash_fwd` / `flash_bwd` custom ops (so `torch.compile` traces them),
with the numerics of a `Precision` (`spec.py`), SFA or ClampPbar, and optional
in-kernel statistics.
"""

from __future__ import annotations

import torch

from stableflash.attention.precision import Precision
from stableflash.attention.reference import split_heads
from stableflash.attention.stats import AttentionStats
from stableflash.attention.triton.spec import HEAD_DIMS, build_spec, unsupported_reason

__all__ = ["attention", "supports", "supports_policy", "HEAD_DIMS"]


def supports(q: torch.Tensor) -> bool:
    """Whether the kernels take inputs shaped and typed like `q` (head dim and dtype)."""
    return q.shape[-1] in HEAD_DIMS and unsupported_reason(Precision(), None, q.dtype) is None


def supports_policy(policy: Precision, stabilize, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernels emulate `policy` (and, with a head override, the other heads' policy)."""
    if policy.head_override is not None:
        other = policy.head_override[1]
        return supports_policy(policy.replace(head_override=None), stabilize, dtype) and supports_policy(
            other, stabilize, dtype)
    return unsupported_reason(policy, stabilize, dtype) is None


def check(q: torch.Tensor, policy: Precision, stabilize) -> None:
    """Raise a ValueError naming the argument the kernels cannot take."""
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"q: the triton backend supports head dims {HEAD_DIMS}, got {q.shape[-1]}")
    reason = unsupported_reason(policy, stabilize, q.dtype)
    if reason is not None:
        raise ValueError(f"precision: the triton backend cannot run policy {policy.name!r}: {reason}; "
                         "use backend='reference'")


def attention(q, k, v, *, causal: bool, scale: float, policy: Precision, stabilize=None,
              stats: AttentionStats | None = None) -> torch.Tensor:
    """Fused attention; a per-head policy override runs each group of heads through its own kernel."""
    return split_heads(q, k, v, policy, lambda q, k, v, pol, heads: _attention(
        q, k, v, causal=causal, scale=scale, policy=pol, stabilize=stabilize, stats=stats, heads=heads))


def _attention(q, k, v, *, causal, scale, policy, stabilize, stats, heads):
    from stableflash.attention.triton import ops

    check(q, policy, stabilize)
    if stats is not None and stabilize is not None and getattr(stabilize, "eps", stats.eps) != stats.eps:
        raise ValueError(f"stats: the triton backend counts near-maxima with SFA's eps ({stabilize.eps}); "
                         f"build AttentionStats with eps={stabilize.eps}")
    key = ops.register_spec(build_spec(policy, stabilize, q.dtype, q.shape[-2]))
    out, _, _, counts, smax = ops.flash_fwd(q, k, v, causal, float(scale), key, stats is not None,
                                            float(stats.eps) if stats is not None else 0.0)
    if stats is not None:
        B, H, T, _ = q.shape
        stats.add(heads, rows=torch.full((H,), B * T, dtype=torch.int64, device=q.device),
                  repeated_max_rows=counts[:, 0].long(), pbar_ones=counts[:, 1].long(), max_score=smax)
    return out
