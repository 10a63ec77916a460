"""Triton helpers shared by the native and the emulation kernels: loads, casts, products, SFA's shift."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from stableflash.attention.triton.spec import INTERPRET

# The interpreter (TRITON_INTERPRET=1, the CPU tests) has no libdevice and multiplies bf16 tiles wrongly in tl.dot,
# so it takes fp32 paths instead.
_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def cast(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE with round-to-nearest-even (the interpreter's own bf16 cast truncates)."""
    if _INTERPRET and DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 32767 + ((bits >> 16) & 1)) & -65536
        x = tl.where(x == x, rounded.to(tl.float32, bitcast=True), x)
    return x.to(DTYPE)


@triton.jit
def dot(a, b, acc, OPS_FP32: tl.constexpr):
    """a @ b + acc with fp32 accumulation; operands in their dtype, or exact fp32 when OPS_FP32 or either operand
    is fp32 (an fp32 dO: the reference multiplies it as given, where tensor cores would read it as tf32)."""
    # one return through if/elif/else: after an early `return` under a constexpr `if`, Triton still compiles the
    # rest, and a bf16 dot of fp32 operands does not compile
    if _INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif OPS_FP32 or a.dtype == tl.float32 or b.dtype == tl.float32:  # three tf32 products: fp32-level accuracy
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def mul_rn(a, b):
    """a·b rounded on its own, never contracted with a later addition into an FMA (PTX `mul.rn`).

    Natively, for the scores: with fl(s) − m a row's maximum gives exp2(0) = 1 at any magnitude, where
    exp2(fma(qk, scale, −m)) gets the rounding residual of m, which overflows exp2 from scores of ~2^31. Under
    emulation, at every product followed by a sum: the reference rounds both."""
    if _INTERPRET:
        y = a * b
    else:
        y = libdevice.mul_rn(a, b)
    return y


@triton.jit
def scores(qk, scale, softcap, SOFTCAP: tl.constexpr, ROUNDED: tl.constexpr):
    """Scores from Q·Kᵀ and, under SOFTCAP, the cap's slope d(score)/d(Q·Kᵀ · scale) / softcap = 1 - tanh² (else
    the scores again, unused). The forward rounds the plain product once (ROUNDED: `mul_rn`), so that a row's maximum
    gives exp2(0) = 1; the backward leaves the compiler free to fuse it into the exponent's FMA."""
    if SOFTCAP:
        t = 2.0 * tl.sigmoid(2.0 * (qk * scale)) - 1.0  # tanh
        s = softcap * t
        slope = 1.0 - t * t
    elif ROUNDED:
        s = mul_rn(qk, scale)
        slope = s
    else:
        s = qk * scale
        slope = s
    return s, slope


@triton.jit
def fp32(x):
    """A float argument in fp32: Triton passes Python floats as fp32, but inductor (launching the traced ops) as
    fp64, which would promote every score computed with it."""
    return tl.cast(x, tl.float32)


