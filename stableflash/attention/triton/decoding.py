"""Decoding against a key/value cache: a few queries, a long cache, split along the keys (flash-decoding).

One query per sequence leaves the flash kernels one query tile per head, too few programs to stream a cache at the
memory's speed. Here a program serves one key/value head of one sequence, all its group's query heads and queries
as the rows of one tile (`GROUP` · `TQ` of them), over one split of the cache's positions; a second kernel combines
the splits by their log-sum-exps. Pages (`PAGED`: a block table) are read in place, never gathered.

Production FA2 numerics, as the native kernels: scores in fp32 (base 2, `common.scores`, capped under `SOFTCAP`),
P̄ cast to the cache's dtype for P̄V, fp32 accumulators. The splits sum the keys in another order than one pass
does, so results agree with the flash kernels within their rounding, not bit for bit. Forward only: decoding keeps
no graph.

Visibility of cache position j to query t of sequence b, which sits at position seen_b - TQ + t (aligned to the
bottom right, as flash-attn's kv-cache call): first_b <= j < seen_b and -LEFT <= j - (seen_b - TQ + t) <= RIGHT
(-1: unbounded; causal is RIGHT = 0).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from stableflash.attention.triton.common import cast, dot, fp32, scores, shift
from stableflash.attention.triton.launch import last_dim_contiguous
from stableflash.attention.triton.spec import LOG2E, native_scales

_LOG2E = tl.constexpr(LOG2E)
MAX_ROWS = 64  # GROUP · TQ above this is a prefill: the flash kernels run it


@triton.jit
def _decode_split(
    Q, K, V, O_PART, LSE_PART, SEEN, FIRST, CACHE_ROWS, TABLE, q_strides, k_strides, v_strides, stride_table,
    page_size, TQ, H, scale, softcap, LEFT, RIGHT, split_len, SPLITS,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGED: tl.constexpr, SOFTCAP: tl.constexpr, UNIFORM: tl.constexpr,
):
    """One (sequence, key/value head, split): its rows' output normalised over the split's keys, fp32, and their
    log-sum-exp (base 2; -inf where a row sees none of them). UNIFORM: every sequence sees all SEEN positions of its
    own cache row (SEEN a number; FIRST, CACHE_ROWS unused). The strides are the tensors' (batch, position, head)."""
    stride_qb, stride_qt, stride_qh = q_strides
    stride_kb, stride_kt, stride_kh = k_strides
    stride_vb, stride_vt, stride_vh = v_strides
    scale, softcap = fp32(scale), fp32(softcap)
    program, split = tl.program_id(0), tl.program_id(1)
    kv_heads = H // GROUP
    b, kv_head = program // kv_heads, program % kv_heads
    rows = tl.arange(0, BLOCK_M)
    g, t = rows // TQ, rows % TQ
    row_ok = rows < GROUP * TQ
    head = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_ptrs = Q + b.to(tl.int64) * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    if UNIFORM:
        seen, first, cache_row = SEEN, 0, b.to(tl.int64)
    else:
        seen, first = tl.load(SEEN + b), tl.load(FIRST + b)
        cache_row = tl.load(CACHE_ROWS + b).to(tl.int64)
    position = seen - TQ + t  # each row's query, in the cache's positions
    base = first  # the first position any row sees; the splits count from there
    if LEFT >= 0:
        base = tl.maximum(base, seen - TQ - LEFT)
    lo = base + split * split_len
    hi = tl.minimum(seen, lo + split_len)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        key_ok = j < hi
        if PAGED:
            page = tl.load(TABLE + b.to(tl.int64) * stride_table + j // page_size, mask=key_ok, other=0).to(tl.int64)
            k_rows, v_rows = page * stride_kb + (j % page_size) * stride_kt, page * stride_vb + (j % page_size) * stride_vt
        else:
            k_rows, v_rows = cache_row * stride_kb + j * stride_kt, cache_row * stride_vb + j * stride_vt
        tile_ok = key_ok[None, :] & dim_ok[:, None]
        kt = tl.load(K + kv_head * stride_kh + k_rows[None, :] + dims[:, None], mask=tile_ok, other=0.0)
        s, _ = scores(dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), False), scale, softcap, SOFTCAP=SOFTCAP,
                      ROUNDED=True)
        d = j[None, :] - position[:, None]
        seen_here = key_ok[None, :] & row_ok[:, None] & ((LEFT < 0) | (d >= -LEFT)) & ((RIGHT < 0) | (d <= RIGHT))
        s = tl.where(seen_here, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_shift = shift(m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m - m_shift)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_head * stride_vh + v_rows[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                    other=0.0)
        acc = dot(cast(p, v.dtype), v, acc * alpha[:, None], False)
        m = m_new

    empty = m == float("-inf")
    o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l)[:, None])
    part = ((b * H + head) * TQ + t).to(tl.int64) * SPLITS + split  # (B, H, TQ, SPLITS) rows
    tl.store(O_PART + part[:, None] * HEAD_DIM + dims[None, :], o, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(LSE_PART + part, tl.where(empty, float("-inf"), m + tl.math.log2(l)), mask=row_ok)


@triton.jit
def _decode_combine(O_PART, LSE_PART, OUT, LSE, out_strides, H, TQ, SPLITS, HEAD_DIM: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (sequence, head, query) row: its splits weighted by their share of the row's exponentials, BLOCK_S splits
    at a time (two passes: the largest log-sum-exp, then the weighted sum). Writes the output in OUT's dtype and the
    natural log-sum-exp; a row that sees no key gets O = 0 and lse = -inf."""
    row = tl.program_id(0)
    b, rest = row // (H * TQ), row % (H * TQ)
    head, t = rest // TQ, rest % TQ
    dims = tl.arange(0, BLOCK_D)
    first = row.to(tl.int64) * SPLITS
    top = tl.full((), float("-inf"), tl.float32)
    for start in range(0, SPLITS, BLOCK_S):
        splits = start + tl.arange(0, BLOCK_S)
        top = tl.maximum(top, tl.max(tl.load(LSE_PART + first + splits, mask=splits < SPLITS, other=float("-inf")), 0))
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(0, SPLITS, BLOCK_S):
        splits = start + tl.arange(0, BLOCK_S)
        weight = tl.math.exp2(tl.load(LSE_PART + first + splits, mask=splits < SPLITS, other=float("-inf"))
                              - shift(top))
        parts = tl.load(O_PART + (first + splits)[:, None] * HEAD_DIM + dims[None, :],
                        mask=(splits < SPLITS)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        total += tl.sum(weight, 0)
        acc += tl.sum(weight[:, None] * parts, 0)
    empty = top == float("-inf")
    o = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, total))
    stride_ob, stride_ot, stride_oh = out_strides
    out = OUT + b.to(tl.int64) * stride_ob + t * stride_ot + head * stride_oh + dims
    tl.store(out, cast(o, OUT.dtype.element_ty), mask=dims < HEAD_DIM)
    tl.store(LSE + row, tl.where(empty, float("-inf"), (top + tl.math.log2(total)) / _LOG2E))


@functools.cache
def _programs_to_fill(device: torch.device) -> int:
    """Two programs per multiprocessor: enough splits that the cache streams from every SM (and a few on the CPU)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_D): key tiles of 64 rows at D > 64, else 128, each row padded to a power of two >= 16."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return (64 if block_d > 64 else 128), block_d


def decode(q, k_cache, v_cache, seen, first, cache_rows, longest: int, block_table, scale: float,
           window: tuple[int, int], softcap: float = 0.0, splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, TQ, H, D) against each sequence's cache positions first[b]..seen[b] - 1, with causal and
    window folded into `window` (left, right) as the kernels' band. k_cache, v_cache: (B_cache, Tmax, H_kv, D) read
    at rows `cache_rows` (B,), or pages (num_pages, page_size, H_kv, D) through `block_table` (B, pages). `seen`,
    `first`, `cache_rows`: (B,) integer tensors; or `seen` one int and `first`, `cache_rows` None: every sequence
    sees that many positions of its own row. `longest` >= max(seen - first) sizes the splits; `splits` > 0 asks for
    that many (at most one per key tile), 0 for enough to fill the GPU. Returns (out (B, TQ, H, D) in q's dtype, lse
    (B, H, TQ) fp32, natural log)."""
    # the kernels address the head dim as contiguous: a strided one is read through a copy (written caches too,
    # whose writes the caller has made already)
    q, k_cache, v_cache = (last_dim_contiguous(t) for t in (q, k_cache, v_cache))
    B, TQ, H, D = q.shape
    group = H // k_cache.shape[2]
    block_n, block_d = _tiles(D)
    uniform = isinstance(seen, int)
    if window[0] >= 0:
        longest = min(longest, window[0] + TQ)
    per_sequence = splits or max(1, -(-_programs_to_fill(q.device) // max(1, B * (H // group))))
    tiles = max(1, -(-longest // block_n))
    splits = min(per_sequence, tiles)
    split_len = -(-tiles // splits) * block_n
    splits = max(1, -(-longest // split_len))
    o_part = torch.empty(B, H, TQ, splits, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B, H, TQ, splits, device=q.device, dtype=torch.float32)
    paged = block_table is not None
    placeholder = lse_part  # for the pointers a call does not read
    table = block_table if paged else placeholder
    kernel_scale, kernel_softcap = native_scales(scale, softcap)
    left, right = window
    _decode_split[(B * (H // group), splits)](
        q, k_cache, v_cache, o_part, lse_part, seen, placeholder if uniform else first,
        placeholder if uniform else cache_rows, table, q.stride()[:3], k_cache.stride()[:3], v_cache.stride()[:3],
        table.stride(0), k_cache.shape[1], TQ, H, kernel_scale, kernel_softcap, left, right, split_len, splits,
        GROUP=group, HEAD_DIM=D, BLOCK_M=max(16, triton.next_power_of_2(group * TQ)), BLOCK_N=block_n,
        BLOCK_D=block_d, PAGED=paged, SOFTCAP=softcap > 0, UNIFORM=uniform, num_warps=4, num_stages=3)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, TQ, device=q.device, dtype=torch.float32)
    _decode_combine[(B * H * TQ,)](o_part, lse_part, out, lse, out.stride()[:3], H, TQ, splits, HEAD_DIM=D, BLOCK_S=16,
                                   BLOCK_D=block_d, num_warps=4)
    return out, lse
