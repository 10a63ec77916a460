"""Fused flash-attention kernels (FlashAttention-2 structure) with constexpr numerics.

Two numeric modes, both chosen at compile time so neither pays for the other:
- native (`EMU=False`): production FA2 rounding (fp32 statistics and
  accumulators, P̄ and dS cast to the input dtype for the tensor-core matmuls),
  scores in base-2 units so the exponentials are `exp2`;
- emulated (`EMU=True`): every site of a `Precision` rounded as the reference
  rounds it (`R_*` codes: 0 keeps fp32, 1 rounds to bf16, 2 to fp16), with the
  policy's logical tiles (LT keys in the forward, LQ queries / LT keys in the
  backward) built from smaller physical tiles. The forward then makes two or
  three passes over each logical tile: its maximum, its near-maximum count
  (only for SFA or statistics), then P̄ and P̄V.

`STAB` is 0 (plain), 1 (SFA, the seed's Algorithm 3, per tile) or 2 (ClampPbar);
`STATS` adds the per-head counters of `AttentionStats`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from stableflash.attention.triton.spec import INTERPRET

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
# The interpreter (TRITON_INTERPRET=1, used by the CPU tests) has no libdevice and
# multiplies bf16 tiles wrongly in tl.dot (triton 3.6), so it takes fp32 paths instead.
_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def _cast(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE with round-to-nearest-even (the interpreter's own bf16 cast truncates)."""
    if _INTERPRET and DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 32767 + ((bits >> 16) & 1)) & -65536
        x = tl.where(x == x, rounded.to(tl.float32, bitcast=True), x)
    return x.to(DTYPE)


@triton.jit
def _round(x, CODE: tl.constexpr):
    """Round an fp32 tensor to bf16 (CODE 1) or fp16 (CODE 2), keeping it fp32; CODE 0: unchanged."""
    if CODE == 1:
        x = _cast(x, tl.bfloat16).to(tl.float32)
    elif CODE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _round_up_bf16(x):
    """Round fp32 toward +inf to a bf16 value (kept fp32): SFA's m must not round below its shift."""
    bits = x.to(tl.int32, bitcast=True)
    up = tl.where(x > 0, (bits + 65535) & -65536, bits & -65536)
    return up.to(tl.float32, bitcast=True)


@triton.jit
def _exp(x):
    """libdevice's expf (CUDA's exp, within 2 ulp) for the emulated presets, not the fast ex2.approx. The `add.rn` of
    +0 (an identity on exp's results) keeps exp's last multiply from fusing into the caller's next sum, a rounding
    the reference makes (docs/kernel-notes.md)."""
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
def _dot(a, b, acc, OPS_FP32: tl.constexpr):
    """a @ b + acc with fp32 accumulation; operands in their dtype, or exact fp32 when OPS_FP32."""
    # one return through if/elif/else: after an early `return` under a constexpr `if`, Triton still compiles the
    # rest, and the bf16 dot of fp32 operands below failed to compile (the "fp32-operand variant" error on the H200)
    if _INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif OPS_FP32:  # three tf32 products: fp32-level accuracy on the tensor cores
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _sfa_max(rm, repeated, BETA: tl.constexpr, LOW: tl.constexpr, HIGH: tl.constexpr,
             BOUNDED: tl.constexpr, ROUND_UP_BF16: tl.constexpr):
    """SFA's row maximum m from the tile maximum rm and whether the row repeats it (see stabilize.SFA)."""
    if BOUNDED:
        # the paper's shift m - rm ((beta - 1) rm, or -rm below 0), kept in [LOW, HIGH] and checked after rounding.
        # A repeated maximum is finite or +inf (near-max tests are false on NaN and -inf); +inf's shift is NaN, and
        # its m fails the final test as a non-finite rm fails the reference's: one test in place of a finiteness one
        shift = tl.where(rm > 0, BETA * rm, 0.0) - rm
        m = rm + tl.minimum(tl.maximum(shift, LOW), HIGH)
        if ROUND_UP_BF16:
            m = _round_up_bf16(m)
        actual = m - rm
        m = tl.where(repeated & (actual >= LOW) & (actual <= HIGH), m, rm)
    else:
        m = tl.where(repeated & (rm > 0), BETA * rm, rm)
        m = tl.where(repeated & (rm < 0), 0.0, m)
    return m


@triton.jit
def _fp32(x):
    """A float argument in fp32: Triton passes Python floats as fp32, but inductor (launching the traced ops) as
    fp64, which would promote every score computed with it."""
    return tl.cast(x, tl.float32)


@triton.jit
def _load_rows(ptr, offs, stride_t, T, HEAD_DIM: tl.constexpr):
    """A (len(offs), HEAD_DIM) tile of rows `offs` of one head; rows past T read as 0."""
    return tl.load(ptr + offs[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :], mask=offs[:, None] < T, other=0.0)


