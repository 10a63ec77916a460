"""flash-attn's calling convention over `flash_attention`: swap one import, keep the code.

The functions of `flash_attn` (2.x) with its argument names and defaults (`causal=False`, `window_size=(-1, -1)`),
plus this library's `precision=`, `stabilize=`, `stats=` and `backend=`: `flash_attn_func` on (B, T, H, D),
`flash_attn_qkvpacked_func` and `flash_attn_kvpacked_func` on packed q/k/v, the `varlen` forms on sequences packed
along the tokens with cumulative lengths, and `flash_attn_with_kvcache` for decoding.

- `return_attn_probs=True` returns (out, softmax_lse, None): the log-sum-exp of each row's scores, (B, H, Tq) fp32
  ((H, total_q) in the varlen forms), as flash-attn's second output; the third, the attention probabilities
  flash-attn returns for testing with dropout, is never materialised here.
- `softcap` > 0 caps the scaled scores (Gemma 2's): in the fused kernels under production FA2 numerics, elsewhere in
  the reference.
- The backward is deterministic by default (no atomics: each key tile's dK and dV, and each query tile's dQ, are
  summed by one program in a fixed order); `deterministic=True` keeps it so where `KernelOptions(atomic_dq=True)`
  would add dQ with atomics.
- Dropout and ALiBi are refused by name, never ignored.
"""

from __future__ import annotations

import contextlib

import torch

from stableflash.attention.api import flash_attention, triton_available, triton_installed_for, wants_gradient
from stableflash.attention.precision import resolve
from stableflash.attention.stabilize import check_stabilize

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def _refuse_unsupported(dropout_p, alibi_slopes) -> None:
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: only 0.0 is supported, got {dropout_p!r}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not supported; pass None")


def _backward_without_atomics(deterministic: bool):
    """flash-attn's `deterministic=True`: the forwards inside run the backward that adds no dQ with atomics, whatever
    `KernelOptions.atomic_dq` says (the options in force at a forward choose its backward)."""
    if not deterministic:
        return contextlib.nullcontext()
    from stableflash.attention.triton.options import kernel_options
    return kernel_options(atomic_dq=False)


def _window(window_size) -> tuple[int, int]:
    """flash-attn's window as two ints (a list or a tensor of two is taken too)."""
    values = window_size.tolist() if isinstance(window_size, torch.Tensor) else list(window_size)
    if len(values) != 2:
        raise ValueError(f"window_size: expected (left, right), got {window_size!r}")
    return int(values[0]), int(values[1])


def _with_lse(out, lse, return_attn_probs: bool):
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, precision="fa2", stabilize=None, stats=None,
                    backend: str = "auto"):
    """Attention on (B, T, H, D) q and (B, Tk, H_kv, D) k, v; returns (B, T, H, D) (with `return_attn_probs`, also
    the log-sum-exp (B, H, T))."""
    _refuse_unsupported(dropout_p, alibi_slopes)
    with _backward_without_atomics(deterministic):
        result = flash_attention(q, k, v, causal=causal, scale=softmax_scale, window=_window(window_size),
                                 layout="bthd", softcap=softcap, precision=precision, stabilize=stabilize, stats=stats,
                                 backend=backend, return_lse=return_attn_probs)  # the lse only when asked: not "sdpa"
    return (*result, None) if return_attn_probs else result


def flash_attn_qkvpacked_func(qkv, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                              window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                              deterministic: bool = False, return_attn_probs: bool = False, **options):
    """`flash_attn_func` on qkv (B, T, 3, H, D)."""
    _check_rank("qkv", qkv, 5, "(B, T, 3, H, D)")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **options)


def flash_attn_kvpacked_func(q, kv, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                             window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                             deterministic: bool = False, return_attn_probs: bool = False, **options):
    """`flash_attn_func` on q (B, T, H, D) and kv (B, Tk, 2, H_kv, D)."""
    _check_rank("kv", kv, 5, "(B, Tk, 2, H_kv, D)")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **options)