@triton.jit
def head_offset(bh, H, stride_b, stride_h):
    """Element offset of (batch, head) = divmod(bh, H) in a (B, H, T, D) tensor with these strides."""
    return (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h


@triton.jit
def row_strides(strides, STRIDE8: tl.constexpr):
    """A (B, H, T, D) tensor's (batch, head, position) strides. With STRIDE8 (the launcher checked that each is a
    multiple of 8) they are rebuilt as 8·(s // 8), the same values, from which the compiler proves it: Triton
    specialises a stride on divisibility by 16 only, and a head dim padded inside the kernels has strides like 40
    (D = 40 in a model's layout), with which it loads one 16-bit value per thread in another layout than the full
    head dim's: narrower loads, and row sums (δ) added in another order, so other bits than padding by hand."""
    b, h, t = strides
    if STRIDE8:
        b, h, t = b // 8 * 8, h // 8 * 8, t // 8 * 8
    return b, h, t


@triton.jit
def kv_head_offset(bh, H, G, stride_b, stride_h):
    """Element offset of the key/value head that query head divmod(bh, H) reads: each serves G query heads
    (grouped-query attention; G = 1 is one per query head)."""
    return (bh // H).to(tl.int64) * stride_b + ((bh % H) // G).to(tl.int64) * stride_h


@triton.jit
def query_tile_program(H, G, T, stride_kb, stride_kh, stride_vb, stride_vh, BLOCK_M: tl.constexpr):
    """A backward program over one query tile, grid (query tiles, heads): (batch·head, its key and value heads'
    offsets, its rows' offset in the (B·H, T) statistics, its query rows)."""
    bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return (bh, kv_head_offset(bh, H, G, stride_kb, stride_kh), kv_head_offset(bh, H, G, stride_vb, stride_vh),
            bh.to(tl.int64) * T, offs_m)


@triton.jit
def load_rows(ptr, offs, stride_t, T, HEAD_DIM: tl.constexpr, D_IN: tl.constexpr = 0):
    """A (len(offs), HEAD_DIM) tile of rows `offs` of one head; rows past T read as 0, and with D_IN (the inputs'
    head dim, below HEAD_DIM: padded in the kernel) so do the columns past it."""
    cols = tl.arange(0, HEAD_DIM)
    mask = offs[:, None] < T  # the mask before the addresses: the unpadded kernels' PTX as it was
    if D_IN:
        mask = mask & (cols[None, :] < D_IN)
    return tl.load(ptr + offs[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)


@triton.jit
def load_all_rows(ptr, offs, stride_t, HEAD_DIM: tl.constexpr, D_IN: tl.constexpr = 0):
    """`load_rows` where every row exists (no row mask): only a padded head dim's columns (D_IN) are masked."""
    cols = tl.arange(0, HEAD_DIM)
    if D_IN:
        t = tl.load(ptr + offs[:, None] * stride_t + cols[None, :], mask=cols[None, :] < D_IN, other=0.0)
    else:
        t = tl.load(ptr + offs[:, None] * stride_t + cols[None, :])
    return t


@triton.jit
def load_lse(LSE, offs, T):
    """Saved lse; rows with no visible key (-inf) become +inf, so that their P is 0."""
    lse = tl.load(LSE + offs, mask=offs < T, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def store_rows(ptr, x, offs, stride_t, T, HEAD_DIM: tl.constexpr, D_IN: tl.constexpr = 0):
    """Rows `offs` of one head, cast to the pointer's dtype with round-to-nearest-even; rows past T skipped, and with
    D_IN (a head dim padded in the kernel) the columns past it."""
    cols = tl.arange(0, HEAD_DIM)
    mask = offs[:, None] < T
    if D_IN:
        mask = mask & (cols[None, :] < D_IN)
    tl.store(ptr + offs[:, None] * stride_t + cols[None, :], cast(x, ptr.dtype.element_ty), mask=mask)


# A packed batch's sequences (SEG) reach the kernels as one (4, T + TK) int32 table, row stride `stride_keep`:
# columns 0..T-1 the queries, T..T+TK-1 the keys; rows: the sequence's index, the other side's first position in
# it, the other side's end, and the sequence's shift (its keys' end minus its queries' end: causal alignment to each
# sequence's bottom right).


@triton.jit
def key_tags(KEEP_ROW, offs_n, TK, PAD: tl.constexpr):
    """Each key's tag: its byte of the key-padding row (1 = a real key) or, from its column of a packed batch's
    table (KEEP_ROW there points at the keys' columns), its sequence's index (PAD), else 1. A query sees a key only
    where their tags agree (`query_tags`)."""
    if PAD:
        tags = tl.load(KEEP_ROW + offs_n, mask=(offs_n >= 0) & (offs_n < TK), other=0).to(tl.int32)
    else:
        tags = tl.full(offs_n.shape, 1, tl.int32)
    return tags


@triton.jit
def query_tags(KEEP_ROW, stride, offs_m, T, TK, SEG: tl.constexpr):
    """(tags, aligned) of each query: its tag, its sequence's index in a packed batch (SEG) or 1 (padding: a real
    key's tag), and its position in the keys' frame, i + TK - T, or in a packed batch i plus its sequence's shift."""
    if SEG:
        ok = offs_m < T
        tags = tl.load(KEEP_ROW + offs_m, mask=ok, other=-1)
        aligned = offs_m + tl.load(KEEP_ROW + 3 * stride + offs_m, mask=ok, other=0)
    else:
        tags = tl.full(offs_m.shape, 1, tl.int32)
        aligned = offs_m + (TK - T)
    return tags, aligned


@triton.jit
def _seen_range(seen, lo, hi):
    """The union [min lo, max hi) of the rows that see something, or [0, 0). An empty range must not start near
    2^31: a loop over it is still pipelined, and the pipeliner's next iterates (lo + a tile, predicated on being
    below hi) overflow to negative offsets that pass that test and every mask, and read out of bounds."""
    hi = tl.max(tl.where(seen, hi, 0), 0)
    return tl.minimum(tl.min(tl.where(seen, lo, 2147483647), 0), hi), hi


@triton.jit
def packed_keys(KEEP_ROW, stride, offs_m, T, aligned, LEFT, RIGHT):
    """[lo, hi) of the keys that queries offs_m of a packed batch see: each in its sequence's keys, within the band
    from its aligned position (`query_tags`); lo = hi = 0 where none sees a key. lo is not rounded to a tile."""
    ok = offs_m < T
    start = tl.load(KEEP_ROW + stride + offs_m, mask=ok, other=0)
    end = tl.load(KEEP_ROW + 2 * stride + offs_m, mask=ok, other=0)
    lo = tl.where(LEFT >= 0, tl.maximum(start, aligned - LEFT), start)
    hi = tl.where(RIGHT >= 0, tl.minimum(end, aligned + RIGHT + 1), end)
    return _seen_range(ok & (lo < hi), lo, hi)


@triton.jit
def packed_queries(KEY_ROW, stride, offs_n, TK, LEFT, RIGHT):
    """[lo, hi) of the queries that see keys offs_n of a packed batch (KEY_ROW: the table at the keys' columns):
    query i sees key j of its sequence where -LEFT <= j - (i + shift) <= RIGHT; lo = hi = 0 where none does."""
    ok = offs_n < TK
    start = tl.load(KEY_ROW + stride + offs_n, mask=ok, other=0)
    end = tl.load(KEY_ROW + 2 * stride + offs_n, mask=ok, other=0)
    shifted = offs_n - tl.load(KEY_ROW + 3 * stride + offs_n, mask=ok, other=0)
    lo = tl.where(RIGHT >= 0, tl.maximum(start, shifted - RIGHT), start)
    hi = tl.where(LEFT >= 0, tl.minimum(end, shifted + LEFT + 1), end)
    return _seen_range(ok & (lo < hi), lo, hi)


@triton.jit
def band_visible(offs_m, offs_n, T, TK, LEFT, RIGHT, qtags, ktags, aligned):
    """(queries, keys) pairs a masked call shows: query i of T and key j of TK at distance d = j - aligned_i
    (`query_tags`: i + TK - T, causal alignment to the bottom right), inside both lengths, with -LEFT <= d <= RIGHT
    (-1: unbounded; causal is RIGHT = 0), their tags agreeing."""
    d = offs_n[None, :] - aligned[:, None]
    band = ((LEFT < 0) | (d >= -LEFT)) & ((RIGHT < 0) | (d <= RIGHT))
    return band & (offs_m[:, None] < T) & (offs_n[None, :] < TK) & (qtags[:, None] == ktags[None, :])


@triton.jit
def band_visible_t(offs_n, offs_m, T, TK, LEFT, RIGHT, qtags, ktags, aligned):
    """`band_visible` as (keys, queries), the dK/dV kernel's orientation."""
    d = offs_n[:, None] - aligned[None, :]
    band = ((LEFT < 0) | (d >= -LEFT)) & ((RIGHT < 0) | (d <= RIGHT))
    return band & (offs_m[None, :] < T) & (offs_n[:, None] < TK) & (ktags[:, None] == qtags[None, :])


@triton.jit
def band_keys(start_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, T, TK, LEFT, RIGHT):
    """The key range [lo, hi) a query tile's band can see, lo on a key tile's start."""
    offset = TK - T
    last = tl.minimum(start_m + BLOCK_M, T) - 1
    lo = tl.where(LEFT >= 0, tl.maximum(start_m + offset - LEFT, 0), 0)
    hi = tl.where(RIGHT >= 0, tl.minimum(last + offset + RIGHT + 1, TK), TK)
    return (lo // BLOCK_N) * BLOCK_N, hi


@triton.jit
def band_queries(start_n, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, T, TK, LEFT, RIGHT):
    """The query range [lo, hi) whose band sees some key of a key tile, lo on a query tile's start."""
    offset = TK - T
    last = tl.minimum(start_n + BLOCK_N, TK) - 1
    lo = tl.where(RIGHT >= 0, tl.maximum(start_n - offset - RIGHT, 0), 0)
    hi = tl.where(LEFT >= 0, tl.minimum(last - offset + LEFT + 1, T), T)
    return (lo // BLOCK_M) * BLOCK_M, hi


@triton.jit
def visible(offs_m, offs_n, T, CAUSAL: tl.constexpr):
    """(queries, keys) pairs inside the sequence, and at or below the diagonal when causal: the backward's mask."""
    valid = (offs_m[:, None] < T) & (offs_n[None, :] < T)
    if CAUSAL:
        valid = valid & (offs_m[:, None] >= offs_n[None, :])
    return valid


@triton.jit
def round_up_bf16(x):
    """Round fp32 toward +inf to a bf16 value (kept fp32): SFA's m must not round below its shift."""
    bits = x.to(tl.int32, bitcast=True)
    up = tl.where(x > 0, (bits + 65535) & -65536, bits & -65536)
    return up.to(tl.float32, bitcast=True)


@triton.jit
def sfa_max(rm, repeated, BETA: tl.constexpr, LOW: tl.constexpr, HIGH: tl.constexpr,
            BOUNDED: tl.constexpr, ROUND_UP_BF16: tl.constexpr):
    """SFA's row maximum m from the tile maximum rm and whether the row repeats it (see `stabilize.SFA`)."""
    if BOUNDED:
        # the paper's shift m - rm ((beta - 1) rm, or -rm below 0), kept in [LOW, HIGH] and checked after rounding.
        # A repeated maximum is finite or +inf (near-max tests are false on NaN and -inf); +inf's shift is NaN, and
        # its m fails the final test as a non-finite rm fails the reference's: one test in place of a finiteness one
        shift = tl.where(rm > 0, BETA * rm, 0.0) - rm
        m = rm + tl.minimum(tl.maximum(shift, LOW), HIGH)
        if ROUND_UP_BF16:
            m = round_up_bf16(m)
        actual = m - rm
        m = tl.where(repeated & (actual >= LOW) & (actual <= HIGH), m, rm)
    else:
        m = tl.where(repeated & (rm > 0), BETA * rm, rm)
        m = tl.where(repeated & (rm < 0), 0.0, m)
    return m


@triton.jit
def shift(m):
    """Rows that have seen no finite score keep m = -inf; shift them by 0 so exp gives 0, not NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def top2(a1, a2, b1, b2):
    """Combine of a (largest, second largest) pair reduction; a repeated maximum is its own second."""
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2))


@triton.jit
def row_flags(repeated, positive):
    """A row's statistics flags for one tile (OR them over the tiles; `add_stats` counts them): bit 0 its maximum
    repeats, bit 1 a positive maximum repeats; bit 2 (`BIASABLE`) it is biasable (`stats.AttentionStats`)."""
    return repeated.to(tl.int32) | ((repeated & positive).to(tl.int32) << 1)


BIASABLE = tl.constexpr(4)


@triton.jit
def stats_combine(a_repeated, a_positive, a_biasable, a_ones, a_max, b_repeated, b_positive, b_biasable, b_ones,
                  b_max):
    """The statistics' per-program reduction: four counts and a maximum in one pass."""
    return (a_repeated + b_repeated, a_positive + b_positive, a_biasable + b_biasable, a_ones + b_ones,
            tl.maximum(a_max, b_max))


@triton.jit
def add_stats(STAT_COUNTS, STAT_MAX, h, flags, ones, smax, row_ok, rows_seen, UNITS: tl.constexpr):
    """Add one program's statistics to its head's totals (STAT_COUNTS, (H, 5) int64 in `stats.STAT_COLUMNS`' order:
    rows with a repeated maximum, with a positive one, P̄ = 1 entries, rows seen, biasable rows; the rows' `row_flags`
    ORed over their tiles) and the largest score (STAT_MAX, (H,); divided by UNITS, the scores' units per natural
    unit: log2(e) natively, 1 under emulation)."""
    # one reduction over the rows for all (cross-warp: one round of shared memory and barriers, not five)
    flags = tl.where(row_ok, flags, 0)
    n_repeated, n_positive, n_biasable, n_ones, row_max = tl.reduce(
        (flags & 1, (flags >> 1) & 1, (flags >> 2) & 1, tl.where(row_ok, ones, 0),
         tl.where(row_ok, smax, float("-inf"))), 0, stats_combine)
    # relaxed: the counters need atomicity, not ordering (the default acq_rel fences every program's end)
    counts = STAT_COUNTS + h * 5
    tl.atomic_add(counts, n_repeated.to(tl.int64), sem="relaxed")
    tl.atomic_add(counts + 1, n_positive.to(tl.int64), sem="relaxed")
    tl.atomic_add(counts + 2, n_ones.to(tl.int64), sem="relaxed")
    tl.atomic_add(counts + 3, rows_seen.to(tl.int64), sem="relaxed")
    tl.atomic_add(counts + 4, n_biasable.to(tl.int64), sem="relaxed")
    tl.atomic_max(STAT_MAX + h, row_max / UNITS, sem="relaxed")