@triton.jit
def _head_rows(X, x_off, stride_t, T, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Under TMA (chosen by the autotuner at D >= 128: docs/kernel-notes.md), a tensor descriptor of one head's
    (T, HEAD_DIM) rows in blocks of ROWS; else X itself. Descriptors need global scratch: `triton.set_allocator`."""
    if TMA:
        d = tl.make_tensor_descriptor(X + x_off, [T, HEAD_DIM], [stride_t, 1], [ROWS, HEAD_DIM])
    else:
        d = X
    return d


@triton.jit
def _tile_rows(X, x_off, start, stride_t, T, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Rows start..start+ROWS of one head, rows past T read as 0: from its descriptor X under TMA (`_head_rows`),
    else through pointers X + x_off."""
    if TMA:
        t = X.load([start, 0])
    else:
        t = _load_rows(X + x_off, start + tl.arange(0, ROWS), stride_t, T, HEAD_DIM)
    return t


@triton.jit
def _head_offset(bh, H, stride_b, stride_h):
    """Element offset of (batch, head) = divmod(bh, H) in a (B, H, T, D) tensor with these strides."""
    return (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------

@triton.jit
def _mul_rn(a, b):
    """a·b rounded on its own, never contracted with a later addition into an FMA (PTX `mul.rn`). Natively, for the
    scores: with fl(s) − m a row's maximum gives exp2(0) = 1 at any magnitude, where exp2(fma(qk, scale, −m)) gets
    the rounding residual of m, which overflows exp2, or underflows a whole row to O = 0/0, from scores of ~2^31.
    Under emulation, at every product followed by a sum: the reference rounds both (docs/kernel-notes.md)."""
    if _INTERPRET:
        y = a * b
    else:
        y = libdevice.mul_rn(a, b)
    return y


@triton.jit
def _scores(q, K, k_off, start_n, offs_m, T, stride_kt, scale,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
            EMU: tl.constexpr, OPS_FP32: tl.constexpr, R_QK: tl.constexpr, R_SCORES: tl.constexpr,
            TMA: tl.constexpr = False):
    """One (BLOCK_M, BLOCK_N) tile of scores: base-2 units natively, the policy's rounding under EMU.
    K is the head's tensor descriptor under TMA (rows past T read as 0), else a pointer."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if TMA:
        kt = tl.trans(K.load([start_n, 0]))
    else:
        k_ptrs = K + k_off + offs_n[None, :] * stride_kt + tl.arange(0, HEAD_DIM)[:, None]
        if MASKED:
            kt = tl.load(k_ptrs, mask=offs_n[None, :] < T, other=0.0)
        else:
            kt = tl.load(k_ptrs)
    qk = _dot(q, kt, tl.zeros((q.shape[0], BLOCK_N), tl.float32), OPS_FP32)
    if EMU:
        s = _round(_round(_mul_rn(_round(qk, R_QK), scale), R_QK), R_SCORES)
    else:
        s = _mul_rn(qk, scale)  # scale already carries log2(e)
    if MASKED:
        valid = offs_n[None, :] < T
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def _near_max(s, rm, eps):
    """Per row: how many finite scores lie within eps of the row maximum rm (emulated path: rm spans a
    logical tile of several physical ones)."""
    # -inf scores give gap +inf, and a row of -inf gives NaN: neither passes the test
    return tl.sum(((rm[:, None] - s) <= eps).to(tl.int32), 1)


@triton.jit
def _top2(a1, a2, b1, b2):
    """Combine of a (largest, second largest) pair reduction; a repeated maximum is its own second."""
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2))


@triton.jit
def _stats_combine(a_repeated, a_ones, a_max, b_repeated, b_ones, b_max):
    """The statistics' per-program reduction: two counts and a maximum in one pass."""
    return a_repeated + b_repeated, a_ones + b_ones, tl.maximum(a_max, b_max)


@triton.jit
def _shift(m):
    """Rows that have seen no finite score keep m = -inf; shift them by 0 so exp gives 0, not NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _fwd_native_tile(q, K, V, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, scale,
                     m, l, acc, repeated, ones, smax, eps_u,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                     STAB: tl.constexpr, STATS: tl.constexpr, BETA: tl.constexpr, LOW: tl.constexpr,
                     HIGH: tl.constexpr, BOUNDED: tl.constexpr, CLAMP_CEIL: tl.constexpr, TMA: tl.constexpr):
    """One key tile of the production-FA2 online softmax (base-2 units).

    Scores are scaled (and rounded: `_mul_rn`) before their maximum, so the row's maximum gives exp2(0) = 1 exactly.
    FA2's CUDA kernel folds the scale into the exponent's FFMA, exp2(fma(qk, scale, -m)), as Triton's FMA contraction
    once did here in unmasked tiles: NaN at scores of ~2^31 and more (docs/kernel-notes.md)."""
    s = _scores(q, K, k_off, start_n, offs_m, T, stride_kt, scale, BLOCK_N, HEAD_DIM, CAUSAL, MASKED,
                False, False, 0, 0, TMA)
    if STATS or STAB == 1:
        # a row repeats its maximum (within eps) iff its second largest score is that close: one pair reduction
        # in place of the maximum and a count; neighbouring columns paired first (the top two of a pair are its
        # max and min), 3 min/max per score where combining single scores takes 4
        a, b = tl.split(tl.reshape(s, (s.shape[0], s.shape[1] // 2, 2)))
        rm, r2 = tl.reduce((tl.maximum(a, b), tl.minimum(a, b)), 1, _top2)
        near_row = (r2 >= rm - eps_u) & (rm > float("-inf"))
    else:
        rm = tl.max(s, 1)
    if STATS:  # per row here; one reduction over the rows at the end (cross-warp, so not in the loop)
        smax = tl.maximum(smax, tl.where(rm < float("inf"), rm, float("-inf")))
        repeated = tl.maximum(repeated, near_row.to(tl.int32))
    tile_max = rm
    if STAB == 1:
        rm = _sfa_max(rm, near_row, BETA, LOW, HIGH, BOUNDED, False)
    m_new = tl.maximum(m, rm)
    m_shift = _shift(m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    if STAB == 2:
        p = tl.minimum(p, CLAMP_CEIL)
    p_op = _cast(p, q.dtype)  # the inputs share one dtype; V is a descriptor under TMA
    if STATS:
        # P̄ rounds to 1 only within ~0.003 (base 2) of the shift: unless some row's second largest score is that
        # close, only each row's maximum can, and one exp2 per row decides it (the same value as its entry of p).
        # One reduction over the rows picks the branch; the per-score count is skipped on most tiles (+1-10%).
        if tl.max((r2 >= m_shift - 0.01).to(tl.int32), 0) > 0:
            ones += tl.sum((p_op == 1.0).to(tl.int32), 1)
        else:
            top = tl.math.exp2(tile_max - m_shift)
            if STAB == 2:
                top = tl.minimum(top, CLAMP_CEIL)
            ones += (_cast(top, q.dtype) == 1.0).to(tl.int32)
    alpha = tl.math.exp2(m - m_shift)
    l = l * alpha + tl.sum(p, 1)
    if TMA:
        v = V.load([start_n, 0])
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        v_ptrs = V + v_off + offs_n[:, None] * stride_vt + tl.arange(0, HEAD_DIM)[None, :]
        if MASKED:  # unmasked tiles load without a mask (`_load_rows` always masks)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)
        else:
            v = tl.load(v_ptrs)
    acc = _dot(p_op, v, acc * alpha[:, None], False)
    return m_new, l, acc, repeated, ones, smax


@triton.jit
def _attn_fwd(
    Q, K, V, O, OS, LSE, STAT_COUNTS, STAT_MAX,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot, H, T, scale, eps_u, LT,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EMU: tl.constexpr, OPS_FP32: tl.constexpr, SAVE_OS: tl.constexpr,
    STAB: tl.constexpr, STATS: tl.constexpr, BETA: tl.constexpr, LOW: tl.constexpr, HIGH: tl.constexpr,
    BOUNDED: tl.constexpr, CLAMP_CEIL: tl.constexpr, TILE_CLAMP: tl.constexpr,
    R_QK: tl.constexpr, R_SCORES: tl.constexpr, R_ROW_MAX: tl.constexpr, R_SUB: tl.constexpr,
    R_PBAR: tl.constexpr, R_PBAR_OP: tl.constexpr, R_TILE_SUM: tl.constexpr, R_PV: tl.constexpr,
    R_RESCALE: tl.constexpr, R_L1: tl.constexpr, R_L2: tl.constexpr, R_ROW_SUM: tl.constexpr,
    R_A1: tl.constexpr, R_A2: tl.constexpr, R_ACC: tl.constexpr, R_L_SAVED: tl.constexpr, R_DIV: tl.constexpr,
    R_LSE: tl.constexpr, R_LSE_ADD: tl.constexpr, HEADS_FIRST: tl.constexpr,
    TMA: tl.constexpr,
):
    scale, eps_u = _fp32(scale), _fp32(eps_u)
    if HEADS_FIRST:  # grid (heads, query tiles), every head's heaviest causal tile first (SFA: measured faster)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1) if CAUSAL else tl.program_id(1)
        bh = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
    h = bh % H
    q_off = _head_offset(bh, H, stride_qb, stride_qh)
    k_off = _head_offset(bh, H, stride_kb, stride_kh)
    v_off = _head_offset(bh, H, stride_vb, stride_vh)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    q = _load_rows(Q + q_off, offs_m, stride_qt, T, HEAD_DIM)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    # statistics, per row until the end
    repeated = tl.zeros((BLOCK_M,), tl.int32)
    ones = tl.zeros((BLOCK_M,), tl.int32)
    smax = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    hi = tl.minimum(T, (pid_m + 1) * BLOCK_M) if CAUSAL else T

    if not EMU:
        KS = _head_rows(K, k_off, stride_kt, T, BLOCK_N, HEAD_DIM, TMA)
        VS = _head_rows(V, v_off, stride_vt, T, BLOCK_N, HEAD_DIM, TMA)
        # blocks left of the diagonal (causal) or before the ragged end need no mask
        free = pid_m * BLOCK_M if CAUSAL else (T // BLOCK_N) * BLOCK_N
        for start_n in range(0, free, BLOCK_N):
            m, l, acc, repeated, ones, smax = _fwd_native_tile(
                q, KS, VS, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, scale, m, l, acc, repeated,
                ones, smax, eps_u, BLOCK_N, HEAD_DIM, CAUSAL, False, STAB, STATS, BETA, LOW, HIGH,
                BOUNDED, CLAMP_CEIL, TMA)
        for start_n in range(free, hi, BLOCK_N):
            m, l, acc, repeated, ones, smax = _fwd_native_tile(
                q, KS, VS, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, scale, m, l, acc, repeated,
                ones, smax, eps_u, BLOCK_N, HEAD_DIM, CAUSAL, True, STAB, STATS, BETA, LOW, HIGH,
                BOUNDED, CLAMP_CEIL, TMA)
        empty = m == float("-inf")
        o = acc / tl.where(empty, 1.0, l)[:, None]
        lse = tl.where(empty, float("-inf"), m + tl.math.log2(l))  # base 2: the backward's units
    else:
        for lt in range(0, hi, LT):
            lt_end = tl.minimum(lt + LT, hi)
            # pass 1: the logical tile's row maximum
            rm = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            for start_n in range(lt, lt_end, BLOCK_N):
                s = _scores(q, K, k_off, start_n, offs_m, T, stride_kt, scale, BLOCK_N, HEAD_DIM, CAUSAL, True,
                            True, OPS_FP32, R_QK, R_SCORES)
                rm = tl.maximum(rm, tl.max(s, 1))
            rm = _round(rm, R_ROW_MAX)
            # pass 2 (SFA or statistics): near-maximum counts against the whole tile's maximum
            if STATS or STAB == 1:
                rs = tl.zeros((BLOCK_M,), tl.int32)
                for start_n in range(lt, lt_end, BLOCK_N):
                    s = _scores(q, K, k_off, start_n, offs_m, T, stride_kt, scale, BLOCK_N, HEAD_DIM, CAUSAL,
                                True, True, OPS_FP32, R_QK, R_SCORES)
                    rs += _near_max(s, rm, eps_u)
                    if STATS:
                        smax = tl.maximum(smax, tl.max(tl.where(s < float("inf"), s, float("-inf")), 1))
                if STATS:
                    repeated = tl.maximum(repeated, (rs > 1).to(tl.int32))
                if STAB == 1:
                    rm = _round(_sfa_max(rm, rs > 1, BETA, LOW, HIGH, BOUNDED, R_ROW_MAX == 1), R_ROW_MAX)
            m_new = _round(tl.maximum(rm, m), R_ROW_MAX)
            m_shift = _shift(m_new)
            # pass 3: P̄, its row sum and P̄V over the logical tile
            tile_sum = tl.zeros((BLOCK_M,), tl.float32)
            pv = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
            for start_n in range(lt, lt_end, BLOCK_N):
                s = _scores(q, K, k_off, start_n, offs_m, T, stride_kt, scale, BLOCK_N, HEAD_DIM, CAUSAL, True,
                            True, OPS_FP32, R_QK, R_SCORES)
                p = _round(_exp(_round(s - m_shift[:, None], R_SUB)), R_PBAR)
                if STAB == 2:
                    p = tl.minimum(p, CLAMP_CEIL)
                p_op = _round(p, R_PBAR_OP)
                if STATS:
                    ones += tl.sum((p_op == 1.0).to(tl.int32), 1)
                tile_sum += tl.sum(p, 1)
                offs_n = start_n + tl.arange(0, BLOCK_N)
                v = _load_rows(V + v_off, offs_n, stride_vt, T, HEAD_DIM)
                if OPS_FP32:
                    pv = _dot(p_op, v, pv, True)
                else:
                    pv = _dot(_cast(p_op, V.dtype.element_ty), v, pv, False)
            tile_sum = _round(tile_sum, R_TILE_SUM)
            if TILE_CLAMP > 0:
                tile_sum = tl.maximum(tile_sum, TILE_CLAMP)
            pv = _round(pv, R_PV)
            rescale = _round(_exp(_round(m - m_shift, R_ROW_MAX)), R_RESCALE)
            l = _round(_round(_round(_mul_rn(rescale, l), R_L1) + tile_sum, R_L2), R_ROW_SUM)
            acc = _round(_round(_round(_mul_rn(acc, rescale[:, None]), R_A1) + pv, R_A2), R_ACC)
            m = m_new
        empty = m == float("-inf")
        l = _round(l, R_L_SAVED)  # the buffer that the division and the log-sum-exp read
        o = _round(acc / tl.where(empty, 1.0, l)[:, None], R_DIV)
        log_l = _round(_log(l), R_LSE)
        lse = tl.where(empty, float("-inf"), _round(_round(log_l + m, R_LSE_ADD), R_LSE))
    o = tl.where(empty[:, None], 0.0, o)

    # O (and the fp32 copy) in the memory order the launcher chose: the inputs' order for a model's heads
    o_ptrs = _head_offset(bh, H, stride_ob, stride_oh) + offs_m[:, None] * stride_ot + offs_d[None, :]
    tl.store(O + o_ptrs, _cast(o, O.dtype.element_ty), mask=row_ok[:, None])
    if SAVE_OS:
        tl.store(OS + o_ptrs, o.to(OS.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, lse, mask=row_ok)
    if STATS:  # rows past T hold padding: left out here
        # one reduction over the rows for all three (cross-warp: one round of shared memory and barriers, not three)
        n_repeated, n_ones, row_max = tl.reduce((tl.where(row_ok, repeated, 0), tl.where(row_ok, ones, 0),
                                                 tl.where(row_ok, smax, float("-inf"))), 0, _stats_combine)
        # relaxed: the counters need atomicity, not ordering (the default acq_rel fences every program's end).
        # STAT_COUNTS: (H, 3) int64, per head rows with a repeated maximum, P̄ = 1 entries and rows seen
        # (`AttentionStats.counts` itself on the eager path, so no kernel runs after this one to add them)
        tl.atomic_add(STAT_COUNTS + h * 3, n_repeated.to(tl.int64), sem="relaxed")
        tl.atomic_add(STAT_COUNTS + h * 3 + 1, n_ones.to(tl.int64), sem="relaxed")
        tl.atomic_add(STAT_COUNTS + h * 3 + 2, tl.minimum(T - pid_m * BLOCK_M, BLOCK_M).to(tl.int64), sem="relaxed")
        if not EMU:
            row_max = row_max / _LOG2E
        tl.atomic_max(STAT_MAX + h, row_max, sem="relaxed")


# ------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------

@triton.jit
def _row_delta(o, do, EMU: tl.constexpr, R_TERMS: tl.constexpr, R_DELTA: tl.constexpr):
    """δ = rowsum(dO * O) of a tile of rows, rounded as the policy says (each product on its own under EMU)."""
    if EMU:
        terms = _mul_rn(do.to(tl.float32), o.to(tl.float32))
    else:
        terms = do.to(tl.float32) * o.to(tl.float32)
    return _round(tl.sum(_round(terms, R_TERMS), 1), R_DELTA)


@triton.jit
def _bwd_probs_t(k, q, lse, offs_n, offs_m, T, scale,
                 CAUSAL: tl.constexpr, MASKED: tl.constexpr, EMU: tl.constexpr, OPS_FP32: tl.constexpr,
                 R_QK: tl.constexpr, R_SCORES: tl.constexpr, R_P_SUB: tl.constexpr, R_P: tl.constexpr):
    """Pᵀ for one (keys, queries) tile, recomputed from the saved log-sum-exp (+inf for empty rows)."""
    qkt = _dot(k, tl.trans(q), tl.zeros((k.shape[0], q.shape[0]), tl.float32), OPS_FP32)
    if EMU:
        s = _round(_round(_mul_rn(_round(qkt, R_QK), scale), R_QK), R_SCORES)
        pt = _round(_exp(_round(s - lse[None, :], R_P_SUB)), R_P)
    else:
        # P <= 1 exactly; with scores ~1e11 the recomputed S can exceed the saved lse by a few fp32 ulps
        pt = tl.math.exp2(tl.minimum(qkt * scale - lse[None, :], 0.0))
    if MASKED:
        valid = (offs_m[None, :] < T) & (offs_n[:, None] < T)
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        pt = tl.where(valid, pt, 0.0)
    return pt


@triton.jit
def _bwd_probs(q, k, lse, offs_m, offs_n, T, scale,
               CAUSAL: tl.constexpr, MASKED: tl.constexpr, EMU: tl.constexpr, OPS_FP32: tl.constexpr,
               R_QK: tl.constexpr, R_SCORES: tl.constexpr, R_P_SUB: tl.constexpr, R_P: tl.constexpr):
    """P for one (queries, keys) tile: the dQ kernel's orientation of `_bwd_probs_t`."""
    qk = _dot(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), tl.float32), OPS_FP32)
    if EMU:
        s = _round(_round(_mul_rn(_round(qk, R_QK), scale), R_QK), R_SCORES)
        p = _round(_exp(_round(s - lse[:, None], R_P_SUB)), R_P)
    else:
        p = tl.math.exp2(tl.minimum(qk * scale - lse[:, None], 0.0))
    if MASKED:
        valid = (offs_m[:, None] < T) & (offs_n[None, :] < T)
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(valid, p, 0.0)
    return p


