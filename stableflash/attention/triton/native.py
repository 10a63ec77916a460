"""The native kernels: FlashAttention-2 with production numerics, in the Triton tutorial's shape.

fp32 statistics and accumulators, P̄ and dS cast to the input dtype for the tensor-core matmuls, scores in base-2
units so that the exponentials are `exp2` (the launcher folds log2(e) into the scale). Three kernels: the forward,
and the backward's dQ (which also writes δ = rowsum(dO ∘ O)) and dK/dV, launched in that order; or, with
`ATOMIC_DQ` (`KernelOptions.atomic_dq`), δ alone (`_attn_bwd_delta`) and a dK/dV kernel that adds dQ with atomics.

Compile-time features, none paid for when off: `STAB` 0 plain, 1 SFA (the seed's Algorithm 3 per key tile, bounded
or not), 2 ClampPbar; `SOFTCAP` caps the scores as softcap · tanh(S / softcap) (Gemma 2's; `scale` is then the
natural scale over the cap and `softcap` the cap in base-2 units, and the backward multiplies dS by the cap's slope
1 - tanh²); `STATS` adds the per-head counters of `AttentionStats`; `TMA` streams key tiles (forward, dQ)
or query tiles (dK/dV) by tensor descriptors, which the autotuner may choose at D = 128 (`tuning`); `MASK` takes
TK keys against T queries with a band (causal aligned to the bottom right, a sliding window: `LEFT`, `RIGHT`) and,
with `PAD`, a key-padding mask (`KEEP`, (B, TK) bytes), or with `PAD` and `SEG` a packed batch of sequences whose
queries and keys may differ in length (`KEEP`, the (4, T + TK) int32 table `common.py` describes; the band aligned
to each sequence's bottom right): every tile it visits is masked, and only tiles the band and the sequences reach
are visited; `D_IN`, the inputs' head dim where it is below `HEAD_DIM`, pads it inside the kernel (loads read the
columns past it as 0, stores leave them out; not with TMA).
"""

from __future__ import annotations

import triton
import triton.language as tl