def _check_rank(name: str, t, rank: int, shape: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != rank:
        raise ValueError(f"{name}: expected a rank-{rank} {shape} tensor")


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
                           window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                           deterministic: bool = False, return_attn_probs: bool = False, block_table=None, *,
                           precision="fa2", stabilize=None, stats=None, backend: str = "auto"):
    """Packed variable-length sequences: q (total_q, H, D), k and v (total_k, H_kv, D), sequence s being rows
    cu_seqlens_q[s]:cu_seqlens_q[s+1] of q (and likewise of k). Each sequence attends only to its own keys, causal
    aligned to its own bottom right. The batch runs in one call of the fused kernels where they take it (production
    FA2 numerics); otherwise as one call per sequence. With `return_attn_probs` the log-sum-exp is
    (H, total_q). With `block_table` (B, pages), k and v are pages (num_pages, page_size, H_kv, D) and sequence s's
    keys are the first cu_seqlens_k[s+1] - cu_seqlens_k[s] positions of its pages, gathered into packed form."""
    _refuse_unsupported(dropout_p, alibi_slopes)
    if block_table is not None:
        k, v = _gathered_pages(k, v, block_table, cu_seqlens_k)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, t, 3, "(total, H, D)")
    qs = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ks = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(qs) != len(ks):
        raise ValueError(f"cu_seqlens_k: {len(ks) - 1} sequences where cu_seqlens_q has {len(qs) - 1}")
    if max(b - a for a, b in zip(qs, qs[1:])) > max_seqlen_q or max(b - a for a, b in zip(ks, ks[1:])) > max_seqlen_k:
        raise ValueError("max_seqlen_q, max_seqlen_k: smaller than the longest sequence")
    window = _window(window_size)
    if backend in ("auto", "triton") and _kernels_take_packed(q, k, precision, stabilize):
        with _backward_without_atomics(deterministic):
            out, lse = _packed_in_the_kernels(q, k, v, qs, ks, softmax_scale, causal, window, softcap, precision,
                                              stabilize, stats)
        return _with_lse(out, lse, return_attn_probs)
    outs, lses = [], []  # elsewhere: one call per sequence (empty ones too: their zeros join autograd's graph)
    for (q0, q1), (k0, k1) in zip(zip(qs, qs[1:]), zip(ks, ks[1:])):
        out, lse, _ = flash_attn_func(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale=softmax_scale,
                                      causal=causal, window_size=window, softcap=softcap, deterministic=deterministic,
                                      return_attn_probs=True, precision=precision, stabilize=stabilize, stats=stats,
                                      backend=backend)
        outs.append(out[0])
        lses.append(lse[0])
    return _with_lse(torch.cat(outs), torch.cat(lses, dim=1), return_attn_probs)


