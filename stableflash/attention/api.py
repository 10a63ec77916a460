"""`flash_attention`: the one public attention function, and its backends."""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F

from stableflash.attention.precision import Precision, from_cache_key, resolve
from stableflash.attention.reference import reference_attention
from stableflash.attention.stabilize import cache_key, check_stabilize
from stableflash.attention.stabilize import from_cache_key as stabilizer_from_cache_key
from stableflash.attention.stats import AttentionStats

BACKENDS = ("auto", "reference", "triton", "math", "sdpa")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _check_inputs(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected rank 4 (B, H, T, D), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name}: expected dtype float16, bfloat16, float32 or float64, got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not match q's {tuple(q.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} does not match q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: device {t.device} does not match q's {q.device}")
    if q.shape[-1] < 1 or q.shape[-2] < 1:
        raise ValueError(f"q: expected T >= 1 and D >= 1, got shape {tuple(q.shape)}")


def _math_attention(q, k, v, scale, causal, stats):
    """Plain softmax attention in the inputs' dtype (fully materialised scores)."""
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    if stats is not None:
        rm = s.amax(-1, keepdim=True)
        repeated = (((rm - s) <= stats.eps) & torch.isfinite(s)).sum(-1) > 1
        p = torch.softmax(s, dim=-1)
        B, H, T, _ = q.shape
        finite = torch.where(torch.isfinite(s), s, -math.inf)
        pbar = torch.exp(s - torch.where(torch.isneginf(rm), 0.0, rm))
        stats.add(slice(None), rows=B * T,
                  repeated_max_rows=repeated.sum(dim=(0, 2)), pbar_ones=(pbar == 1).sum(dim=(0, 2, 3)),
                  max_score=finite.float().amax(dim=(0, 2, 3)))
    else:
        p = torch.softmax(s, dim=-1)
    # rows with no finite score (all -inf) give 0, as the reference does, not NaN
    p = torch.nan_to_num(p, nan=0.0) if torch.isneginf(s).all(-1).any() else p
    return p @ v


def triton_available(q: torch.Tensor) -> bool:
    """Whether the fused Triton kernels can run on these inputs (CUDA, Triton installed, head dim and dtype)."""
    if not (q.is_cuda and _HAS_TRITON):
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
) -> torch.Tensor:
    """Scaled dot-product attention with controllable numerics.

    Args:
        q, k, v: (B, H, T, D) tensors of one floating dtype and device.
        causal: mask keys after each query.
        scale: score scale; default 1/sqrt(D).
        stabilize: None, `SFA(beta, eps)` (stabilized flash attention) or `ClampPbar()`.
        precision: a `Precision` or a preset name: "fa2" (default, production
            FlashAttention-2 rounding), "bf16", "paper", "fp32", "fp64".
        backend: "reference" (tiled PyTorch, every rounding per `precision`),
            "triton" (fused GPU kernel), "math" (plain softmax attention in the
            inputs' dtype), "sdpa" (torch's scaled_dot_product_attention), or
            "auto": the Triton kernel where it supports the arguments, else the reference.
        stats: an `AttentionStats` to add this call's per-head counters to.

    Returns:
        O, shaped like q, in the dtype of the policy's `out` site ("math" and
        "sdpa": the inputs' dtype). Differentiable with respect to q, k, v.
    """
    _check_inputs(q, k, v)
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
    if stats is not None:
        if not isinstance(stats, AttentionStats):
            raise TypeError(f"stats: expected an AttentionStats, got {type(stats).__name__}")
        stats.check(q.shape[1])

    if backend == "auto":
        backend = "reference"
        if triton_available(q) and _triton_supports(policy.cache_key, cache_key(stabilize), q.dtype):
            backend = "triton"
    if backend in ("math", "sdpa"):
        if stabilize is not None:
            raise ValueError(f"stabilize: backend {backend!r} computes plain softmax; use backend='reference' or 'triton'")
        # by value: a policy unpickled from a checkpoint is equal to the preset, not the same object
        if policy.cache_key != resolve("fa2").cache_key:
            raise ValueError(f"precision: backend {backend!r} has fixed numerics; use backend='reference' or 'triton'")
        if backend == "math":
            return _math_attention(q, k, v, scale, causal, stats)
        if stats is not None:
            raise ValueError("stats: backend 'sdpa' cannot count; use 'math', 'reference' or 'triton'")
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if backend == "triton":
        if not q.is_cuda or not _HAS_TRITON:
            raise ValueError("backend: 'triton' needs CUDA tensors and the triton package; "
                             "use backend='reference' or 'auto'")
        from stableflash.attention import triton as triton_backend
        return triton_backend.attention(q, k, v, causal=causal, scale=scale, policy=policy,
                                        stabilize=stabilize, stats=stats)
    return reference_attention(q, k, v, scale=scale, causal=causal, policy=policy, stabilize=stabilize, stats=stats)


@torch.compiler.assume_constant_result
def _triton_supports(policy_key: str, stabilize_key: str | None, dtype: torch.dtype) -> bool:
    """By string keys, so that torch.compile evaluates it once at trace time (see triton._kernel_key)."""
    from stableflash.attention import triton as triton_backend
    return triton_backend.supports_policy(from_cache_key(policy_key), stabilizer_from_cache_key(stabilize_key), dtype)
