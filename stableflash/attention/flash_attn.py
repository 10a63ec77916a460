"""flash-attn's calling convention over `flash_attention`: swap one import, keep the code.

`flash_attn_func` takes (B, T, H, D) tensors and `flash_attn_varlen_func` packed (total, H, D) ones with cumulative
sequence lengths, with flash-attn's argument names and defaults (`causal=False`, `window_size=(-1, -1)`), plus this
library's `precision=`, `stabilize=`, `stats=` and `backend=`. What flash-attn has and this does not (dropout,
ALiBi, softcapping, the attention probabilities) is refused by name, never ignored.
"""

from __future__ import annotations

import torch

from stableflash.attention.api import flash_attention, triton_available
from stableflash.attention.precision import resolve
from stableflash.attention.stabilize import check_stabilize


def _refuse_unsupported(dropout_p, softcap, alibi_slopes, return_attn_probs) -> None:
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: only 0.0 is supported, got {dropout_p!r}")
    if softcap != 0.0:
        raise ValueError(f"softcap: only 0.0 is supported, got {softcap!r}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not supported; pass None")
    if return_attn_probs:
        raise ValueError("return_attn_probs: not supported (the probabilities are never materialised); pass False")


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                    deterministic: bool = False, return_attn_probs: bool = False, *, precision="fa2",
                    stabilize=None, stats=None, backend: str = "auto") -> torch.Tensor:
    """Attention on (B, T, H, D) q and (B, Tk, H_kv, D) k, v; returns (B, T, H, D). `deterministic` is accepted:
    every backend here is deterministic already."""
    _refuse_unsupported(dropout_p, softcap, alibi_slopes, return_attn_probs)
    return flash_attention(q, k, v, causal=causal, scale=softmax_scale, window=tuple(window_size), layout="bthd",
                           precision=precision, stabilize=stabilize, stats=stats, backend=backend)


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in (torch.int32,
                                                                                                  torch.int64):
        raise ValueError(f"{name}: expected a 1-D int32 tensor of batch + 1 offsets starting at 0")
    offsets = cu.tolist()
    if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets from 0 to {total}, got {offsets}")
    return offsets


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                           deterministic: bool = False, return_attn_probs: bool = False, *, precision="fa2",
                           stabilize=None, stats=None, backend: str = "auto") -> torch.Tensor:
    """Packed variable-length sequences: q (total_q, H, D), k and v (total_k, H_kv, D), sequence s being rows
    cu_seqlens_q[s]:cu_seqlens_q[s+1] of q (and likewise of k). Each sequence attends only to its own keys, causal
    aligned to its own bottom right. The batch runs in one call of the fused kernels where they take it (production
    FA2 numerics); under other policies as one call per sequence."""
    _refuse_unsupported(dropout_p, softcap, alibi_slopes, return_attn_probs)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected a rank-3 (total, H, D) tensor")
    qs = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ks = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(qs) != len(ks):
        raise ValueError(f"cu_seqlens_k: {len(ks) - 1} sequences where cu_seqlens_q has {len(qs) - 1}")
    if max(b - a for a, b in zip(qs, qs[1:])) > max_seqlen_q or max(b - a for a, b in zip(ks, ks[1:])) > max_seqlen_k:
        raise ValueError("max_seqlen_q, max_seqlen_k: smaller than the longest sequence")
    if backend in ("auto", "triton") and _kernels_take_packed(q, k, precision, stabilize):
        return _packed_in_the_kernels(q, k, v, qs, ks, softmax_scale, causal, window_size, precision, stabilize,
                                      stats)
    outs = []  # elsewhere: one call per sequence
    for (q0, q1), (k0, k1) in zip(zip(qs, qs[1:]), zip(ks, ks[1:])):
        if q1 == q0:
            continue
        if k1 == k0:  # a sequence without keys: its queries see nothing
            outs.append(torch.zeros_like(q[q0:q1]))
            continue
        outs.append(flash_attn_func(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale=softmax_scale,
                                    causal=causal, window_size=window_size, precision=precision, stabilize=stabilize,
                                    stats=stats, backend=backend)[0])
    return torch.cat(outs) if outs else torch.zeros_like(q)


def _kernels_take_packed(q, k, precision, stabilize) -> bool:
    """Whether the fused kernels run this packed batch in one call (their masked form, under
    production FA2 numerics; emulated policies run per sequence): the sequences then never leave the packed
    tensors."""
    if not triton_available(q) or q.shape[1] % k.shape[1]:
        return False
    from stableflash.attention import triton as kernels
    return kernels.supports_masks(resolve(precision), check_stabilize(stabilize), q.dtype, q.shape[-1], packed=True)


def _packed_in_the_kernels(q, k, v, q_offsets, k_offsets, scale, causal, window_size, precision, stabilize, stats):
    from stableflash.attention import triton as kernels
    from stableflash.attention.triton.launch import packed_segments

    if stats is not None:
        stats.check(q.shape[1])
    heads = [t.transpose(0, 1)[None] for t in (q, k, v)]  # (1, H, total, D) views of the packed rows
    out = kernels.attention(*heads, causal=causal, scale=scale if scale is not None else q.shape[-1] ** -0.5,
                            policy=resolve(precision), stabilize=check_stabilize(stabilize), stats=stats,
                            window=tuple(window_size), segments=packed_segments(q_offsets, k_offsets, q.device))
    return out[0].transpose(0, 1)