def _gathered_pages(k_pages, v_pages, block_table, cu_seqlens_k):
    """The packed (total_k, H_kv, D) keys and values of paged k and v: each sequence's first positions of its pages."""
    _check_rank("k", k_pages, 4, "(num_pages, page_size, H_kv, D) with block_table")
    _check_rank("block_table", block_table, 2, "(B, pages)")
    offsets = cu_seqlens_k.tolist()
    page_size = k_pages.shape[1]
    if len(offsets) - 1 != block_table.shape[0]:
        raise ValueError(f"block_table: {block_table.shape[0]} rows for {len(offsets) - 1} sequences")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if max(lengths, default=0) > block_table.shape[1] * page_size:
        raise CacheBoundsError(f"cu_seqlens_k: a sequence of {max(lengths)} keys is longer than block_table's "
                               f"{block_table.shape[1]} pages of {page_size}")
    parts = [tuple(p[block_table[s, :-(-n // page_size)].long()].flatten(0, 1)[:n] for p in (k_pages, v_pages))
             for s, n in enumerate(lengths)]
    return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                                     softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                                     return_attn_probs: bool = False, **options):
    """`flash_attn_varlen_func` on qkv (total, 3, H, D), one set of sequence offsets for queries and keys."""
    _check_rank("qkv", qkv, 4, "(total, 3, H, D)")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  **options)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                                    window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                                    deterministic: bool = False, return_attn_probs: bool = False, **options):
    """`flash_attn_varlen_func` on q (total_q, H, D) and kv (total_k, 2, H_kv, D)."""
    _check_rank("kv", kv, 4, "(total_k, 2, H_kv, D)")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, **options)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                            softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes=None,
                            num_splits: int = 0, return_softmax_lse: bool = False, *, precision="fa2",
                            stabilize=None, stats=None, backend: str = "auto"):
    """Attention of q (B, Tq, H, D) against a key/value cache, as flash-attn's decoding call.

    k_cache, v_cache: (B_cache, Tmax, H_kv, D), or with `block_table` (B, pages) pages of (num_pages, page_size,
    H_kv, D). `cache_seqlens` (an int or (B,) ints; default: the whole cache) is how many keys each sequence holds;
    new `k`, `v` (B, Tnew, H_kv, D) are written into the cache in place at those positions first, and then seen.
    `cache_leftpad` (B,) ints: each sequence's keys start there (the positions before it are padding).
    `cache_batch_idx` picks each sequence's cache row. With `rotary_cos`, `rotary_sin` ((positions, R / 2), R <= D)
    the first R dims of the new keys are rotated at their positions (cache_seqlens, cache_seqlens + 1, ...) before
    they are written, and those of q at the same positions when causal or windowed, else all at cache_seqlens (the
    pairs are (x[2i], x[2i + 1]) with `rotary_interleaved`, else (x[i], x[i + R/2])). Causal is aligned to each
    sequence's own last key. On CUDA under `fa2`, with no gradient wanted, the decoding kernel runs the call
    (`triton.decode_attention`), in `num_splits` splits of each sequence's keys (0: its own choice, two programs per
    SM), reading pages in place; elsewhere one call of the attention where the sequences see as many keys, or where
    one query each or no causality lets their lengths be key padding, else a call per sequence. Returns
    (B, Tq, H, D), with `return_softmax_lse` also the log-sum-exp (B, H, Tq)."""
    _refuse_unsupported(0.0, alibi_slopes)
    _check_rank("q", q, 4, "(B, Tq, H, D)")
    B, Tq = q.shape[:2]
    if block_table is None:
        _check_rank("k_cache", k_cache, 4, "(B_cache, Tmax, H_kv, D)")
        capacity = k_cache.shape[1]
    else:
        _check_rank("block_table", block_table, 2, "(B, pages)")
        capacity = block_table.shape[1] * k_cache.shape[1]
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both new keys and values, or neither")
    window = _window(window_size)
    decoding = backend in ("auto", "triton") and _decodes_in_the_kernel(q, k_cache, v_cache, precision, stabilize,
                                                                        stats)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    whole_caches = cache_seqlens is None and cache_batch_idx is None and cache_leftpad is None
    if decoding and whole_caches and k is None and rotary_cos is None:
        from stableflash.attention import triton as kernels  # every sequence its own whole cache: nothing to build
        out, lse = kernels.decode_attention(q, k_cache, v_cache, seen=capacity, block_table=block_table, scale=scale,
                                            window=window, causal=causal, softcap=softcap, splits=num_splits)
        return (out, lse) if return_softmax_lse else out
    rows = torch.arange(B, device=q.device) if cache_batch_idx is None else cache_batch_idx.to(q.device).long()
    lengths, longest = _cache_lengths(cache_seqlens, B, capacity, q.device, paged=block_table is not None)
    new = 0 if k is None else k.shape[1]
    if rotary_cos is not None or rotary_sin is not None:
        rotary = _Rotary.checked(rotary_cos, rotary_sin, q.shape[-1], rotary_interleaved)
        if k is not None:
            k = rotary(k, lengths[:, None] + torch.arange(new, device=q.device))
        aligned = causal or window != (-1, -1)  # q's rows at their own positions, else all at the cache's end
        offsets = torch.arange(Tq, device=q.device) if aligned else torch.zeros(Tq, dtype=torch.long, device=q.device)
        q = rotary(q, lengths[:, None] + offsets)
    if k is not None:
        if longest + new > capacity:
            raise CacheBoundsError(f"k: {new} new keys do not fit the cache's {capacity} positions (block_table's "
                                   f"pages times their size when paged) after {lengths.tolist()}")
        _write_into_cache(k_cache, v_cache, k, v, rows, lengths, block_table)
    seen = lengths + new
    first = _cache_starts(cache_leftpad, B, seen, q.device)
    if decoding:
        from stableflash.attention import triton as kernels
        out, lse = kernels.decode_attention(q, k_cache, v_cache, seen=seen, first=first, cache_rows=rows,
                                            longest=longest + new, block_table=block_table, scale=scale,
                                            window=window, causal=causal, softcap=softcap, splits=num_splits)
        return (out, lse) if return_softmax_lse else out
    keys, values = _gathered_cache(k_cache, v_cache, rows, block_table, longest + new)
    common = dict(causal=causal, scale=softmax_scale, window=window, layout="bthd", softcap=softcap,
                  precision=precision, stabilize=stabilize, stats=stats, backend=backend, return_lse=True)
    if cache_leftpad is None and bool((seen == seen[0]).all()):  # one length: one call, causal to the cache's end
        out, lse = flash_attention(q, keys, values, **common)
    elif (Tq == 1 or not causal) and window == (-1, -1):  # the lengths as key padding: one call
        positions = torch.arange(keys.shape[1], device=q.device)[None, :]
        padding = (positions < seen[:, None]) & (positions >= first[:, None])
        out, lse = flash_attention(q, keys, values, key_padding_mask=padding, **common)
    else:  # causal or windowed rows of several queries align to each sequence's own end: a call each
        parts = [flash_attention(q[b:b + 1], keys[b:b + 1, int(first[b]):int(seen[b])],
                                 values[b:b + 1, int(first[b]):int(seen[b])], **common) for b in range(B)]
        out, lse = torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
    return (out, lse) if return_softmax_lse else out


