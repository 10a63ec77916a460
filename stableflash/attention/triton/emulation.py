"""The emulation kernels: every rounding point of a `Precision`, as the reference (`attention.reference`) makes it.

Each site and each elementwise operation between sites takes a compile-time rounding code `R_*` (`spec.KernelSpec`:
a format, fp32 to e8m3, and a mode, nearest-even or toward zero), and the policy's logical tiles (LT keys in the
forward, LQ queries or LT keys in the backward) are built from physical tiles of `spec.PHYSICAL_TILE`. The forward
makes two or three passes over each logical tile: its maximum, its near-maximum count (only for SFA or the
statistics), then P̄ and P̄V.

With `MASK`, TK keys against T queries in a band (causal aligned to the bottom right, a window: `LEFT`, `RIGHT`) and,
with `PAD`, a key-padding mask (`KEEP`, (B, TK) bytes), as the native kernels take them: the forward visits the
logical key tiles the reference visits for the logical query tile its rows are in (`Visibility.skips`: a visit
rounds the accumulator again), the backward those its own rows or keys see (a hidden tile adds exact zeros there).
`D_IN` pads a narrower head dim inside the kernel, as the native kernels do (zero columns: the same bits as padding
by hand). Exponentials are libdevice's `exp` in natural units, as torch computes them. Bit-equal to the reference is the aim
and what the tests check; speed comes second.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from stableflash.attention.precision import SITE_INDEX
from stableflash.attention.stats import TAIL_FLOOR
from stableflash.attention.triton.common import (
    _INTERPRET,
    BIASABLE,
    add_stats,
    band_visible,
    band_visible_t,
    cast,
    dot,
    fp32,
    head_offset,
    key_tags,
    kv_head_offset,
    load_lse,
    load_rows,
    mul_rn,
    query_tile_program,
    row_flags,
    row_strides,
    sfa_max,
    shift,
    store_rows,
    visible,
)

_PBAR_OP, _PV, _ACC_SCALED, _ACC = (tl.constexpr(SITE_INDEX[s]) for s in ("pbar_operand", "pv", "acc_scaled", "acc"))
_TILE_SUM, _ROW_SUM, _ROW_SUM_SAVED = (tl.constexpr(SITE_INDEX[s]) for s in ("tile_sum", "row_sum", "row_sum_saved"))
_OUT, _DELTA_TERMS, _DELTA = (tl.constexpr(SITE_INDEX[s]) for s in ("out", "delta_terms", "delta"))
_TAIL_FLOOR = tl.constexpr(TAIL_FLOOR)  # a biasable row's least tail per P̄ = 1 (`stats.biasable_in_tile`)


@triton.jit
def _drop_bits(x, SHIFT: tl.constexpr, TOWARD_ZERO: tl.constexpr):
    """fp32 rounded to SHIFT fewer fraction bits, to nearest-even or toward zero, kept fp32: a format with fp32's
    (and bf16's) exponent. On the bits: subnormals, overflow to inf and the sign come out right; NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    if TOWARD_ZERO:
        bits = bits & ~((1 << SHIFT) - 1)
    else:
        bits = (bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)) & ~((1 << SHIFT) - 1)
    return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def _round(x, CODE: tl.constexpr):
    """Round an fp32 tensor to the format and mode of CODE (`spec`: format + 8 * mode), keeping it fp32. Formats:
    0 fp32 (unchanged), 1 bf16, 2 fp16, 3-6 e8m6-e8m3; modes: 0 nearest-even, 1 toward zero (not for fp16)."""
    tl.static_assert(CODE < 16, "stochastic rounding needs each element's position: `_round_at`")
    if CODE == 1:
        if _INTERPRET:  # its bf16 tensors lose the subnormals' last bits: stay in fp32
            x = _drop_bits(x, 16, False)
        else:
            x = cast(x, tl.bfloat16).to(tl.float32)
    elif CODE == 2:
        x = x.to(tl.float16).to(tl.float32)
    elif CODE == 9:
        x = _drop_bits(x, 16, True)
    elif CODE % 8 >= 3:  # e8m(9 - format): 23 - (9 - format) bits dropped
        x = _drop_bits(x, 14 + CODE % 8, CODE >= 8)
    return x