@triton.jit
def _load_lse(LSE, offs, T, EMU: tl.constexpr):
    """Saved lse (base 2 natively, natural under EMU); rows with no visible key (-inf) become +inf, so P = 0."""
    lse = tl.load(LSE + offs, mask=offs < T, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _key_tile_p_dp(q, do, lse, K, V, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, qk_scale,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                   EMU: tl.constexpr, OPS_FP32: tl.constexpr, R_QK: tl.constexpr, R_SCORES: tl.constexpr,
                   R_P_SUB: tl.constexpr, R_P: tl.constexpr, R_DP: tl.constexpr, TMA: tl.constexpr = False):
    """For the query rows `offs_m` and the key tile at `start_n`: its keys k, P (recomputed) and dP = dO Vᵀ.
    K and V are the head's tensor descriptors under TMA, else pointers."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _tile_rows(K, k_off, start_n, stride_kt, T, BLOCK_N, HEAD_DIM, TMA)
    v = _tile_rows(V, v_off, start_n, stride_vt, T, BLOCK_N, HEAD_DIM, TMA)
    p = _bwd_probs(q, k, lse, offs_m, offs_n, T, qk_scale, CAUSAL, MASKED, EMU, OPS_FP32, R_QK, R_SCORES, R_P_SUB, R_P)
    dp = _round(_dot(do, tl.trans(v), tl.zeros((do.shape[0], BLOCK_N), tl.float32), OPS_FP32), R_DP)
    return k, p, dp


@triton.jit
def _bwd_offsets(bh, H, T, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_dob, stride_doh):
    """Element offsets of (batch, head) `bh` in Q, K, V and dO, and of its rows in the (B*H, T) statistics."""
    return (_head_offset(bh, H, stride_qb, stride_qh), _head_offset(bh, H, stride_kb, stride_kh),
            _head_offset(bh, H, stride_vb, stride_vh), _head_offset(bh, H, stride_dob, stride_doh),
            bh.to(tl.int64) * T)


@triton.jit
def _attn_bwd_delta_dpp(
    Q, K, V, DO, LSE, DELTA,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot, H, T, qk_scale, LT,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EMU: tl.constexpr, OPS_FP32: tl.constexpr, R_QK: tl.constexpr, R_SCORES: tl.constexpr, R_P_SUB: tl.constexpr,
    R_P: tl.constexpr, R_DP: tl.constexpr, R_DPP: tl.constexpr, R_TERMS: tl.constexpr, R_DELTA: tl.constexpr,
):
    """δ = rowsum(dP ∘ P) (the `dp_p` formula) for one query tile: P and dP recomputed over every visible
    key, summed per logical key tile and added up with the policy's rounding, as the reference does."""
    qk_scale = _fp32(qk_scale)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    q_off, k_off, v_off, do_off, row_off = _bwd_offsets(bh, H, T, stride_qb, stride_qh, stride_kb, stride_kh,
                                                        stride_vb, stride_vh, stride_dob, stride_doh)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + q_off, offs_m, stride_qt, T, HEAD_DIM)
    do = _load_rows(DO + do_off, offs_m, stride_dot, T, HEAD_DIM)
    lse = _load_lse(LSE + row_off, offs_m, T, EMU)
    delta = tl.zeros((BLOCK_M,), tl.float32)
    hi = tl.minimum(T, (pid_m + 1) * BLOCK_M) if CAUSAL else T
    for lt in range(0, hi, LT):
        part = tl.zeros((BLOCK_M,), tl.float32)
        for start_n in range(lt, tl.minimum(lt + LT, hi), BLOCK_N):
            _, p, dp = _key_tile_p_dp(q, do, lse, K, V, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt,
                                      qk_scale, BLOCK_N, HEAD_DIM, CAUSAL, True, EMU, OPS_FP32, R_QK, R_SCORES,
                                      R_P_SUB, R_P, R_DP)
            part += tl.sum(_round(_round(_mul_rn(dp, p), R_DPP), R_TERMS), 1)
        delta = _round(delta + _round(part, R_DELTA), R_DELTA)
    tl.store(DELTA + row_off + offs_m, delta, mask=offs_m < T)