class CacheBoundsError(ValueError, RuntimeError):
    """Cache positions past what the cache (or its block table) holds: a ValueError, as this library's argument
    errors are, and a RuntimeError, as flash-attn raises it, so that code written for either catches it."""


class _Rotary:
    """Rotary embeddings of flash-attn's kv-cache call: the first R = 2 · cos.shape[1] dims of x rotated by the
    angles of given positions, in fp32 (or x's wider dtype), cast back to x's dtype."""

    def __init__(self, cos, sin, interleaved: bool):
        self.cos, self.sin, self.interleaved = cos, sin, interleaved

    @classmethod
    def checked(cls, cos, sin, head_dim: int, interleaved: bool) -> _Rotary:
        if cos is None or sin is None or cos.dim() != 2 or cos.shape != sin.shape:
            raise ValueError("rotary_cos, rotary_sin: expected both, of one shape (positions, R / 2)")
        if 2 * cos.shape[1] > head_dim:
            raise ValueError(f"rotary_cos: rotates {2 * cos.shape[1]} dims, more than the head dim {head_dim}")
        return cls(cos, sin, interleaved)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, T, H, D) with its token t of sequence b at positions[b, t]."""
        if int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"rotary_cos: {self.cos.shape[0]} positions, but position {int(positions.max())} is "
                             "rotated")
        r = 2 * self.cos.shape[1]
        wide = torch.promote_types(x.dtype, torch.float32)
        cos, sin = (t[positions.long()].to(wide)[:, :, None, :] for t in (self.cos, self.sin))  # (B, T, 1, R/2)
        head = x[..., :r].to(wide)
        x1, x2 = (head[..., 0::2], head[..., 1::2]) if self.interleaved else head.chunk(2, dim=-1)
        y1, y2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        rotated = torch.stack((y1, y2), dim=-1).flatten(-2) if self.interleaved else torch.cat((y1, y2), dim=-1)
        return torch.cat((rotated.to(x.dtype), x[..., r:]), dim=-1)


def _cache_starts(cache_leftpad, batch: int, seen: torch.Tensor, device) -> torch.Tensor:
    """Each sequence's first key: its `cache_leftpad`, else 0."""
    if cache_leftpad is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    starts = torch.as_tensor(cache_leftpad, device=device).long().reshape(-1)
    if starts.numel() != batch or (starts < 0).any() or (starts > seen).any():
        raise ValueError(f"cache_leftpad: expected {batch} starts, each 0..its sequence's length {seen.tolist()}")
    return starts