@triton.jit
def _mix(x):
    """`numerics.rounding._mix` in uint32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x68E31DA5
    return x ^ (x >> 16)


@triton.jit
def _counter_bits(seed, SITE: tl.constexpr, bh, row, col, tile):
    """`numerics.rounding.counter_bits`: 32 random bits from (seed, site, batch·head, row, column, tile)."""
    # tl.cast also takes the arguments Triton specialises to compile-time constants (an int equal to 1)
    h = _mix(tl.cast(seed, tl.uint32) + tl.cast((SITE * 0x1B873593) % 4294967296, tl.uint32))
    h = _mix(h ^ tl.cast(bh, tl.uint32))
    h = _mix(h ^ tl.cast(row, tl.uint32))
    h = _mix(h ^ tl.cast(col, tl.uint32))
    return _mix(h ^ tl.cast(tile, tl.uint32))


@triton.jit
def _stochastic(x, SHIFT: tl.constexpr, r):
    """fp32 rounded to SHIFT fewer fraction bits, up with probability of the dropped bits' share: the top SHIFT bits
    of `r` added to the dropped ones (`round_to(..., noise=counter_noise(r, ...))` on the bits)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (r >> (32 - SHIFT)).to(tl.int32)) & ~((1 << SHIFT) - 1)
    return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def _round_at(x, CODE: tl.constexpr, seed, SITE: tl.constexpr, bh, row, col, tile):
    """`_round`, and stochastic rounding (mode 2) with the bits of each element's position."""
    if CODE // 8 == 2:
        r = _counter_bits(seed, SITE, bh, row, col, tile)
        if CODE % 8 == 1:
            x = _stochastic(x, 16, r)
        else:
            x = _stochastic(x, 14 + CODE % 8, r)
    else:
        x = _round(x, CODE)
    return x


@triton.jit
def _exp(x):
    """libdevice's expf (CUDA's exp, within 2 ulp), not the fast ex2.approx. The `add.rn` of +0 (an identity on exp's
    results) keeps exp's last multiply from fusing into the caller's next sum, a rounding the reference makes."""
    if _INTERPRET:
        y = tl.exp(x)
    else:
        y = libdevice.add_rn(libdevice.exp(x), 0.0)
    return y


@triton.jit
def _log(x):
    if _INTERPRET:
        y = tl.log(x)
    else:
        y = libdevice.log(x)
    return y


