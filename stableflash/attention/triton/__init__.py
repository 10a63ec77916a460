"""Fused Triton flash attention: the `backend="triton"` of `flash_attention`.

`attention(...)` runs the forward and backward kernels of `kernels.py` (eagerly through
an `autograd.Function`; under `torch.compile` through `torch.library` ops, see `ops.py`),
with the numerics of a `Precision` (`spec.py`), SFA or ClampPbar, and optional
in-kernel statistics.
"""

from __future__ import annotations

import functools

import torch

from stableflash.attention import precision as precision_module
from stableflash.attention import stabilize as stab_module
from stableflash.attention.precision import Precision
from stableflash.attention.reference import split_heads
from stableflash.attention.stats import AttentionStats
from stableflash.attention.triton.spec import HEAD_DIMS, INPUT_DTYPES, build_spec, unsupported_reason

__all__ = ["attention", "supports", "supports_policy", "pick_tiles", "HEAD_DIMS"]


def supports(q: torch.Tensor) -> bool:
    """Whether the kernels take inputs shaped and typed like `q` (head dim and dtype)."""
    return q.shape[-1] in HEAD_DIMS and q.dtype in INPUT_DTYPES


def supports_policy(policy: Precision, stabilize, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernels emulate `policy` (and, with a head override, the other heads' policy)."""
    if policy.head_override is not None:
        other = policy.head_override[1]
        return supports_policy(policy.replace(head_override=None), stabilize, dtype) and supports_policy(
            other, stabilize, dtype)
    return unsupported_reason(policy, stabilize, dtype) is None


def pick_tiles(shape: tuple[int, int, int, int], *, precision="fa2", stabilize=None, dtype=torch.bfloat16,
               device="cuda") -> int:
    """Autotune the kernels eagerly for causal attention of `shape` (B, H, T, D) under `precision` and `stabilize`:
    the forward with and without statistics, and the backward, on random inputs laid out as a model's heads
    ((B, T, H, D) in memory). The picks land in `picks.TILE_PICKS`, where every later launch takes them, a
    torch.compile'd one as a fixed tile, and checkpoints keep them. The global RNG is left untouched. Returns how
    many picks `TILE_PICKS` holds."""
    from stableflash.attention.api import flash_attention
    from stableflash.attention.triton.picks import TILE_PICKS

    B, H, T, D = shape
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, dtype=dtype, device=device, generator=generator).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    eps = stabilize.eps if isinstance(stabilize, stab_module.SFA) else AttentionStats(H).eps
    for stats in (None, AttentionStats(H, eps=eps)):
        out = flash_attention(q, k, v, causal=True, precision=precision, stabilize=stabilize, backend="triton",
                              stats=stats)
        out.float().sum().backward()
    return len(TILE_PICKS)


def check(q: torch.Tensor, policy: Precision, stabilize) -> None:
    """Raise a ValueError naming the argument the kernels cannot take."""
    for pol in (policy.replace(head_override=None), *([policy.head_override[1]] if policy.head_override else [])):
        _kernel_key(pol.cache_key, stab_module.cache_key(stabilize), q.dtype, q.shape[-1], q.shape[-2])


def attention(q, k, v, *, causal: bool, scale: float, policy: Precision, stabilize=None,
              stats: AttentionStats | None = None) -> torch.Tensor:
    """Fused attention; a per-head policy override runs each group of heads through its own kernel."""
    return split_heads(q, k, v, policy, lambda q, k, v, pol, heads: _attention(
        q, k, v, causal=causal, scale=scale, policy=pol, stabilize=stabilize, stats=stats, heads=heads))


@torch.compiler.assume_constant_result
def _kernel_key(policy_key: str, stabilize_key: str | None, dtype: torch.dtype, head_dim: int, seq_len: int) -> str:
    """The kernels' specialisation for these arguments (validated, built and registered once).

    Takes the policy and stabilizer by their string keys: under torch.compile this runs once at
    trace time and its result is a constant of the graph."""
    return _cached_key(policy_key, stabilize_key, dtype, head_dim, seq_len)


@functools.lru_cache(maxsize=1024)
def _cached_key(policy_key, stabilize_key, dtype, head_dim, seq_len):
    from stableflash.attention.triton import ops

    policy = precision_module.from_cache_key(policy_key)
    stabilize = stab_module.from_cache_key(stabilize_key)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q: the triton backend supports head dims {HEAD_DIMS}, got {head_dim}")
    reason = unsupported_reason(policy, stabilize, dtype)
    if reason is not None:
        raise ValueError(f"precision: the triton backend cannot run policy {policy.name!r}: {reason}; "
                         "use backend='reference'")
    return ops.register_spec(build_spec(policy, stabilize, dtype, seq_len))


def _attention(q, k, v, *, causal, scale, policy, stabilize, stats, heads):
    from stableflash.attention.triton import ops

    if stats is not None and isinstance(stabilize, stab_module.SFA) and stabilize.eps != stats.eps:
        raise ValueError(f"stats: the triton backend counts near-maxima with SFA's eps ({stabilize.eps}); "
                         f"build AttentionStats with eps={stabilize.eps}")
    _, H, T, D = q.shape
    key = _kernel_key(policy.cache_key, stab_module.cache_key(stabilize), q.dtype, D, T)
    args = (q, k, v, causal, float(scale), key, stats is not None, float(stats.eps) if stats is not None else 0.0)
    if torch.compiler.is_compiling():  # functional ops: the counts come back, added to `stats` below
        out, _, _, counts, smax = ops.compiled_forward_op()(*args)
    elif stats is None:
        return ops.FlashAttention.apply(*args, None)
    else:
        # the kernel adds to the running totals in place where the heads are a run of them, else to fresh zeros
        targets = stats.kernel_targets(heads, q.device)
        if targets is not None:
            return ops.FlashAttention.apply(*args, targets)
        counts, smax = ops.fresh_stat_targets(H, q.device)
        out = ops.FlashAttention.apply(*args, (counts, smax))
    if stats is not None:
        stats.add(heads, rows=counts[:, 2], repeated_max_rows=counts[:, 0], pbar_ones=counts[:, 1], max_score=smax)
    return out