from stableflash.attention.triton.common import (
    add_stats,
    band_keys,
    band_queries,
    band_visible,
    band_visible_t,
    cast,
    dot,
    fp32,
    head_offset,
    key_tags,
    kv_head_offset,
    load_all_rows,
    load_lse,
    load_rows,
    packed_keys,
    packed_queries,
    query_tags,
    query_tile_program,
    row_flags,
    row_strides,
    scores,
    sfa_max,
    shift,
    store_rows,
    top2,
    visible,
)

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _head_rows(X, x_off, stride_t, T, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Under TMA, a tensor descriptor of one head's (T, HEAD_DIM) rows in blocks of ROWS (rows past T read as 0);
    else X itself. Descriptors need global scratch: `triton.set_allocator`."""
    if TMA:
        d = tl.make_tensor_descriptor(X + x_off, [T, HEAD_DIM], [stride_t, 1], [ROWS, HEAD_DIM])
    else:
        d = X
    return d


@triton.jit
def _tile_rows(X, x_off, start, stride_t, T, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr,
               MASKED: tl.constexpr = True, D_IN: tl.constexpr = 0):
    """Rows start..start+ROWS of one head (from its descriptor under TMA, else through pointers X + x_off); rows
    past T read as 0 unless the caller knows there are none (MASKED False); a padded head dim's columns past D_IN
    read as 0 (`common.load_rows`)."""
    if TMA:
        t = X.load([start, 0])
    elif MASKED:
        t = load_rows(X + x_off, start + tl.arange(0, ROWS), stride_t, T, HEAD_DIM, D_IN)
    else:
        t = load_all_rows(X + x_off, start + tl.arange(0, ROWS), stride_t, HEAD_DIM, D_IN)
    return t


# -- forward ---------------------------------------------------------------------------------------------------------

@triton.jit
def _fwd_tile(q, K, V, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, scale, m, l, acc, repeated, ones,
              smax, eps, TQ, LEFT, RIGHT, key_row, qtags, aligned, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              CAUSAL: tl.constexpr, MASKED: tl.constexpr, STAB: tl.constexpr, STATS: tl.constexpr, BETA: tl.constexpr,
              LOW: tl.constexpr, HIGH: tl.constexpr, BOUNDED: tl.constexpr, CLAMP_CEIL: tl.constexpr, TMA: tl.constexpr,
              MASK: tl.constexpr, PAD: tl.constexpr, softcap, SOFTCAP: tl.constexpr, D_IN: tl.constexpr):
    """One key tile of the online softmax (T: the keys' length; TQ the queries', read under MASK).

    Scores are scaled (and rounded: `mul_rn`) before their maximum, so that the row's maximum gives exp2(0) = 1
    exactly; FA2's CUDA kernel folds the scale into the exponent's FMA instead, which overflows at scores of ~2^31."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if TMA:
        kt = tl.trans(K.load([start_n, 0]))
    else:  # Kᵀ loaded as such
        kt_ptrs = K + k_off + offs_n[None, :] * stride_kt + tl.arange(0, HEAD_DIM)[:, None]
        if MASKED and D_IN:
            kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < T) & (tl.arange(0, HEAD_DIM)[:, None] < D_IN), other=0.0)
        elif MASKED:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < T, other=0.0)
        elif D_IN:
            kt = tl.load(kt_ptrs, mask=tl.arange(0, HEAD_DIM)[:, None] < D_IN, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
    s, _ = scores(dot(q, kt, tl.zeros((q.shape[0], BLOCK_N), tl.float32), False), scale, softcap, SOFTCAP=SOFTCAP,
                   ROUNDED=True)
    if MASK:
        s = tl.where(band_visible(offs_m, offs_n, TQ, T, LEFT, RIGHT, qtags, key_tags(key_row, offs_n, T, PAD),
                                  aligned), s, float("-inf"))
    elif MASKED:  # the diagonal (causal) or the ragged end: the only tiles that need a mask
        valid = offs_n[None, :] < T
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(valid, s, float("-inf"))
    if STATS or STAB == 1:
        # a row repeats its maximum (within eps) iff its second largest score is that close: one pair reduction in
        # place of the maximum and a count; neighbouring columns paired first (a pair's top two are its max and min)
        a, b = tl.split(tl.reshape(s, (s.shape[0], s.shape[1] // 2, 2)))
        rm, r2 = tl.reduce((tl.maximum(a, b), tl.minimum(a, b)), 1, top2)
        near_row = (r2 >= rm - eps) & (rm > float("-inf"))
    else:
        rm = tl.max(s, 1)
    if STATS:  # per row here; one reduction over the rows at the end (cross-warp, so not in the loop)
        smax = tl.maximum(smax, tl.where(rm < float("inf"), rm, float("-inf")))
        repeated = repeated | row_flags(near_row, rm > 0)  # P̄V in fp32: no row is biasable
    tile_max = rm
    if STAB == 1:
        rm = sfa_max(rm, near_row, BETA, LOW, HIGH, BOUNDED, False)
    m_new = tl.maximum(m, rm)
    m_shift = shift(m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    if STAB == 2:
        p = tl.minimum(p, CLAMP_CEIL)
    p_op = cast(p, q.dtype)
    if STATS:
        # P̄ rounds to 1 only within ~0.003 (base 2) of the shift: unless some row's second largest score is that
        # close, only each row's maximum can, and one exp2 per row decides it (the same value as its entry of p)
        if tl.max((r2 >= m_shift - 0.01).to(tl.int32), 0) > 0:
            ones += tl.sum((p_op == 1.0).to(tl.int32), 1)
        else:
            top = tl.math.exp2(tile_max - m_shift)
            if STAB == 2:
                top = tl.minimum(top, CLAMP_CEIL)
            ones += (cast(top, q.dtype) == 1.0).to(tl.int32)
    alpha = tl.math.exp2(m - m_shift)
    l = l * alpha + tl.sum(p, 1)
    v = _tile_rows(V, v_off, start_n, stride_vt, T, BLOCK_N, HEAD_DIM, TMA, MASKED, D_IN)
    acc = dot(p_op, v, acc * alpha[:, None], False)
    return m_new, l, acc, repeated, ones, smax


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE, STAT_COUNTS, STAT_MAX, q_strides, k_strides, v_strides, o_strides, H, G, T, scale, eps, band,
    softcap,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    STAB: tl.constexpr, STATS: tl.constexpr, BETA: tl.constexpr, LOW: tl.constexpr, HIGH: tl.constexpr,
    BOUNDED: tl.constexpr, CLAMP_CEIL: tl.constexpr, HEADS_FIRST: tl.constexpr, TMA: tl.constexpr,
    MASK: tl.constexpr = False, PAD: tl.constexpr = False, SEG: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    D_IN: tl.constexpr = 0, STRIDE8: tl.constexpr = False,
):
    """O and the base-2 lse of one query tile; `scale` and `eps` in base-2 units (`scale` natural under SOFTCAP).
    D_IN: the inputs' head dim where it is below HEAD_DIM, padded in the kernel (0: HEAD_DIM)."""
    stride_qb, stride_qh, stride_qt = row_strides(q_strides, STRIDE8)
    stride_kb, stride_kh, stride_kt = row_strides(k_strides, STRIDE8)
    stride_vb, stride_vh, stride_vt = row_strides(v_strides, STRIDE8)
    stride_ob, stride_oh, stride_ot = row_strides(o_strides, STRIDE8)
    KEEP, stride_keep, TK, LEFT, RIGHT = band
    scale, eps, softcap = fp32(scale), fp32(eps), fp32(softcap)
    if HEADS_FIRST:  # grid (heads, query tiles), every head's heaviest causal tile first (SFA: measured faster)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1) if CAUSAL else tl.program_id(1)
        bh = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
    k_off = kv_head_offset(bh, H, G, stride_kb, stride_kh)
    v_off = kv_head_offset(bh, H, G, stride_vb, stride_vh)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = load_rows(Q + head_offset(bh, H, stride_qb, stride_qh), offs_m, stride_qt, T, HEAD_DIM, D_IN)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    repeated = tl.zeros((BLOCK_M,), tl.int32)  # the statistics (`common.row_flags`), per row until the end
    ones = tl.zeros((BLOCK_M,), tl.int32)
    smax = tl.full((BLOCK_M,), float("-inf"), tl.float32)

    KS = _head_rows(K, k_off, stride_kt, TK, BLOCK_N, HEAD_DIM, TMA)
    VS = _head_rows(V, v_off, stride_vt, TK, BLOCK_N, HEAD_DIM, TMA)
    keep_row = KEEP + (bh // H).to(tl.int64) * stride_keep
    key_row = keep_row + T if SEG else keep_row  # a packed batch's table: the keys' columns follow the queries'
    qtags, aligned = query_tags(keep_row, stride_keep, offs_m, T, TK, SEG)
    if MASK:  # every tile the band (and, packed, the rows' sequences) reaches, each masked
        if SEG:
            lo, hi = packed_keys(keep_row, stride_keep, offs_m, T, aligned, LEFT, RIGHT)
        else:
            lo, hi = band_keys(pid_m * BLOCK_M, BLOCK_M, BLOCK_N, T, TK, LEFT, RIGHT)
        for start_n in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            m, l, acc, repeated, ones, smax = _fwd_tile(
                q=q, K=KS, V=VS, k_off=k_off, v_off=v_off, start_n=start_n, offs_m=offs_m, T=TK, stride_kt=stride_kt,
                stride_vt=stride_vt, scale=scale, m=m, l=l, acc=acc, repeated=repeated, ones=ones, smax=smax, eps=eps,
                TQ=T, LEFT=LEFT, RIGHT=RIGHT, key_row=key_row, qtags=qtags, aligned=aligned, softcap=softcap,
                BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=False, MASKED=True, MASK=True, PAD=PAD, STAB=STAB,
                STATS=STATS, BETA=BETA, LOW=LOW, HIGH=HIGH, BOUNDED=BOUNDED, CLAMP_CEIL=CLAMP_CEIL, TMA=TMA,
                SOFTCAP=SOFTCAP, D_IN=D_IN)
    else:
        # key tiles left of the diagonal (causal) or before the ragged end need no mask
        free = pid_m * BLOCK_M if CAUSAL else (T // BLOCK_N) * BLOCK_N
        hi = tl.minimum(T, (pid_m + 1) * BLOCK_M) if CAUSAL else T
        for start_n in range(0, free, BLOCK_N):
            m, l, acc, repeated, ones, smax = _fwd_tile(
                q=q, K=KS, V=VS, k_off=k_off, v_off=v_off, start_n=start_n, offs_m=offs_m, T=T, stride_kt=stride_kt,
                stride_vt=stride_vt, scale=scale, m=m, l=l, acc=acc, repeated=repeated, ones=ones, smax=smax, eps=eps,
                TQ=T, LEFT=LEFT, RIGHT=RIGHT, key_row=key_row, qtags=qtags, aligned=aligned, softcap=softcap,
                BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL, MASKED=False, MASK=False, PAD=False, STAB=STAB,
                STATS=STATS, BETA=BETA, LOW=LOW, HIGH=HIGH, BOUNDED=BOUNDED, CLAMP_CEIL=CLAMP_CEIL, TMA=TMA,
                SOFTCAP=SOFTCAP, D_IN=D_IN)
        for start_n in range(free, hi, BLOCK_N):
            m, l, acc, repeated, ones, smax = _fwd_tile(
                q=q, K=KS, V=VS, k_off=k_off, v_off=v_off, start_n=start_n, offs_m=offs_m, T=T, stride_kt=stride_kt,
                stride_vt=stride_vt, scale=scale, m=m, l=l, acc=acc, repeated=repeated, ones=ones, smax=smax, eps=eps,
                TQ=T, LEFT=LEFT, RIGHT=RIGHT, key_row=key_row, qtags=qtags, aligned=aligned, softcap=softcap,
                BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL, MASKED=True, MASK=False, PAD=False, STAB=STAB,
                STATS=STATS, BETA=BETA, LOW=LOW, HIGH=HIGH, BOUNDED=BOUNDED, CLAMP_CEIL=CLAMP_CEIL, TMA=TMA,
                SOFTCAP=SOFTCAP, D_IN=D_IN)

    empty = m == float("-inf")  # rows that see no key: O = 0, lse = -inf
    o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l)[:, None])
    store_rows(O + head_offset(bh, H, stride_ob, stride_oh), o, offs_m, stride_ot, T, HEAD_DIM, D_IN)
    row_ok = offs_m < T
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, tl.where(empty, float("-inf"), m + tl.math.log2(l)), mask=row_ok)
    if STATS:
        add_stats(STAT_COUNTS, STAT_MAX, bh % H, repeated, ones, smax, row_ok, tl.minimum(T - pid_m * BLOCK_M, BLOCK_M),
                  _LOG2E)


# -- backward --------------------------------------------------------------------------------------------------------

@triton.jit
def _probs(q, k, lse, offs_m, offs_n, T, scale, TK, LEFT, RIGHT, qtags, ktags, aligned, softcap,
           CAUSAL: tl.constexpr, MASKED: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr):
    """P for one (queries, keys) tile, recomputed from the saved base-2 lse, and the cap's slope (`_scores`)."""
    s, slope = scores(dot(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), tl.float32), False), scale, softcap,
                       SOFTCAP=SOFTCAP, ROUNDED=False)
    # P <= 1 exactly; with scores ~1e11 the recomputed S can exceed the saved lse by a few fp32 ulps
    p = tl.math.exp2(tl.minimum(s - lse[:, None], 0.0))
    if MASK:
        p = tl.where(band_visible(offs_m, offs_n, T, TK, LEFT, RIGHT, qtags, ktags, aligned), p, 0.0)
    elif MASKED:
        p = tl.where(visible(offs_m, offs_n, T, CAUSAL), p, 0.0)
    return p, slope


@triton.jit
def _probs_t(k, q, lse, offs_n, offs_m, T, scale, TK, LEFT, RIGHT, qtags, ktags, aligned, softcap,
             CAUSAL: tl.constexpr, MASKED: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr):
    """Pᵀ for one (keys, queries) tile and the cap's slope: the dK/dV kernel's orientation of `_probs`."""
    st, slope = scores(dot(k, tl.trans(q), tl.zeros((k.shape[0], q.shape[0]), tl.float32), False), scale, softcap,
                        SOFTCAP=SOFTCAP, ROUNDED=False)
    pt = tl.math.exp2(tl.minimum(st - lse[None, :], 0.0))
    if MASK:
        pt = tl.where(band_visible_t(offs_n, offs_m, T, TK, LEFT, RIGHT, qtags, ktags, aligned), pt, 0.0)
    elif MASKED:
        valid = (offs_m[None, :] < T) & (offs_n[:, None] < T)
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        pt = tl.where(valid, pt, 0.0)
    return pt, slope


@triton.jit
def _dq_tile(q, do, lse, delta, K, V, k_off, v_off, start_n, offs_m, T, stride_kt, stride_vt, qk_scale, dq, TK, LEFT,
             RIGHT, key_row, qtags, aligned, softcap, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
             CAUSAL: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr, MASK: tl.constexpr, PAD: tl.constexpr,
             SOFTCAP: tl.constexpr, D_IN: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _tile_rows(K, k_off, start_n, stride_kt, TK, BLOCK_N, HEAD_DIM, TMA, D_IN=D_IN)
    v = _tile_rows(V, v_off, start_n, stride_vt, TK, BLOCK_N, HEAD_DIM, TMA, D_IN=D_IN)
    p, slope = _probs(q=q, k=k, lse=lse, offs_m=offs_m, offs_n=offs_n, T=T, scale=qk_scale, TK=TK, LEFT=LEFT,
                      RIGHT=RIGHT, qtags=qtags, ktags=key_tags(key_row, offs_n, TK, PAD), aligned=aligned,
                      softcap=softcap, CAUSAL=CAUSAL, MASKED=MASKED, MASK=MASK, SOFTCAP=SOFTCAP)
    dp = dot(do, tl.trans(v), tl.zeros((do.shape[0], BLOCK_N), tl.float32), False)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * slope
    return dot(cast(ds, k.dtype), k, dq, False)


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, O, LSE, DELTA, DQ, q_strides, k_strides, v_strides, do_strides, o_strides, g_strides, H, G, T,
    qk_scale, scale, band, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
    MASK: tl.constexpr = False, PAD: tl.constexpr = False, SEG: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    D_IN: tl.constexpr = 0, STRIDE8: tl.constexpr = False,
):
    """dQ (strides `g_strides`) of one query tile, over the key tiles it sees. It first computes its rows'
    δ = rowsum(dO ∘ O) and stores it for the dK/dV kernel, launched after it: one launch fewer than a δ pass."""
    stride_qb, stride_qh, stride_qt = row_strides(q_strides, STRIDE8)
    stride_kb, stride_kh, stride_kt = row_strides(k_strides, STRIDE8)
    stride_vb, stride_vh, stride_vt = row_strides(v_strides, STRIDE8)
    stride_dob, stride_doh, stride_dot = row_strides(do_strides, STRIDE8)
    stride_ob, stride_oh, stride_ot = row_strides(o_strides, STRIDE8)
    stride_gb, stride_gh, stride_gt = row_strides(g_strides, STRIDE8)
    KEEP, stride_keep, TK, LEFT, RIGHT = band
    qk_scale, scale, softcap = fp32(qk_scale), fp32(scale), fp32(softcap)
    pid_m = tl.program_id(0)
    bh, k_off, v_off, row_off, offs_m = query_tile_program(H, G, T, stride_kb, stride_kh, stride_vb, stride_vh, BLOCK_M)
    do = load_rows(DO + head_offset(bh, H, stride_dob, stride_doh), offs_m, stride_dot, T, HEAD_DIM, D_IN)
    o = load_rows(O + head_offset(bh, H, stride_ob, stride_oh), offs_m, stride_ot, T, HEAD_DIM, D_IN)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # before Q is loaded: fewer tiles live at once
    tl.store(DELTA + row_off + offs_m, delta, mask=offs_m < T)
    q = load_rows(Q + head_offset(bh, H, stride_qb, stride_qh), offs_m, stride_qt, T, HEAD_DIM, D_IN)
    lse = load_lse(LSE + row_off, offs_m, T)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)

    KS = _head_rows(K, k_off, stride_kt, TK, BLOCK_N, HEAD_DIM, TMA)
    VS = _head_rows(V, v_off, stride_vt, TK, BLOCK_N, HEAD_DIM, TMA)
    keep_row = KEEP + (bh // H).to(tl.int64) * stride_keep
    key_row = keep_row + T if SEG else keep_row
    qtags, aligned = query_tags(keep_row, stride_keep, offs_m, T, TK, SEG)
    if MASK:  # as the forward: every tile the band (and, packed, the rows' sequences) reaches, each masked
        if SEG:
            lo, hi = packed_keys(keep_row, stride_keep, offs_m, T, aligned, LEFT, RIGHT)
        else:
            lo, hi = band_keys(pid_m * BLOCK_M, BLOCK_M, BLOCK_N, T, TK, LEFT, RIGHT)
        for start_n in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            dq = _dq_tile(q=q, do=do, lse=lse, delta=delta, K=KS, V=VS, k_off=k_off, v_off=v_off, start_n=start_n,
                          offs_m=offs_m, T=T, stride_kt=stride_kt, stride_vt=stride_vt, qk_scale=qk_scale, dq=dq, TK=TK,
                          LEFT=LEFT, RIGHT=RIGHT, key_row=key_row, qtags=qtags, aligned=aligned, softcap=softcap,
                          BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=False, MASKED=True, TMA=TMA, MASK=True, PAD=PAD,
                          SOFTCAP=SOFTCAP, D_IN=D_IN)
    else:
        free = pid_m * BLOCK_M if CAUSAL else (T // BLOCK_N) * BLOCK_N
        hi = tl.minimum(T, (pid_m + 1) * BLOCK_M) if CAUSAL else T
        for start_n in range(0, free, BLOCK_N):
            dq = _dq_tile(q=q, do=do, lse=lse, delta=delta, K=KS, V=VS, k_off=k_off, v_off=v_off, start_n=start_n,
                          offs_m=offs_m, T=T, stride_kt=stride_kt, stride_vt=stride_vt, qk_scale=qk_scale, dq=dq, TK=T,
                          LEFT=LEFT, RIGHT=RIGHT, key_row=key_row, qtags=qtags, aligned=aligned, softcap=softcap,
                          BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL, MASKED=False, TMA=TMA, MASK=False,
                          PAD=False, SOFTCAP=SOFTCAP, D_IN=D_IN)
        for start_n in range(free, hi, BLOCK_N):
            dq = _dq_tile(q=q, do=do, lse=lse, delta=delta, K=KS, V=VS, k_off=k_off, v_off=v_off, start_n=start_n,
                          offs_m=offs_m, T=T, stride_kt=stride_kt, stride_vt=stride_vt, qk_scale=qk_scale, dq=dq, TK=T,
                          LEFT=LEFT, RIGHT=RIGHT, key_row=key_row, qtags=qtags, aligned=aligned, softcap=softcap,
                          BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL, MASKED=True, TMA=TMA, MASK=False,
                          PAD=False, SOFTCAP=SOFTCAP, D_IN=D_IN)
    store_rows(DQ + head_offset(bh, H, stride_gb, stride_gh), dq * scale, offs_m, stride_gt, T, HEAD_DIM, D_IN)


@triton.jit
def _group_heads(X, x_off, stride_h, stride_t, T, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                 TMA: tl.constexpr):
    """Under TMA, one tensor descriptor of a group's GROUP heads of (T, HEAD_DIM) rows from X + x_off, in blocks of
    ROWS rows of one head (rows past T read as 0); else X itself."""
    if TMA and GROUP == 1:
        d = tl.make_tensor_descriptor(X + x_off, [T, HEAD_DIM], [stride_t, 1], [ROWS, HEAD_DIM])
    elif TMA:
        d = tl.make_tensor_descriptor(X + x_off, [GROUP, T, HEAD_DIM], [stride_h, stride_t, 1], [1, ROWS, HEAD_DIM])
    else:
        d = X
    return d


@triton.jit
def _group_rows(X, x_off, g, stride_h, start, stride_t, T, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                TMA: tl.constexpr, D_IN: tl.constexpr):
    """Rows start..start+ROWS of the group's head g (`_group_heads`); rows past T read as 0, and a padded head
    dim's columns past D_IN."""
    if TMA and len(X.block_shape) == 2:
        t = X.load([start, 0])
    elif TMA:
        t = tl.reshape(X.load([g, start, 0]), (ROWS, HEAD_DIM))
    else:
        t = load_rows(X + x_off + g * stride_h, start + tl.arange(0, ROWS), stride_t, T, HEAD_DIM, D_IN)
    return t


@triton.jit
def _dkdv_tile(k, v, Q, DO, LSE, DELTA, DQ_ACC, q_off, do_off, first, g, start_m, offs_n, T, stride_qh, stride_qt,
               stride_doh, stride_dot, qk_scale, dk, dv, TK, LEFT, RIGHT, keep_row, stride_keep, ktags, softcap,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               TMA: tl.constexpr, MASK: tl.constexpr, SEG: tl.constexpr, SOFTCAP: tl.constexpr,
               ATOMIC_DQ: tl.constexpr, D_IN: tl.constexpr):
    """One query tile's share of dK and dV, of the group's query head g (batch·head first + g); with ATOMIC_DQ also
    its share of dQ / scale, added into the fp32 (B, H, T, HEAD_DIM) DQ_ACC."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _group_rows(X=Q, x_off=q_off, g=g, stride_h=stride_qh, start=start_m, stride_t=stride_qt, T=T, ROWS=BLOCK_M,
                    HEAD_DIM=HEAD_DIM, TMA=TMA, D_IN=D_IN)
    do = _group_rows(X=DO, x_off=do_off, g=g, stride_h=stride_doh, start=start_m, stride_t=stride_dot, T=T,
                     ROWS=BLOCK_M, HEAD_DIM=HEAD_DIM, TMA=TMA, D_IN=D_IN)
    row_off = (first + g).to(tl.int64) * T
    lse = load_lse(LSE + row_off, offs_m, T)
    delta = tl.load(DELTA + row_off + offs_m, mask=offs_m < T, other=0.0)
    qtags, aligned = query_tags(keep_row, stride_keep, offs_m, T, TK, SEG)
    pt, slope = _probs_t(k=k, q=q, lse=lse, offs_n=offs_n, offs_m=offs_m, T=T, scale=qk_scale, TK=TK, LEFT=LEFT,
                         RIGHT=RIGHT, qtags=qtags, ktags=ktags, aligned=aligned, softcap=softcap, CAUSAL=CAUSAL,
                         MASKED=MASKED, MASK=MASK, SOFTCAP=SOFTCAP)
    dv = dot(cast(pt, do.dtype), do, dv, False)
    dpt = dot(v, tl.trans(do), tl.zeros((v.shape[0], BLOCK_M), tl.float32), False)
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP:
        dst = dst * slope
    dst_op = cast(dst, q.dtype)
    if ATOMIC_DQ:  # this key tile's share of dQ: the separate dQ kernel would recompute P and dP for it
        dq = dot(tl.trans(dst_op), k, tl.zeros((BLOCK_M, HEAD_DIM), tl.float32), False)
        dq_ptrs = DQ_ACC + (row_off + offs_m[:, None]) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        tl.atomic_add(dq_ptrs, dq, mask=offs_m[:, None] < T, sem="relaxed")
    return dot(dst_op, q, dk, False), dv


@triton.jit
def _dkdv_tiles(k, v, dk, dv, Q, DO, LSE, DELTA, DQ_ACC, q_off, do_off, first, lo, hi, offs_n, T, stride_qh,
                stride_qt, stride_doh, stride_dot, qk_scale, TK, LEFT, RIGHT, keep_row, stride_keep, ktags, softcap,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr,
                MASKED: tl.constexpr, TMA: tl.constexpr, MASK: tl.constexpr, SEG: tl.constexpr,
                SOFTCAP: tl.constexpr, ATOMIC_DQ: tl.constexpr, D_IN: tl.constexpr):
    """The query tiles at lo, lo + BLOCK_M, ... below hi of each of the group's GROUP query heads, added to dk, dv.

    A group's heads run as one loop over (head, tile) pairs, which the compiler pipelines as it does one head's
    tiles: a loop per head (unrolled or not) made ptxas serialise the tensor-core products or spill
    (`research/offline_compile.py`)."""
    if GROUP == 1:
        for start_m in range(lo, hi, BLOCK_M):
            dk, dv = _dkdv_tile(k=k, v=v, Q=Q, DO=DO, LSE=LSE, DELTA=DELTA, DQ_ACC=DQ_ACC, q_off=q_off, do_off=do_off,
                                first=first, g=0, start_m=start_m, offs_n=offs_n, T=T, stride_qh=stride_qh,
                                stride_qt=stride_qt, stride_doh=stride_doh, stride_dot=stride_dot, qk_scale=qk_scale,
                                dk=dk, dv=dv, TK=TK, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row, stride_keep=stride_keep,
                                ktags=ktags, softcap=softcap, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL,
                                MASKED=MASKED, TMA=TMA, MASK=MASK, SEG=SEG, SOFTCAP=SOFTCAP, ATOMIC_DQ=ATOMIC_DQ,
                                D_IN=D_IN)
    else:
        tiles = tl.cdiv(hi - lo, BLOCK_M)  # <= 0 where there are none
        for i in range(GROUP * tiles):
            g = i // tiles
            dk, dv = _dkdv_tile(k=k, v=v, Q=Q, DO=DO, LSE=LSE, DELTA=DELTA, DQ_ACC=DQ_ACC, q_off=q_off, do_off=do_off,
                                first=first, g=g, start_m=lo + (i - g * tiles) * BLOCK_M, offs_n=offs_n, T=T,
                                stride_qh=stride_qh, stride_qt=stride_qt, stride_doh=stride_doh, stride_dot=stride_dot,
                                qk_scale=qk_scale, dk=dk, dv=dv, TK=TK, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row,
                                stride_keep=stride_keep, ktags=ktags, softcap=softcap, BLOCK_M=BLOCK_M,
                                HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL, MASKED=MASKED, TMA=TMA, MASK=MASK, SEG=SEG,
                                SOFTCAP=SOFTCAP, ATOMIC_DQ=ATOMIC_DQ, D_IN=D_IN)
    return dk, dv


@triton.jit
def _attn_bwd_delta(O, DO, DELTA, o_strides, do_strides, H, T, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    D_IN: tl.constexpr = 0, STRIDE8: tl.constexpr = False):
    """δ = rowsum(dO ∘ O) of one query tile, fp32, where the dQ kernel does not run to write it (ATOMIC_DQ)."""
    stride_ob, stride_oh, stride_ot = row_strides(o_strides, STRIDE8)
    stride_dob, stride_doh, stride_dot = row_strides(do_strides, STRIDE8)
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    do = load_rows(DO + head_offset(bh, H, stride_dob, stride_doh), offs_m, stride_dot, T, HEAD_DIM, D_IN)
    o = load_rows(O + head_offset(bh, H, stride_ob, stride_oh), offs_m, stride_ot, T, HEAD_DIM, D_IN)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(do.to(tl.float32) * o.to(tl.float32), 1), mask=offs_m < T)


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, q_strides, k_strides, v_strides, do_strides, g_strides, H, G, T, qk_scale,
    scale, band, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
    MASK: tl.constexpr = False, PAD: tl.constexpr = False, GROUP: tl.constexpr = 1, SEG: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False, ATOMIC_DQ: tl.constexpr = False, D_IN: tl.constexpr = 0,
    STRIDE8: tl.constexpr = False,
):
    """dK and dV (both with strides `g_strides`) of one key tile, over the query tiles that see it. With GROUP > 1
    (grouped-query attention, GROUP = G) a program serves one key/value head and sums its group's query heads in
    fp32 before it stores, as flash-attn 3 does, on a grid (B·H / G, key tiles): every head's first key tiles, which
    see the most causal query tiles, start before any head's last. Else one query head's share, grid (key tiles,
    B·H) (GQA with `group_sum_in_program` off, or under emulation: summed over each group by the launcher).
    ATOMIC_DQ (`KernelOptions.atomic_dq`): each program also adds its key tile's share of dQ / scale into the fp32
    DQ_ACC with atomics (FA2's backward, without the dQ kernel; δ from `_attn_bwd_delta`), in no fixed order."""
    stride_qb, stride_qh, stride_qt = row_strides(q_strides, STRIDE8)
    stride_kb, stride_kh, stride_kt = row_strides(k_strides, STRIDE8)
    stride_vb, stride_vh, stride_vt = row_strides(v_strides, STRIDE8)
    stride_dob, stride_doh, stride_dot = row_strides(do_strides, STRIDE8)
    stride_gb, stride_gh, stride_gt = row_strides(g_strides, STRIDE8)
    KEEP, stride_keep, TK, LEFT, RIGHT = band
    qk_scale, scale, softcap = fp32(qk_scale), fp32(scale), fp32(softcap)
    pid_n = tl.program_id(1) if GROUP > 1 else tl.program_id(0)
    program = tl.program_id(0) if GROUP > 1 else tl.program_id(1)
    first = program * GROUP  # the first query head (batch·head) of the program
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if TMA:
        k = tl.make_tensor_descriptor(K + kv_head_offset(first, H, G, stride_kb, stride_kh), [TK, HEAD_DIM],
                                      [stride_kt, 1], [BLOCK_N, HEAD_DIM]).load([pid_n * BLOCK_N, 0])
        v = tl.make_tensor_descriptor(V + kv_head_offset(first, H, G, stride_vb, stride_vh), [TK, HEAD_DIM],
                                      [stride_vt, 1], [BLOCK_N, HEAD_DIM]).load([pid_n * BLOCK_N, 0])
    else:
        k = load_rows(K + kv_head_offset(first, H, G, stride_kb, stride_kh), offs_n, stride_kt, TK, HEAD_DIM, D_IN)
        v = load_rows(V + kv_head_offset(first, H, G, stride_vb, stride_vh), offs_n, stride_vt, TK, HEAD_DIM, D_IN)
    keep_row = KEEP + (first // H).to(tl.int64) * stride_keep
    ktags = key_tags(keep_row + T if SEG else keep_row, offs_n, TK, PAD)
    q_off = head_offset(first, H, stride_qb, stride_qh)  # the group's first query head; the others follow by stride
    do_off = head_offset(first, H, stride_dob, stride_doh)
    QS = _group_heads(Q, q_off, stride_qh, stride_qt, T, BLOCK_M, HEAD_DIM, GROUP, TMA)
    DOS = _group_heads(DO, do_off, stride_doh, stride_dot, T, BLOCK_M, HEAD_DIM, GROUP, TMA)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    if MASK:  # every query tile whose band (and, packed, the keys' sequences) reaches this key tile, each masked
        if SEG:
            lo, hi = packed_queries(keep_row + T, stride_keep, offs_n, TK, LEFT, RIGHT)
        else:
            lo, hi = band_queries(pid_n * BLOCK_N, BLOCK_N, BLOCK_M, T, TK, LEFT, RIGHT)
        dk, dv = _dkdv_tiles(k=k, v=v, dk=dk, dv=dv, Q=QS, DO=DOS, LSE=LSE, DELTA=DELTA, DQ_ACC=DQ_ACC, q_off=q_off,
                             do_off=do_off, first=first, lo=(lo // BLOCK_M) * BLOCK_M, hi=hi, offs_n=offs_n, T=T,
                             stride_qh=stride_qh, stride_qt=stride_qt, stride_doh=stride_doh, stride_dot=stride_dot,
                             qk_scale=qk_scale, TK=TK, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row,
                             stride_keep=stride_keep, ktags=ktags, softcap=softcap, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM,
                             GROUP=GROUP, CAUSAL=False, MASKED=True, TMA=TMA, MASK=True, SEG=SEG, SOFTCAP=SOFTCAP,
                             ATOMIC_DQ=ATOMIC_DQ, D_IN=D_IN)
    else:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
        if ATOMIC_DQ:
            # query tiles crossing the diagonal need the causal mask; later ones, all but the ragged end, do not.
            # Merged into one masked loop, this form's wgmmas are serialised by ptxas (`research/tests/
            # test_kernel_compile.py`), so it keeps the three loops
            diag_end = tl.minimum((pid_n + 1) * BLOCK_N, T) if CAUSAL else lo
            free_end = tl.maximum(diag_end, (T // BLOCK_M) * BLOCK_M)
            dk, dv = _dkdv_tiles(k=k, v=v, dk=dk, dv=dv, Q=QS, DO=DOS, LSE=LSE, DELTA=DELTA, DQ_ACC=DQ_ACC,
                                 q_off=q_off, do_off=do_off, first=first, lo=lo, hi=diag_end, offs_n=offs_n, T=T,
                                 stride_qh=stride_qh, stride_qt=stride_qt, stride_doh=stride_doh, stride_dot=stride_dot,
                                 qk_scale=qk_scale, TK=T, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row,
                                 stride_keep=stride_keep, ktags=ktags, softcap=softcap, BLOCK_M=BLOCK_M,
                                 HEAD_DIM=HEAD_DIM, GROUP=GROUP, CAUSAL=CAUSAL, MASKED=True, TMA=TMA, MASK=False,
                                 SEG=False, SOFTCAP=SOFTCAP, ATOMIC_DQ=ATOMIC_DQ, D_IN=D_IN)
            dk, dv = _dkdv_tiles(k=k, v=v, dk=dk, dv=dv, Q=QS, DO=DOS, LSE=LSE, DELTA=DELTA, DQ_ACC=DQ_ACC,
                                 q_off=q_off, do_off=do_off, first=first, lo=diag_end, hi=free_end, offs_n=offs_n, T=T,
                                 stride_qh=stride_qh, stride_qt=stride_qt, stride_doh=stride_doh, stride_dot=stride_dot,
                                 qk_scale=qk_scale, TK=T, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row,
                                 stride_keep=stride_keep, ktags=ktags, softcap=softcap, BLOCK_M=BLOCK_M,
                                 HEAD_DIM=HEAD_DIM, GROUP=GROUP, CAUSAL=CAUSAL, MASKED=False, TMA=TMA, MASK=False,
                                 SEG=False, SOFTCAP=SOFTCAP, ATOMIC_DQ=ATOMIC_DQ, D_IN=D_IN)
            lo = free_end
        # one masked loop over every query tile that sees the key tile (from `lo`): split into the diagonal's, the
        # free and the ragged end's loops, the three copies of the body spilled at the picked D = 128 tile and ran
        # ~5% slower (`results/kernel-variants/`)
        dk, dv = _dkdv_tiles(k=k, v=v, dk=dk, dv=dv, Q=QS, DO=DOS, LSE=LSE, DELTA=DELTA, DQ_ACC=DQ_ACC, q_off=q_off,
                             do_off=do_off, first=first, lo=lo, hi=T, offs_n=offs_n, T=T,
                             stride_qh=stride_qh, stride_qt=stride_qt, stride_doh=stride_doh, stride_dot=stride_dot,
                             qk_scale=qk_scale, TK=T, LEFT=LEFT, RIGHT=RIGHT, keep_row=keep_row,
                             stride_keep=stride_keep, ktags=ktags, softcap=softcap, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM,
                             GROUP=GROUP, CAUSAL=CAUSAL, MASKED=True, TMA=TMA, MASK=False, SEG=False, SOFTCAP=SOFTCAP,
                             ATOMIC_DQ=ATOMIC_DQ, D_IN=D_IN)
    out = head_offset(program, H // GROUP, stride_gb, stride_gh)
    store_rows(DK + out, dk * scale, offs_n, stride_gt, TK, HEAD_DIM, D_IN)
    store_rows(DV + out, dv, offs_n, stride_gt, TK, HEAD_DIM, D_IN)