@triton.jit
def _band_tiles(first, last, TILE, T, TK, LEFT, RIGHT):
    """[lo, hi): the key tiles of TILE keys (lo on a tile's start) that some query of first..last sees in the band,
    as `Visibility.skips` decides (padding not counted); empty where none does."""
    offset = TK - T
    lo = tl.where(LEFT >= 0, tl.maximum(first + offset - LEFT, 0), 0)
    hi = tl.where(RIGHT >= 0, tl.minimum(last + offset + RIGHT + 1, TK), TK)
    return tl.where(lo < hi, (lo // TILE) * TILE, hi), hi


@triton.jit
def _band_query_tiles(first, last, TILE, T, TK, LEFT, RIGHT):
    """[lo, hi): the query tiles of TILE queries (lo on a tile's start) some key of first..last is visible to."""
    offset = TK - T
    lo = tl.where(RIGHT >= 0, tl.maximum(first - offset - RIGHT, 0), 0)
    hi = tl.where(LEFT >= 0, tl.minimum(last - offset + LEFT + 1, T), T)
    return tl.where(lo < hi, (lo // TILE) * TILE, hi), hi


@triton.jit
def _visible(offs_m, offs_n, T, TK, LEFT, RIGHT, keep_row, CAUSAL: tl.constexpr, MASK: tl.constexpr,
             PAD: tl.constexpr):
    """(queries, keys) pairs shown: in the band and not padding (MASK), else keys inside TK (= T) and, when causal,
    at or below the diagonal."""
    if MASK:
        real = tl.full(offs_m.shape, 1, tl.int32)  # a query's tag: a real key's
        valid = band_visible(offs_m, offs_n, T, TK, LEFT, RIGHT, real, key_tags(keep_row, offs_n, TK, PAD),
                             offs_m + (TK - T))
    else:
        valid = offs_n[None, :] < TK
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
    return valid


@triton.jit
def _scores(q, K, k_off, start_n, offs_m, T, TK, stride_kt, scale, LEFT, RIGHT, keep_row, BLOCK_N: tl.constexpr,
            HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr, PAD: tl.constexpr,
            OPS_FP32: tl.constexpr, R_QK: tl.constexpr, R_SCORES: tl.constexpr, D_IN: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of scores, rounded as the policy says; the keys `_visible` hides at -inf."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if D_IN:  # a head dim padded in the kernel: the columns past it read as 0
        kt = tl.load(K + k_off + offs_n[None, :] * stride_kt + tl.arange(0, HEAD_DIM)[:, None],
                     mask=(offs_n[None, :] < TK) & (tl.arange(0, HEAD_DIM)[:, None] < D_IN), other=0.0)
    else:
        kt = tl.load(K + k_off + offs_n[None, :] * stride_kt + tl.arange(0, HEAD_DIM)[:, None],
                     mask=offs_n[None, :] < TK, other=0.0)
    qk = dot(q, kt, tl.zeros((q.shape[0], BLOCK_N), tl.float32), OPS_FP32)
    s = _round(_round(mul_rn(_round(qk, R_QK), scale), R_QK), R_SCORES)
    return tl.where(_visible(offs_m=offs_m, offs_n=offs_n, T=T, TK=TK, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row,
                             CAUSAL=CAUSAL, MASK=MASK, PAD=PAD), s, float("-inf"))


@triton.jit
def _near_max(s, rm, eps):
    """Per row: how many finite scores lie within eps of the row maximum rm (which spans the logical tile)."""
    # -inf scores give gap +inf, and a row of -inf gives NaN: neither passes the test
    return tl.sum(((rm[:, None] - s) <= eps).to(tl.int32), 1)


# -- forward ---------------------------------------------------------------------------------------------------------

# the seed changes every call: one compiled kernel for all of them (Triton would specialise an int on its value's
# divisibility by 16 and on being 1, and a launch decided for one seed is made again with the next)
@triton.jit(do_not_specialize=["seed"])
def _attn_fwd(
    Q, K, V, O, OS, LSE, STAT_COUNTS, STAT_MAX, q_strides, k_strides, v_strides, o_strides, H, G, T, scale, eps, LT,
    seed, band, LM,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    OPS_FP32: tl.constexpr, SAVE_OS: tl.constexpr, STAB: tl.constexpr, STATS: tl.constexpr, BETA: tl.constexpr,
    LOW: tl.constexpr, HIGH: tl.constexpr, BOUNDED: tl.constexpr, CLAMP_CEIL: tl.constexpr, TILE_CLAMP: tl.constexpr,
    R_QK: tl.constexpr, R_SCORES: tl.constexpr, R_ROW_MAX: tl.constexpr, R_SUB: tl.constexpr,
    R_PBAR: tl.constexpr, R_PBAR_OP: tl.constexpr, R_TILE_SUM: tl.constexpr, R_PV: tl.constexpr,
    R_RESCALE: tl.constexpr, R_L1: tl.constexpr, R_L2: tl.constexpr, R_ROW_SUM: tl.constexpr,
    R_A1: tl.constexpr, R_A2: tl.constexpr, R_ACC: tl.constexpr, R_L_SAVED: tl.constexpr, R_DIV: tl.constexpr,
    R_OUT: tl.constexpr, R_LSE: tl.constexpr, R_LSE_ADD: tl.constexpr, R_V_OP: tl.constexpr, R_THRESHOLD: tl.constexpr,
    OFFICIAL: tl.constexpr, TAIL_LIMIT: tl.constexpr, MASK: tl.constexpr = False, PAD: tl.constexpr = False,
    D_IN: tl.constexpr = 0, STRIDE8: tl.constexpr = False,
):
    """O (and, with SAVE_OS, the fp32 O the backward reads for δ into OS) and the natural-unit lse of one query tile.
    `seed`: the call's stochastic rounding seed (unused without it); LM: the logical query tile (read under MASK).

    With OFFICIAL, SFA is the paper's code's rule (`SFA.official()`): its near-maximum test S >= rm - eps (rm - eps
    rounded as an operation on m: R_THRESHOLD), on every logical key tile, those that no row of the tile sees
    included (there every score is the mask's -inf, a "repeated maximum" below 0, so m becomes max(m, 0)). With
    STATS, TAIL_LIMIT is `stats.tail_limit` of P̄V's format (0: no row is biasable)."""
    stride_qb, stride_qh, stride_qt = row_strides(q_strides, STRIDE8)
    stride_kb, stride_kh, stride_kt = row_strides(k_strides, STRIDE8)
    stride_vb, stride_vh, stride_vt = row_strides(v_strides, STRIDE8)
    stride_ob, stride_oh, stride_ot = row_strides(o_strides, STRIDE8)
    KEEP, stride_keep, TK, LEFT, RIGHT = band
    scale, eps = fp32(scale), fp32(eps)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    k_off = kv_head_offset(bh, H, G, stride_kb, stride_kh)
    v_off = kv_head_offset(bh, H, G, stride_vb, stride_vh)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = load_rows(Q + head_offset(bh, H, stride_qb, stride_qh), offs_m, stride_qt, T, HEAD_DIM, D_IN)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    flags = tl.zeros((BLOCK_M,), tl.int32)  # the statistics (`common.row_flags`)
    ones = tl.zeros((BLOCK_M,), tl.int32)
    smax = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    keep_row = KEEP + (bh // H).to(tl.int64) * stride_keep
    if OFFICIAL:  # every key tile, as the official rule visits them
        lo = 0
        hi = TK
    elif MASK:  # the key tiles the reference visits for the logical query tile these rows are in
        first = (pid_m * BLOCK_M // LM) * LM
        lo, hi = _band_tiles(first, tl.minimum(first + LM, T) - 1, LT, T, TK, LEFT, RIGHT)
    else:
        lo = 0
        hi = tl.minimum(T, (pid_m + 1) * BLOCK_M) if CAUSAL else T

    for lt in range(lo, hi, LT):
        lt_end = tl.minimum(lt + LT, hi)
        # pass 1: the logical tile's row maximum
        rm = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        for start_n in range(lt, lt_end, BLOCK_N):
            s = _scores(q=q, K=K, k_off=k_off, start_n=start_n, offs_m=offs_m, T=T, TK=TK, stride_kt=stride_kt,
                        scale=scale, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                        CAUSAL=CAUSAL, MASK=MASK, PAD=PAD, OPS_FP32=OPS_FP32, R_QK=R_QK, R_SCORES=R_SCORES,
                        D_IN=D_IN)
            rm = tl.maximum(rm, tl.max(s, 1))
        rm = _round(rm, R_ROW_MAX)
        # pass 2 (SFA or statistics): near-maximum counts against the whole tile's maximum
        if STATS or STAB == 1:
            rs = tl.zeros((BLOCK_M,), tl.int32)
            rs_official = tl.zeros((BLOCK_M,), tl.int32)
            threshold = _round(rm - eps, R_THRESHOLD)
            for start_n in range(lt, lt_end, BLOCK_N):
                s = _scores(q=q, K=K, k_off=k_off, start_n=start_n, offs_m=offs_m, T=T, TK=TK, stride_kt=stride_kt,
                            scale=scale, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                            CAUSAL=CAUSAL, MASK=MASK, PAD=PAD, OPS_FP32=OPS_FP32, R_QK=R_QK, R_SCORES=R_SCORES,
                            D_IN=D_IN)
                rs += _near_max(s, rm, eps)
                if OFFICIAL:  # real keys only: the reference's tile ends at TK
                    real = (start_n + tl.arange(0, BLOCK_N)) < TK
                    rs_official += tl.sum(((s >= threshold[:, None]) & real[None, :]).to(tl.int32), 1)
                if STATS:
                    smax = tl.maximum(smax, tl.max(tl.where(s < float("inf"), s, float("-inf")), 1))
            if STATS:
                flags = flags | row_flags(rs > 1, rm > 0)
            if STAB == 1:
                rs_sfa = rs_official if OFFICIAL else rs
                rm = _round(sfa_max(rm, rs_sfa > 1, BETA, LOW, HIGH, BOUNDED, R_ROW_MAX == 1), R_ROW_MAX)
        m_new = _round(tl.maximum(rm, m), R_ROW_MAX)
        m_shift = shift(m_new)
        # pass 3: P̄, its row sum and P̄V over the logical tile
        tile_sum = tl.zeros((BLOCK_M,), tl.float32)
        tile_ones = tl.zeros((BLOCK_M,), tl.int32)
        operand_sum = tl.zeros((BLOCK_M,), tl.float32)  # P̄ as P̄V reads it, summed: a biasable row's test
        pv = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        for start_n in range(lt, lt_end, BLOCK_N):
            s = _scores(q=q, K=K, k_off=k_off, start_n=start_n, offs_m=offs_m, T=T, TK=TK, stride_kt=stride_kt,
                        scale=scale, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                        CAUSAL=CAUSAL, MASK=MASK, PAD=PAD, OPS_FP32=OPS_FP32, R_QK=R_QK, R_SCORES=R_SCORES,
                        D_IN=D_IN)
            p = _round(_exp(_round(s - m_shift[:, None], R_SUB)), R_PBAR)
            if STAB == 2:
                p = tl.minimum(p, CLAMP_CEIL)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            p_op = _round_at(p, R_PBAR_OP, seed, _PBAR_OP, bh, offs_m[:, None], offs_n[None, :], 0)
            if STATS:
                tile_ones += tl.sum((p_op == 1.0).to(tl.int32), 1)
                operand_sum += tl.sum(p_op, 1)
            tile_sum += tl.sum(p, 1)
            v = load_rows(V + v_off, offs_n, stride_vt, TK, HEAD_DIM, D_IN)
            if R_V_OP != 0:  # V as P̄V reads it, in a format of its own (its values are V's dtype's, or fp32)
                v = _round(v.to(tl.float32), R_V_OP)
            if OPS_FP32:
                pv = dot(p_op, v, pv, True)
            else:
                pv = dot(cast(p_op, V.dtype.element_ty), v.to(V.dtype.element_ty), pv, False)
        if STATS:
            ones += tile_ones
            tail = operand_sum - tile_ones.to(tl.float32)
            n = tile_ones.to(tl.float32)
            biasable = (tile_ones >= 2) & (tail >= n * _TAIL_FLOOR) & (tail < n * TAIL_LIMIT)
            flags = flags | (biasable.to(tl.int32) * BIASABLE)
        t = lt // LT  # the logical key tile's ordinal: stochastic rounding's counter
        rows, cols = offs_m[:, None], tl.arange(0, HEAD_DIM)[None, :]
        tile_sum = _round_at(tile_sum, R_TILE_SUM, seed, _TILE_SUM, bh, offs_m, 0, t)
        if TILE_CLAMP > 0:
            tile_sum = tl.maximum(tile_sum, TILE_CLAMP)
        pv = _round_at(pv, R_PV, seed, _PV, bh, rows, cols, t)
        rescale = _round(_exp(_round(m - m_shift, R_ROW_MAX)), R_RESCALE)
        l = _round_at(_round(_round(mul_rn(rescale, l), R_L1) + tile_sum, R_L2), R_ROW_SUM, seed, _ROW_SUM, bh, offs_m,
                      0, t)
        acc_scaled = _round_at(mul_rn(acc, rescale[:, None]), R_A1, seed, _ACC_SCALED, bh, rows, cols, t)
        acc = _round_at(_round(acc_scaled + pv, R_A2), R_ACC, seed, _ACC, bh, rows, cols, t)
        m = m_new

    empty = m == float("-inf")  # rows that see no key: O = 0, lse = -inf
    l = _round_at(l, R_L_SAVED, seed, _ROW_SUM_SAVED, bh, offs_m, 0, 0)  # what the division and the lse read
    o = _round(acc / tl.where(empty, 1.0, l)[:, None], R_DIV)
    o = tl.where(empty[:, None], 0.0, o)
    o_off = head_offset(bh, H, stride_ob, stride_oh)
    # the `out` site's format and mode (the store's own cast rounds to nearest), with bits from each element's place
    store_rows(O + o_off, _round_at(o, R_OUT, seed, _OUT, bh, offs_m[:, None], tl.arange(0, HEAD_DIM)[None, :], 0),
               offs_m, stride_ot, T, HEAD_DIM, D_IN)
    if SAVE_OS:
        store_rows(OS + o_off, o, offs_m, stride_ot, T, HEAD_DIM, D_IN)
    log_l = _round(_log(l), R_LSE)
    lse = tl.where(empty, float("-inf"), _round(_round(log_l + m, R_LSE_ADD), R_LSE))
    row_ok = offs_m < T
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, lse, mask=row_ok)
    if STATS:
        add_stats(STAT_COUNTS, STAT_MAX, bh % H, flags, ones, smax, row_ok, tl.minimum(T - pid_m * BLOCK_M, BLOCK_M),
                  1.0)


# -- backward --------------------------------------------------------------------------------------------------------

@triton.jit
def _probs(q, k, lse, offs_m, offs_n, T, TK, LEFT, RIGHT, keep_row, scale, CAUSAL: tl.constexpr,
           MASK: tl.constexpr, PAD: tl.constexpr, OPS_FP32: tl.constexpr, R_QK: tl.constexpr, R_SCORES: tl.constexpr,
           R_P_SUB: tl.constexpr, R_P: tl.constexpr):
    """P for one (queries, keys) tile, recomputed from the saved natural-unit lse."""
    qk = dot(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), tl.float32), OPS_FP32)
    s = _round(_round(mul_rn(_round(qk, R_QK), scale), R_QK), R_SCORES)
    p = _round(_exp(_round(s - lse[:, None], R_P_SUB)), R_P)
    if MASK:
        valid = _visible(offs_m=offs_m, offs_n=offs_n, T=T, TK=TK, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row,
                         CAUSAL=False, MASK=True, PAD=PAD)
    else:
        valid = visible(offs_m, offs_n, T, CAUSAL)
    return tl.where(valid, p, 0.0)


@triton.jit
def _probs_t(k, q, lse, offs_n, offs_m, T, TK, LEFT, RIGHT, keep_row, scale, CAUSAL: tl.constexpr,
             MASK: tl.constexpr, PAD: tl.constexpr, OPS_FP32: tl.constexpr, R_QK: tl.constexpr,
             R_SCORES: tl.constexpr, R_P_SUB: tl.constexpr, R_P: tl.constexpr):
    """Pᵀ for one (keys, queries) tile: the dK/dV kernel's orientation of `_probs`."""
    qkt = dot(k, tl.trans(q), tl.zeros((k.shape[0], q.shape[0]), tl.float32), OPS_FP32)
    s = _round(_round(mul_rn(_round(qkt, R_QK), scale), R_QK), R_SCORES)
    pt = _round(_exp(_round(s - lse[None, :], R_P_SUB)), R_P)
    if MASK:
        real = tl.full(offs_m.shape, 1, tl.int32)
        valid = band_visible_t(offs_n, offs_m, T, TK, LEFT, RIGHT, real, key_tags(keep_row, offs_n, TK, PAD),
                               offs_m + (TK - T))
    else:
        valid = (offs_m[None, :] < T) & (offs_n[:, None] < T)
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
    return tl.where(valid, pt, 0.0)


@triton.jit
def _p_dp(q, do, lse, K, V, k_off, v_off, start_n, offs_m, T, TK, LEFT, RIGHT, keep_row, stride_kt, stride_vt,
          qk_scale, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,
          PAD: tl.constexpr, OPS_FP32: tl.constexpr, R_QK: tl.constexpr, R_SCORES: tl.constexpr,
          R_P_SUB: tl.constexpr, R_P: tl.constexpr, R_DP: tl.constexpr, D_IN: tl.constexpr):
    """For the query rows `offs_m` and the key tile at `start_n`: its keys k, P (recomputed) and dP = dO Vᵀ."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(K + k_off, offs_n, stride_kt, TK, HEAD_DIM, D_IN)
    v = load_rows(V + v_off, offs_n, stride_vt, TK, HEAD_DIM, D_IN)
    p = _probs(q=q, k=k, lse=lse, offs_m=offs_m, offs_n=offs_n, T=T, TK=TK, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row,
               scale=qk_scale, CAUSAL=CAUSAL, MASK=MASK, PAD=PAD, OPS_FP32=OPS_FP32, R_QK=R_QK, R_SCORES=R_SCORES,
               R_P_SUB=R_P_SUB, R_P=R_P)
    dp = _round(dot(do, tl.trans(v), tl.zeros((do.shape[0], BLOCK_N), tl.float32), OPS_FP32), R_DP)
    return k, p, dp


@triton.jit
def _key_range(pid_m, T, TK, LT, LEFT, RIGHT, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr):
    """[lo, hi) of the keys a backward query tile visits, lo on a logical key tile's start: the band's (MASK), else
    up to the diagonal (causal) or all."""
    if MASK:
        lo, hi = _band_tiles(pid_m * BLOCK_M, tl.minimum((pid_m + 1) * BLOCK_M, T) - 1, LT, T, TK, LEFT, RIGHT)
    else:
        lo = 0
        hi = tl.minimum(T, (pid_m + 1) * BLOCK_M) if CAUSAL else T
    return lo, hi


@triton.jit
def _attn_bwd_delta_dpp(
    Q, K, V, DO, LSE, DELTA, q_strides, k_strides, v_strides, do_strides, H, G, T, qk_scale, LT, band,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    OPS_FP32: tl.constexpr, R_QK: tl.constexpr, R_SCORES: tl.constexpr, R_P_SUB: tl.constexpr,
    R_P: tl.constexpr, R_DP: tl.constexpr, R_DPP: tl.constexpr, R_TERMS: tl.constexpr, R_DELTA: tl.constexpr,
    MASK: tl.constexpr = False, PAD: tl.constexpr = False, D_IN: tl.constexpr = 0, STRIDE8: tl.constexpr = False,
):
    """δ = rowsum(dP ∘ P) (the `dp_p` formula) of one query tile: P and dP recomputed over every visible key,
    summed per logical key tile and added up with the policy's rounding, as the reference does."""
    stride_qb, stride_qh, stride_qt = row_strides(q_strides, STRIDE8)
    stride_kb, stride_kh, stride_kt = row_strides(k_strides, STRIDE8)
    stride_vb, stride_vh, stride_vt = row_strides(v_strides, STRIDE8)
    stride_dob, stride_doh, stride_dot = row_strides(do_strides, STRIDE8)
    KEEP, stride_keep, TK, LEFT, RIGHT = band
    qk_scale = fp32(qk_scale)
    pid_m = tl.program_id(0)
    bh, k_off, v_off, row_off, offs_m = query_tile_program(H, G, T, stride_kb, stride_kh, stride_vb, stride_vh, BLOCK_M)
    q = load_rows(Q + head_offset(bh, H, stride_qb, stride_qh), offs_m, stride_qt, T, HEAD_DIM, D_IN)
    do = load_rows(DO + head_offset(bh, H, stride_dob, stride_doh), offs_m, stride_dot, T, HEAD_DIM, D_IN)
    lse = load_lse(LSE + row_off, offs_m, T)
    delta = tl.zeros((BLOCK_M,), tl.float32)
    keep_row = KEEP + (bh // H).to(tl.int64) * stride_keep
    lo, hi = _key_range(pid_m, T, TK, LT, LEFT, RIGHT, BLOCK_M, CAUSAL, MASK)
    for lt in range(lo, hi, LT):
        part = tl.zeros((BLOCK_M,), tl.float32)
        for start_n in range(lt, tl.minimum(lt + LT, hi), BLOCK_N):
            _, p, dp = _p_dp(q=q, do=do, lse=lse, K=K, V=V, k_off=k_off, v_off=v_off, start_n=start_n, offs_m=offs_m,
                             T=T, TK=TK, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row, stride_kt=stride_kt,
                             stride_vt=stride_vt, qk_scale=qk_scale, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL,
                             MASK=MASK, PAD=PAD, OPS_FP32=OPS_FP32, R_QK=R_QK, R_SCORES=R_SCORES, R_P_SUB=R_P_SUB,
                             R_P=R_P, R_DP=R_DP, D_IN=D_IN)
            part += tl.sum(_round(_round(mul_rn(dp, p), R_DPP), R_TERMS), 1)
        delta = _round(delta + _round(part, R_DELTA), R_DELTA)
    tl.store(DELTA + row_off + offs_m, delta, mask=offs_m < T)


@triton.jit(do_not_specialize=["seed"])
def _attn_bwd_dq(
    Q, K, V, DO, O, LSE, DELTA, DQ, q_strides, k_strides, v_strides, do_strides, o_strides, g_strides, H, G, T,
    qk_scale, scale, LT, seed, band,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    OPS_FP32: tl.constexpr, DELTA_HERE: tl.constexpr, R_TERMS: tl.constexpr, R_DELTA: tl.constexpr,
    R_QK: tl.constexpr, R_SCORES: tl.constexpr, R_P_SUB: tl.constexpr, R_P: tl.constexpr,
    R_DP: tl.constexpr, R_DS1: tl.constexpr, R_DS2: tl.constexpr, R_DS: tl.constexpr, R_DS_OP: tl.constexpr,
    R_DQ_PART: tl.constexpr, R_DQ: tl.constexpr, MASK: tl.constexpr = False, PAD: tl.constexpr = False,
    D_IN: tl.constexpr = 0, STRIDE8: tl.constexpr = False,
):
    """dQ of one query tile, each logical key tile's part accumulated in fp32, then rounded and added as the reference
    does. With DELTA_HERE it first computes its rows' δ = rowsum(dO ∘ O) (each product rounded on its own) and
    stores it for the dK/dV kernel; else it reads the δ of the `dp_p` pass. `seed`: the backward's stochastic
    rounding seed (δ's sites; unused without it)."""
    stride_qb, stride_qh, stride_qt = row_strides(q_strides, STRIDE8)
    stride_kb, stride_kh, stride_kt = row_strides(k_strides, STRIDE8)
    stride_vb, stride_vh, stride_vt = row_strides(v_strides, STRIDE8)
    stride_dob, stride_doh, stride_dot = row_strides(do_strides, STRIDE8)
    stride_ob, stride_oh, stride_ot = row_strides(o_strides, STRIDE8)
    stride_gb, stride_gh, stride_gt = row_strides(g_strides, STRIDE8)
    KEEP, stride_keep, TK, LEFT, RIGHT = band
    qk_scale, scale = fp32(qk_scale), fp32(scale)
    pid_m = tl.program_id(0)
    bh, k_off, v_off, row_off, offs_m = query_tile_program(H, G, T, stride_kb, stride_kh, stride_vb, stride_vh, BLOCK_M)
    do = load_rows(DO + head_offset(bh, H, stride_dob, stride_doh), offs_m, stride_dot, T, HEAD_DIM, D_IN)
    if DELTA_HERE:
        o = load_rows(O + head_offset(bh, H, stride_ob, stride_oh), offs_m, stride_ot, T, HEAD_DIM, D_IN)
        terms = _round_at(mul_rn(do.to(tl.float32), o.to(tl.float32)), R_TERMS, seed, _DELTA_TERMS, bh,
                          offs_m[:, None], tl.arange(0, HEAD_DIM)[None, :], 0)
        delta = _round_at(tl.sum(terms, 1), R_DELTA, seed, _DELTA, bh, offs_m, 0, 0)
        tl.store(DELTA + row_off + offs_m, delta, mask=offs_m < T)
    else:
        delta = tl.load(DELTA + row_off + offs_m, mask=offs_m < T, other=0.0)
    q = load_rows(Q + head_offset(bh, H, stride_qb, stride_qh), offs_m, stride_qt, T, HEAD_DIM, D_IN)
    lse = load_lse(LSE + row_off, offs_m, T)
    dq_run = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    keep_row = KEEP + (bh // H).to(tl.int64) * stride_keep
    lo, hi = _key_range(pid_m, T, TK, LT, LEFT, RIGHT, BLOCK_M, CAUSAL, MASK)
    for lt in range(lo, hi, LT):
        dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        for start_n in range(lt, tl.minimum(lt + LT, hi), BLOCK_N):
            k, p, dp = _p_dp(q=q, do=do, lse=lse, K=K, V=V, k_off=k_off, v_off=v_off, start_n=start_n, offs_m=offs_m,
                             T=T, TK=TK, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row, stride_kt=stride_kt,
                             stride_vt=stride_vt, qk_scale=qk_scale, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL,
                             MASK=MASK, PAD=PAD, OPS_FP32=OPS_FP32, R_QK=R_QK, R_SCORES=R_SCORES, R_P_SUB=R_P_SUB,
                             R_P=R_P, R_DP=R_DP, D_IN=D_IN)
            ds = _round(_round(mul_rn(p, _round(dp - delta[:, None], R_DS1)), R_DS2), R_DS)
            if OPS_FP32:
                dq = dot(_round(ds, R_DS_OP), k, dq, True)
            else:
                dq = dot(cast(_round(ds, R_DS_OP), k.dtype), k, dq, False)
        dq_run = _round(dq_run + _round(mul_rn(_round(dq, R_DQ_PART), scale), R_DQ_PART), R_DQ)
    store_rows(DQ + head_offset(bh, H, stride_gb, stride_gh), dq_run, offs_m, stride_gt, T, HEAD_DIM, D_IN)


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, q_strides, k_strides, v_strides, do_strides, g_strides, H, G, T, qk_scale, scale,
    LQ, band,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    OPS_FP32: tl.constexpr, R_QK: tl.constexpr, R_SCORES: tl.constexpr, R_P_SUB: tl.constexpr, R_P: tl.constexpr,
    R_P_OP: tl.constexpr, R_DP: tl.constexpr, R_DS1: tl.constexpr, R_DS2: tl.constexpr, R_DS: tl.constexpr,
    R_DS_OP: tl.constexpr, R_DV_PART: tl.constexpr, R_DV: tl.constexpr, R_DK_PART: tl.constexpr, R_DK: tl.constexpr,
    MASK: tl.constexpr = False, PAD: tl.constexpr = False, D_IN: tl.constexpr = 0, STRIDE8: tl.constexpr = False,
):
    """dK and dV (both with strides `g_strides`) of one key tile: each logical query tile's part accumulated in fp32,
    then rounded and added as the reference does."""
    stride_qb, stride_qh, stride_qt = row_strides(q_strides, STRIDE8)
    stride_kb, stride_kh, stride_kt = row_strides(k_strides, STRIDE8)
    stride_vb, stride_vh, stride_vt = row_strides(v_strides, STRIDE8)
    stride_dob, stride_doh, stride_dot = row_strides(do_strides, STRIDE8)
    stride_gb, stride_gh, stride_gt = row_strides(g_strides, STRIDE8)
    KEEP, stride_keep, TK, LEFT, RIGHT = band
    qk_scale, scale = fp32(qk_scale), fp32(scale)
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    q_off = head_offset(bh, H, stride_qb, stride_qh)
    do_off = head_offset(bh, H, stride_dob, stride_doh)
    row_off = bh.to(tl.int64) * T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = load_rows(K + kv_head_offset(bh, H, G, stride_kb, stride_kh), offs_n, stride_kt, TK, HEAD_DIM, D_IN)
    v = load_rows(V + kv_head_offset(bh, H, G, stride_vb, stride_vh), offs_n, stride_vt, TK, HEAD_DIM, D_IN)
    dk_run = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv_run = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    keep_row = KEEP + (bh // H).to(tl.int64) * stride_keep
    if MASK:  # the query tiles that see these keys (BLOCK_M-aligned)
        lo, hi = _band_query_tiles(pid_n * BLOCK_N, tl.minimum((pid_n + 1) * BLOCK_N, TK) - 1, BLOCK_M, T, TK, LEFT,
                                   RIGHT)
    else:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
        hi = T
    for lq in range((lo // LQ) * LQ, hi, LQ):
        dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
        dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
        for start_m in range(tl.maximum(lq, lo), tl.minimum(lq + LQ, hi), BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = load_rows(Q + q_off, offs_m, stride_qt, T, HEAD_DIM, D_IN)
            do = load_rows(DO + do_off, offs_m, stride_dot, T, HEAD_DIM, D_IN)
            lse = load_lse(LSE + row_off, offs_m, T)
            delta = tl.load(DELTA + row_off + offs_m, mask=offs_m < T, other=0.0)
            pt = _probs_t(k=k, q=q, lse=lse, offs_n=offs_n, offs_m=offs_m, T=T, TK=TK, LEFT=LEFT, RIGHT=RIGHT,
                          keep_row=keep_row, scale=qk_scale, CAUSAL=CAUSAL, MASK=MASK, PAD=PAD, OPS_FP32=OPS_FP32,
                          R_QK=R_QK, R_SCORES=R_SCORES, R_P_SUB=R_P_SUB, R_P=R_P)
            if OPS_FP32:
                dv = dot(_round(pt, R_P_OP), do, dv, True)
            else:
                dv = dot(cast(_round(pt, R_P_OP), do.dtype), do, dv, False)
            dpt = _round(dot(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), OPS_FP32), R_DP)
            dst = _round(_round(mul_rn(pt, _round(dpt - delta[None, :], R_DS1)), R_DS2), R_DS)
            if OPS_FP32:
                dk = dot(_round(dst, R_DS_OP), q, dk, True)
            else:
                dk = dot(cast(_round(dst, R_DS_OP), q.dtype), q, dk, False)
        dv_run = _round(dv_run + _round(dv, R_DV_PART), R_DV)
        dk_run = _round(dk_run + _round(mul_rn(_round(dk, R_DK_PART), scale), R_DK_PART), R_DK)
    out = head_offset(bh, H, stride_gb, stride_gh)
    store_rows(DK + out, dk_run, offs_n, stride_gt, TK, HEAD_DIM, D_IN)
    store_rows(DV + out, dv_run, offs_n, stride_gt, TK, HEAD_DIM, D_IN)