def _cache_lengths(cache_seqlens, batch: int, capacity: int, device, paged: bool) -> tuple[torch.Tensor, int]:
    """Each sequence's cached keys (B,) and the most of them, checked against the capacity (one read back)."""
    if cache_seqlens is None:
        return torch.full((batch,), capacity, dtype=torch.long, device=device), capacity
    lengths = torch.as_tensor(cache_seqlens, device=device).long().reshape(-1).expand(batch)
    least, most = (int(x) for x in lengths.aminmax()) if batch else (0, 0)
    if least < 0 or most > capacity:
        held = "block_table's pages hold" if paged else "the cache holds"
        raise CacheBoundsError(f"cache_seqlens: expected 0..{capacity} ({held} {capacity} positions), got "
                               f"{lengths.tolist()}")
    return lengths, most


def _write_into_cache(k_cache, v_cache, k, v, rows, lengths, block_table) -> None:
    """k, v (B, Tnew, H_kv, D) into each sequence's cache after its `lengths` keys, in place."""
    for b in range(k.shape[0]):
        positions = torch.arange(int(lengths[b]), int(lengths[b]) + k.shape[1], device=k.device)
        if block_table is None:
            k_cache[rows[b], positions] = k[b].to(k_cache.dtype)
            v_cache[rows[b], positions] = v[b].to(v_cache.dtype)
        else:
            page_size = k_cache.shape[1]
            pages = block_table[b].long()[positions // page_size]
            k_cache[pages, positions % page_size] = k[b].to(k_cache.dtype)
            v_cache[pages, positions % page_size] = v[b].to(v_cache.dtype)


def _gathered_cache(k_cache, v_cache, rows, block_table, length: int):
    """(B, length, H_kv, D) keys and values of the sequences' caches: views of the cache's rows where `rows` is every
    row in order and no pages are given, else gathered."""
    if block_table is not None:
        page_size = k_cache.shape[1]
        pages = block_table[:, :-(-length // page_size)].long()  # (B, pages)
        return tuple(c[pages].flatten(1, 2)[:, :length] for c in (k_cache, v_cache))
    if torch.equal(rows, torch.arange(k_cache.shape[0], device=rows.device)):
        return k_cache[:, :length], v_cache[:, :length]
    return k_cache[rows, :length], v_cache[rows, :length]


def _decodes_in_the_kernel(q, k_cache, v_cache, precision, stabilize, stats) -> bool:
    """Whether the decoding kernel (`triton.decode_attention`: split along the cache, pages read in place) runs this
    call: CUDA, production FA2 numerics without a stabilizer or statistics, a few query rows per key/value head,
    and no gradient wanted."""
    if not triton_installed_for(q) or stats is not None:
        return False
    if wants_gradient(q, k_cache, v_cache):
        return False
    if q.shape[2] % k_cache.shape[2] or not (k_cache.dtype == v_cache.dtype == q.dtype):
        return False
    from stableflash.attention import triton as kernels
    rows = q.shape[1] * (q.shape[2] // k_cache.shape[2])
    return kernels.supports_decode(resolve(precision), check_stabilize(stabilize), q.dtype, q.shape[-1], rows)


def _kernels_take_packed(q, k, precision, stabilize) -> bool:
    """Whether the fused kernels run this packed batch in one call (their masked form, under
    production FA2 numerics; emulated policies run per sequence): the sequences then never leave the packed
    tensors."""
    if not triton_available(q) or q.shape[1] % k.shape[1]:
        return False
    from stableflash.attention import triton as kernels
    return kernels.supports_masks(resolve(precision), check_stabilize(stabilize), q.dtype, q.shape[-1], packed=True)


def _packed_in_the_kernels(q, k, v, q_offsets, k_offsets, scale, causal, window, softcap, precision, stabilize,
                           stats):
    """(out (total_q, H, D), lse (H, total_q))."""
    from stableflash.attention import triton as kernels
    from stableflash.attention.triton.launch import packed_segments

    if stats is not None:
        stats.check(q.shape[1])
    heads = [t.transpose(0, 1)[None] for t in (q, k, v)]  # (1, H, total, D) views of the packed rows
    out, lse = kernels.attention(*heads, causal=causal, scale=scale if scale is not None else q.shape[-1] ** -0.5,
                                 policy=resolve(precision), stabilize=check_stabilize(stabilize), stats=stats,
                                 window=window, segments=packed_segments(q_offsets, k_offsets, q.device),
                                 softcap=softcap, return_lse=True)
    return out[0].transpose(0, 1), lse[0]