@triton.jit
def _dkdv_tile(k, v, Q, DO, LSE, DELTA, q_off, do_off, row_off, start_m, offs_n, T, stride_qt, stride_dot, qk_scale,
               dk, dv, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               EMU: tl.constexpr, OPS_FP32: tl.constexpr, R_QK: tl.constexpr, R_SCORES: tl.constexpr,
               R_P_SUB: tl.constexpr, R_P: tl.constexpr, R_P_OP: tl.constexpr, R_DP: tl.constexpr,
               R_DS1: tl.constexpr, R_DS2: tl.constexpr, R_DS: tl.constexpr, R_DS_OP: tl.constexpr,
               TMA: tl.constexpr = False):
    """One query tile's share of dK and dV; Q and dO are the head's tensor descriptors under TMA, else pointers."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _tile_rows(Q, q_off, start_m, stride_qt, T, BLOCK_M, HEAD_DIM, TMA)
    do = _tile_rows(DO, do_off, start_m, stride_dot, T, BLOCK_M, HEAD_DIM, TMA)
    lse = _load_lse(LSE + row_off, offs_m, T, EMU)
    delta = tl.load(DELTA + row_off + offs_m, mask=offs_m < T, other=0.0)
    pt = _bwd_probs_t(k, q, lse, offs_n, offs_m, T, qk_scale, CAUSAL, MASKED, EMU, OPS_FP32, R_QK, R_SCORES, R_P_SUB, R_P)
    if OPS_FP32:
        dv = _dot(_round(pt, R_P_OP), do, dv, True)
    else:
        dv = _dot(_cast(pt, do.dtype), do, dv, False)
    dpt = _round(_dot(v, tl.trans(do), tl.zeros((v.shape[0], BLOCK_M), tl.float32), OPS_FP32), R_DP)
    if EMU:  # the product rounded on its own, as the reference rounds it
        dst = _round(_round(_mul_rn(pt, _round(dpt - delta[None, :], R_DS1)), R_DS2), R_DS)
    else:
        dst = pt * (dpt - delta[None, :])
    if OPS_FP32:
        dk = _dot(_round(dst, R_DS_OP), q, dk, True)
    else:
        dk = _dot(_cast(dst, q.dtype), q, dk, False)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot, stride_gb, stride_gh, stride_gt, H, T, qk_scale, scale, LQ,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EMU: tl.constexpr, OPS_FP32: tl.constexpr,
    R_QK: tl.constexpr, R_SCORES: tl.constexpr, R_P_SUB: tl.constexpr, R_P: tl.constexpr, R_P_OP: tl.constexpr,
    R_DP: tl.constexpr, R_DS1: tl.constexpr, R_DS2: tl.constexpr, R_DS: tl.constexpr, R_DS_OP: tl.constexpr,
    R_DV_PART: tl.constexpr, R_DV: tl.constexpr, R_DK_PART: tl.constexpr, R_DK: tl.constexpr, TMA: tl.constexpr,
):
    """dK and dV (both with strides `stride_g*`) for one key tile, looping over the query tiles that see it.
    Under TMA (native path; docs/kernel-notes.md): Q and dO tiles by tensor descriptors."""
    qk_scale, scale = _fp32(qk_scale), _fp32(scale)
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    q_off, k_off, v_off, do_off, row_off = _bwd_offsets(bh, H, T, stride_qb, stride_qh, stride_kb, stride_kh,
                                                        stride_vb, stride_vh, stride_dob, stride_doh)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    keys = offs_n[:, None] < T
    k = _load_rows(K + k_off, offs_n, stride_kt, T, HEAD_DIM)
    v = _load_rows(V + v_off, offs_n, stride_vt, T, HEAD_DIM)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0

    if not EMU:
        QS = _head_rows(Q, q_off, stride_qt, T, BLOCK_M, HEAD_DIM, TMA)
        DOS = _head_rows(DO, do_off, stride_dot, T, BLOCK_M, HEAD_DIM, TMA)
        # query tiles crossing the diagonal need the causal mask; later ones, all but the ragged end, do not
        diag_end = tl.minimum((pid_n + 1) * BLOCK_N, T) if CAUSAL else lo
        free_end = tl.maximum(diag_end, (T // BLOCK_M) * BLOCK_M)
        for start_m in range(lo, diag_end, BLOCK_M):
            dk, dv = _dkdv_tile(k, v, QS, DOS, LSE, DELTA, q_off, do_off, row_off, start_m, offs_n, T, stride_qt,
                                stride_dot, qk_scale, dk, dv, BLOCK_M, HEAD_DIM, CAUSAL, True, False, False,
                                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, TMA)
        for start_m in range(diag_end, free_end, BLOCK_M):
            dk, dv = _dkdv_tile(k, v, QS, DOS, LSE, DELTA, q_off, do_off, row_off, start_m, offs_n, T, stride_qt,
                                stride_dot, qk_scale, dk, dv, BLOCK_M, HEAD_DIM, CAUSAL, False, False, False,
                                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, TMA)
        for start_m in range(free_end, T, BLOCK_M):
            dk, dv = _dkdv_tile(k, v, QS, DOS, LSE, DELTA, q_off, do_off, row_off, start_m, offs_n, T, stride_qt,
                                stride_dot, qk_scale, dk, dv, BLOCK_M, HEAD_DIM, CAUSAL, True, False, False,
                                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, TMA)
        dk = dk * scale
    else:
        # accumulate each logical query tile in fp32, then round and add it as the reference does
        dk_run = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
        dv_run = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
        for lq in range((lo // LQ) * LQ, T, LQ):
            dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
            dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
            for start_m in range(tl.maximum(lq, lo), tl.minimum(lq + LQ, T), BLOCK_M):
                dk, dv = _dkdv_tile(k, v, Q, DO, LSE, DELTA, q_off, do_off, row_off, start_m, offs_n, T, stride_qt,
                                    stride_dot, qk_scale, dk, dv, BLOCK_M, HEAD_DIM, CAUSAL, True, True, OPS_FP32,
                                    R_QK, R_SCORES, R_P_SUB, R_P, R_P_OP, R_DP, R_DS1, R_DS2, R_DS, R_DS_OP)
            dv_run = _round(dv_run + _round(dv, R_DV_PART), R_DV)
            dk_run = _round(dk_run + _round(_mul_rn(_round(dk, R_DK_PART), scale), R_DK_PART), R_DK)
        dk = dk_run
        dv = dv_run
    out = _head_offset(bh, H, stride_gb, stride_gh) + offs_n[:, None] * stride_gt + offs_d[None, :]
    tl.store(DK + out, _cast(dk, DK.dtype.element_ty), mask=keys)
    tl.store(DV + out, _cast(dv, DV.dtype.element_ty), mask=keys)


@triton.jit
def _dq_tile(q, do, lse, delta, K, V, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, qk_scale, dq,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
             EMU: tl.constexpr, OPS_FP32: tl.constexpr, R_QK: tl.constexpr, R_SCORES: tl.constexpr,
             R_P_SUB: tl.constexpr, R_P: tl.constexpr, R_DP: tl.constexpr, R_DS1: tl.constexpr,
             R_DS2: tl.constexpr, R_DS: tl.constexpr, R_DS_OP: tl.constexpr, TMA: tl.constexpr = False):
    k, p, dp = _key_tile_p_dp(q, do, lse, K, V, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, qk_scale,
                              BLOCK_N, HEAD_DIM, CAUSAL, MASKED, EMU, OPS_FP32, R_QK, R_SCORES, R_P_SUB, R_P, R_DP,
                              TMA)
    if EMU:  # the product rounded on its own, as the reference rounds it
        ds = _round(_round(_mul_rn(p, _round(dp - delta[:, None], R_DS1)), R_DS2), R_DS)
    else:
        ds = p * (dp - delta[:, None])
    if OPS_FP32:
        dq = _dot(_round(ds, R_DS_OP), k, dq, True)
    else:
        dq = _dot(_cast(ds, k.dtype), k, dq, False)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, O, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot, stride_ob, stride_oh, stride_ot, stride_gb, stride_gh, stride_gt,
    H, T, qk_scale, scale, LT,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EMU: tl.constexpr, OPS_FP32: tl.constexpr, DELTA_HERE: tl.constexpr,
    R_TERMS: tl.constexpr, R_DELTA: tl.constexpr,
    R_QK: tl.constexpr, R_SCORES: tl.constexpr, R_P_SUB: tl.constexpr, R_P: tl.constexpr,
    R_DP: tl.constexpr, R_DS1: tl.constexpr, R_DS2: tl.constexpr, R_DS: tl.constexpr, R_DS_OP: tl.constexpr,
    R_DQ_PART: tl.constexpr, R_DQ: tl.constexpr, TMA: tl.constexpr,
):
    """dQ (strides `stride_g*`) for one query tile, looping over the key tiles it sees. Under TMA (native
    path; docs/kernel-notes.md): K and V tiles by tensor descriptors.

    With DELTA_HERE it first computes its rows' δ = rowsum(dO * O) and stores it for the dK/dV kernel, launched
    after it: one launch fewer than a separate δ pass."""
    qk_scale, scale = _fp32(qk_scale), _fp32(scale)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    q_off, k_off, v_off, do_off, row_off = _bwd_offsets(bh, H, T, stride_qb, stride_qh, stride_kb, stride_kh,
                                                        stride_vb, stride_vh, stride_dob, stride_doh)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < T
    do = _load_rows(DO + do_off, offs_m, stride_dot, T, HEAD_DIM)
    if DELTA_HERE:  # before Q is loaded: fewer tiles live at once
        o = _load_rows(O + _head_offset(bh, H, stride_ob, stride_oh), offs_m, stride_ot, T, HEAD_DIM)
        delta = _row_delta(o, do, EMU, R_TERMS, R_DELTA)
        tl.store(DELTA + row_off + offs_m, delta, mask=offs_m < T)
    else:
        delta = tl.load(DELTA + row_off + offs_m, mask=offs_m < T, other=0.0)
    q = _load_rows(Q + q_off, offs_m, stride_qt, T, HEAD_DIM)
    lse = _load_lse(LSE + row_off, offs_m, T, EMU)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    hi = tl.minimum(T, (pid_m + 1) * BLOCK_M) if CAUSAL else T

    if not EMU:
        KS = _head_rows(K, k_off, stride_kt, T, BLOCK_N, HEAD_DIM, TMA)
        VS = _head_rows(V, v_off, stride_vt, T, BLOCK_N, HEAD_DIM, TMA)
        free = pid_m * BLOCK_M if CAUSAL else (T // BLOCK_N) * BLOCK_N
        for start_n in range(0, free, BLOCK_N):
            dq = _dq_tile(q, do, lse, delta, KS, VS, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, qk_scale,
                          dq, BLOCK_N, HEAD_DIM, CAUSAL, False, False, False, 0, 0, 0, 0, 0, 0, 0, 0, 0, TMA)
        for start_n in range(free, hi, BLOCK_N):
            dq = _dq_tile(q, do, lse, delta, KS, VS, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, qk_scale,
                          dq, BLOCK_N, HEAD_DIM, CAUSAL, True, False, False, 0, 0, 0, 0, 0, 0, 0, 0, 0, TMA)
        dq = dq * scale
    else:
        dq_run = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        for lt in range(0, hi, LT):
            dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
            for start_n in range(lt, tl.minimum(lt + LT, hi), BLOCK_N):
                dq = _dq_tile(q, do, lse, delta, K, V, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, qk_scale,
                              dq, BLOCK_N, HEAD_DIM, CAUSAL, True, True, OPS_FP32, R_QK, R_SCORES, R_P_SUB, R_P,
                              R_DP, R_DS1, R_DS2, R_DS, R_DS_OP)
            dq_run = _round(dq_run + _round(_mul_rn(_round(dq, R_DQ_PART), scale), R_DQ_PART), R_DQ)
        dq = dq_run
    out = _head_offset(bh, H, stride_gb, stride_gh) + offs_m[:, None] * stride_gt + offs_d[None, :]
    tl.store(DQ + out, _cast(dq, DQ.dtype.element_ty), mask=rows)
