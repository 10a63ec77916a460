"""The native forward on Hopper (sm_90), in Gluon: FA3's schedule, where the softmax runs while the tensor cores work.

Triton 3.6 waits for every wgmma but a loop-carried accumulator's and makes no warp-specialised partitions on sm_90,
so the Triton forward's softmax never overlaps a matmul (docs/kernel-notes.md). Here, per key tile j, the kernel
issues S_{j+1} = Q K_{j+1}ᵀ, rescales O, issues P̄_j V_j, waits for S_{j+1} alone and runs its softmax while P̄_j V_j
computes (FA3's intra-warpgroup order). K and V arrive by TMA through a ring of STAGES buffers, refilled by the
computing warps or by a loader warp of their own (`gl.warp_specialize`). With `Tile(pingpong=True)` the 128 rows are
two warpgroups of 64 rows, 240 registers each, that take turns to issue their matmuls through two mbarriers, so one's
softmax runs under the other's matmuls (FA3's inter-warpgroup schedule).

Production FA2 numerics only, with or without SFA and the statistics, exactly as `native._fwd_tile` computes them
per key tile (the `common.top2` pair reduction, `common.sfa_max`, the guarded P̄ = 1 count and `common.shift` of rows
that have seen no finite score); emulated presets stay in Triton. Causal or not, any T (TMA zero-fills rows past T;
columns past T are masked), head dims 64 and 128, bf16 and fp16, grouped-query attention (k and v of H / G heads, read
in place), 16-byte aligned rows (one device-side descriptor per head).
`launch.forward` launches it on sm_90 where `FORWARD_TILES` has a tile (measured: results/kernel-variants/).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from stableflash.attention.triton import common
from stableflash.attention.triton.spec import LOG2E

_LOG2E = gl.constexpr(LOG2E)
PINGPONG_REGS = gl.constexpr(240)  # registers per thread of the second computing warpgroup (the loader warp: 24)


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, tile, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, pred):
    """TMA loads of key tile `tile` (K and V) into buffer tile % STAGES, counted on that buffer's barrier."""
    stage = tile % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [tile * BLOCK_N, 0], bar, k_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [tile * BLOCK_N, 0], bar, v_smem.index(stage), pred=pred)


@gluon.constexpr_function
def _s_layout(num_warps, block_n):
    """S tiles in the wgmma accumulator layout: one warpgroup per 64 rows (P̄ is then the register A operand of
    P̄V, `gl.DotOperandLayout` of `_o_layout`)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 16])


@gluon.constexpr_function
def _o_layout(num_warps, head_dim):
    """The O accumulator's wgmma layout."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, head_dim, 16])


@gluon.jit
def _softmax_step(s, m_i, l_i, repeated, ones, smax, j, rows, mask_from, T, qk_scale, eps_u,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, S_LAYOUT: gl.constexpr, DTYPE: gl.constexpr,
                  STAB: gl.constexpr, BETA: gl.constexpr, LOW: gl.constexpr, HIGH: gl.constexpr,
                  BOUNDED: gl.constexpr, STATS: gl.constexpr):
    """Tile j's online-softmax update in base 2: returns P̄ in DTYPE, the rescale factor, the new m and l, and the
    statistics per row. With SFA (STAB 1) the tile's maximum is shifted where the row repeats it within eps; with
    STATS the rows with a repeated maximum, P̄ = 1 entries and the largest score are counted. Both as our Triton
    kernel does them (its `_top2` pair reduction, `_sfa_max` and guarded P̄ = 1 count), per 128-key tile."""
    s = libdevice.mul_rn(s, qk_scale)
    if (j + 1) * BLOCK_N > mask_from:  # the diagonal (causal) or the ragged end: the only tiles that need a mask
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        valid = cols[None, :] < T
        if CAUSAL:
            valid = valid & (rows[:, None] >= cols[None, :])
        s = gl.where(valid, s, float("-inf"))
    if STAB == 1 or STATS:
        # neighbouring columns paired first (a pair's top two are its max and min): 3 min/max per score, not 4
        a, b = gl.split(gl.reshape(s, [s.shape[0], s.shape[1] // 2, 2]))
        rm, r2 = gl.reduce((gl.maximum(a, b), gl.minimum(a, b)), 1, common.top2)
        rows_layout: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)  # the same rows, named as the other row vectors
        rm = gl.convert_layout(rm, rows_layout, assert_trivial=True)
        r2 = gl.convert_layout(r2, rows_layout, assert_trivial=True)
        near_row = (r2 >= rm - eps_u) & (rm > float("-inf"))
        tile_max = rm
        if STATS:
            smax = gl.maximum(smax, gl.where(rm < float("inf"), rm, float("-inf")))
            repeated = repeated | common.row_flags(near_row, tile_max > 0)  # P̄V in fp32: none biasable
        if STAB == 1:
            rm = common.sfa_max(rm, near_row, BETA, LOW, HIGH, BOUNDED, False)
    else:
        rm = gl.max(s, 1)
    m_new = gl.maximum(m_i, rm)
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # `common.shift`: no finite score yet gives 0, not NaN
    alpha = gl.exp2(m_i - m_shift)
    p = gl.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    p_op = p.to(DTYPE)
    if STATS:  # per score only on tiles where some row's second largest score is near the shift (see native.py)
        if gl.max((r2 >= m_shift - 0.01).to(gl.int32), 0) > 0:
            ones += gl.sum((p_op == 1.0).to(gl.int32), 1)
        else:
            ones += (gl.exp2(tile_max - m_shift).to(DTYPE) == 1.0).to(gl.int32)
    return p_op, alpha, m_new, l_i, repeated, ones, smax


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, ready_bars, empty_bars, n_tiles,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp (LOADER_WARP): streams every key tile into the ring, each buffer once the consumers have
    released it (a fresh barrier counts as released: the wait on the parity before its first phase passes)."""
    for t in range(n_tiles):
        mbarrier.wait(empty_bars.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
        _issue_kv(k_desc, v_desc, k_smem, v_smem, ready_bars, t, BLOCK_N, STAGES, True)


@gluon.jit
def _consume(k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready_bars, empty_bars, turn_bars,
             O, LSE, STAT_COUNTS, STAT_MAX, o_base, stride_ot, bh, h, m0, T, n_tiles, mask_from, qk_scale, eps_u,
             HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             CAUSAL: gl.constexpr, LOADER_WARP: gl.constexpr, STAB: gl.constexpr, BETA: gl.constexpr,
             LOW: gl.constexpr, HIGH: gl.constexpr, BOUNDED: gl.constexpr, STATS: gl.constexpr,
             PINGPONG: gl.constexpr, WG: gl.constexpr):
    """QKᵀ, the online softmax and P̄V over the key tiles for BLOCK_M rows from m0, then O and the log-sum-exp.
    Without LOADER_WARP these warps also refill the ring; with it they release each buffer to the loader warp.
    With PINGPONG two such warpgroups (WG 0 and 1, 64 rows each) take turns to issue their matmuls, so that one's
    softmax runs while the other's matmuls keep the tensor cores busy (FA3's inter-warpgroup schedule)."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _s_layout(gl.num_warps(), BLOCK_N)
    o_layout: gl.constexpr = _o_layout(gl.num_warps(), HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    repeated = gl.zeros([BLOCK_M], gl.int32, layout=row_layout)  # statistics (`common.row_flags`), per row
    ones = gl.zeros([BLOCK_M], gl.int32, layout=row_layout)
    smax = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, alpha, m_i, l_i, repeated, ones, smax = _softmax_step(
        s=s, m_i=m_i, l_i=l_i, repeated=repeated, ones=ones, smax=smax, j=0, rows=rows, mask_from=mask_from, T=T,
        qk_scale=qk_scale, eps_u=eps_u, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, S_LAYOUT=s_layout, DTYPE=dtype, STAB=STAB,
        BETA=BETA, LOW=LOW, HIGH=HIGH, BOUNDED=BOUNDED, STATS=STATS)
    p_op = gl.convert_layout(p, p_layout, assert_trivial=True)

    for j in range(n_tiles - 1):
        nxt = j + 1
        mbarrier.wait(ready_bars.index(nxt % STAGES), (nxt // STAGES) & 1)
        if PINGPONG:  # wait for this warpgroup's turn: the other's j-th issue (WG 0 goes first)
            mbarrier.wait(turn_bars.index(WG), (j & 1) ^ (1 - WG))
        s = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(p_op, v_smem.index(j % STAGES), acc, is_async=True)
        if PINGPONG:  # the other warpgroup may issue now, while this one waits for S_{j+1} and runs its softmax
            mbarrier.arrive(turn_bars.index(1 - WG))
        # issued S_{j+1}, then P̄_jV_j: one left outstanding is P̄_jV_j, which runs through tile j+1's softmax. Every
        # wait retires groups issued since the last full wait: a partial wait across the loop's back edge made ptxas
        # serialise every wgmma (C7514, docs/kernel-notes.md)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        p, alpha, m_i, l_i, repeated, ones, smax = _softmax_step(
            s=s, m_i=m_i, l_i=l_i, repeated=repeated, ones=ones, smax=smax, j=nxt, rows=rows, mask_from=mask_from, T=T,
            qk_scale=qk_scale, eps_u=eps_u, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, S_LAYOUT=s_layout, DTYPE=dtype, STAB=STAB,
            BETA=BETA, LOW=LOW, HIGH=HIGH, BOUNDED=BOUNDED, STATS=STATS)
        # P̄_j's registers are the running wgmma's operand: the wait names them so that nothing reuses them before
        # (without it the softmax's values overwrote them: NaN on the GPU)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        # P̄_jV_j done in this warpgroup; the barrier waits for the other's before buffer j % STAGES is refilled
        # with tile j + STAGES (one thread issues the copy) or released to the loader warp
        gl.thread_barrier()
        if LOADER_WARP:
            mbarrier.arrive(empty_bars.index(j % STAGES))
        else:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, ready_bars, j + STAGES, BLOCK_N, STAGES, j + STAGES < n_tiles)
        p_op = gl.convert_layout(p, p_layout, assert_trivial=True)

    last = n_tiles - 1
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))

    _store_rows(acc, m_i, l_i, rows, m0, T, O, o_base, stride_ot, LSE, bh, STAT_COUNTS, STAT_MAX, h, repeated, ones,
                smax, BLOCK_M, HEAD_DIM, STATS)


@gluon.jit
def _store_rows(acc, m_i, l_i, rows, m0, T, O, o_base, stride_ot, LSE, bh, STAT_COUNTS, STAT_MAX, h, repeated, ones,
                smax, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STATS: gl.constexpr):
    """One warpgroup's BLOCK_M rows from m0, done: O (its head's rows from o_base), the log-sum-exp and the
    statistics. Rows that saw no finite score (every key -inf) get O = 0 and lse = -inf, as the Triton kernel gives them."""
    o_layout: gl.constexpr = _o_layout(gl.num_warps(), HEAD_DIM)
    empty = m_i == float("-inf")
    l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), gl.SliceLayout(1, o_layout))
    o = acc / l_o[:, None]
    o_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + o_base + o_rows[:, None].to(gl.int64) * stride_ot + o_cols[None, :]
    gl.store(o_ptrs, o.to(O.dtype.element_ty), mask=o_rows[:, None] < T)
    gl.store(LSE + bh.to(gl.int64) * T + rows, gl.where(empty, float("-inf"), m_i + gl.log2(l_i)), mask=rows < T)
    if STATS:
        _add_stats(STAT_COUNTS, STAT_MAX, h, rows, repeated, ones, smax, m0, T, BLOCK_M)


@gluon.jit
def _add_stats(STAT_COUNTS, STAT_MAX, h, rows, repeated, ones, smax, m0, T, BLOCK_M: gl.constexpr):
    """The statistics of one warpgroup's rows: one reduction over the rows (padding rows left out), then relaxed
    atomics, as in native.py."""
    row_ok = rows < T
    flags = gl.where(row_ok, repeated, 0)
    n_repeated, n_positive, n_biasable, n_ones, row_max = gl.reduce(
        (flags & 1, (flags >> 1) & 1, (flags >> 2) & 1, gl.where(row_ok, ones, 0),
         gl.where(row_ok, smax, float("-inf"))), 0, common.stats_combine)
    counts = STAT_COUNTS + h * 5  # `stats.STAT_COLUMNS`' order
    gl.atomic_add(counts, n_repeated.to(gl.int64), sem="relaxed")
    gl.atomic_add(counts + 1, n_positive.to(gl.int64), sem="relaxed")
    gl.atomic_add(counts + 2, n_ones.to(gl.int64), sem="relaxed")
    gl.atomic_add(counts + 3, gl.maximum(gl.minimum(T - m0, BLOCK_M), 0).to(gl.int64), sem="relaxed")
    gl.atomic_add(counts + 4, n_biasable.to(gl.int64), sem="relaxed")
    gl.atomic_max(STAT_MAX + h, row_max / _LOG2E, sem="relaxed")


@gluon.jit
def _key_tiles(m0, T, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The key tiles a query tile from row m0 visits, and the first column that needs a mask."""
    if CAUSAL:
        hi = gl.minimum(T, m0 + BLOCK_M)
        mask_from = m0
    else:
        hi = T
        mask_from = T
    return gl.cdiv(hi, BLOCK_N), mask_from


@gluon.jit
def _attn_fwd(Q, K, V, O, LSE, STAT_COUNTS, STAT_MAX, q_strides, k_strides, v_strides, o_strides, H, G, T, qk_scale,
              eps_u, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, LOADER_WARP: gl.constexpr, STAB: gl.constexpr, BETA: gl.constexpr,
              LOW: gl.constexpr, HIGH: gl.constexpr, BOUNDED: gl.constexpr, STATS: gl.constexpr,
              HEAVY_FIRST: gl.constexpr, PINGPONG: gl.constexpr, Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
              num_warps: gl.constexpr):
    stride_qb, stride_qh, stride_qt = q_strides
    stride_kb, stride_kh, stride_kt = k_strides
    stride_vb, stride_vh, stride_vt = v_strides
    stride_ob, stride_oh, stride_ot = o_strides
    gl.static_assert(STAGES >= 3, "a buffer is refilled once its P̄V completes: three keep each load a tile ahead")
    gl.static_assert(not PINGPONG or (LOADER_WARP and num_warps == 4 and BLOCK_M == 128),
                     "pingpong: two warpgroups of 64 rows (the kernel's 4 warps and a worker's) and a loader warp")
    CONSUMERS: gl.constexpr = 2 if PINGPONG else 1
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS  # query rows per computing partition
    dtype: gl.constexpr = Q.dtype.element_ty
    if HEAVY_FIRST:  # grid (heads, query tiles): each head's longest causal row block starts first, as in FA3
        pid_m = gl.num_programs(1) - 1 - gl.program_id(1) if CAUSAL else gl.program_id(1)
        bh = gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    hk = h // G  # the key/value head of query head h (G query heads per key/value head: grouped-query attention)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, [T, HEAD_DIM], [stride_qt, 1],
                                        [ROWS, HEAD_DIM], Q_LAYOUT)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + hk * stride_kh, [T, HEAD_DIM], [stride_kt, 1],
                                        [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + hk * stride_vh, [T, HEAD_DIM], [stride_vt, 1],
                                        [BLOCK_N, HEAD_DIM], KV_LAYOUT)

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=CONSUMERS)  # each computing partition releases each buffer
    for i in gl.static_range(2):
        mbarrier.init(turn_bars.index(i), count=1)

    m0 = pid_m * BLOCK_M
    n_tiles, mask_from = _key_tiles(m0, T, BLOCK_M, BLOCK_N, CAUSAL)

    for i in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [m0 + i * ROWS, 0], q_bars.index(i), q_smem.index(i))
    o_base = b * stride_ob + h * stride_oh
    if PINGPONG:  # two computing warpgroups taking turns, and FA3's loader warp
        gl.warp_specialize([
            (_consume, (k_desc, v_desc, q_smem.index(0), k_smem, v_smem, q_bars.index(0), ready_bars, empty_bars,
                        turn_bars, O, LSE, STAT_COUNTS, STAT_MAX, o_base, stride_ot, bh, h, m0, T, n_tiles, mask_from,
                        qk_scale, eps_u, HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, LOADER_WARP, STAB, BETA, LOW, HIGH,
                        BOUNDED, STATS, PINGPONG, 0)),
            (_consume, (k_desc, v_desc, q_smem.index(1), k_smem, v_smem, q_bars.index(1), ready_bars, empty_bars,
                        turn_bars, O, LSE, STAT_COUNTS, STAT_MAX, o_base, stride_ot, bh, h, m0 + ROWS, T, n_tiles,
                        mask_from, qk_scale, eps_u, HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, LOADER_WARP, STAB, BETA,
                        LOW, HIGH, BOUNDED, STATS, PINGPONG, 1)),
            (_load_kv, (k_desc, v_desc, k_smem, v_smem, ready_bars, empty_bars, n_tiles, BLOCK_N, STAGES))],
            [4, 1], [PINGPONG_REGS, 24])
    elif LOADER_WARP:  # FA3's split: one warp streams K and V, these warps compute
        gl.warp_specialize([
            (_consume, (k_desc, v_desc, q_smem.index(0), k_smem, v_smem, q_bars.index(0), ready_bars, empty_bars,
                        turn_bars, O, LSE, STAT_COUNTS, STAT_MAX, o_base, stride_ot, bh, h, m0, T, n_tiles, mask_from,
                        qk_scale, eps_u, HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, LOADER_WARP, STAB, BETA, LOW, HIGH,
                        BOUNDED, STATS, PINGPONG, 0)),
            (_load_kv, (k_desc, v_desc, k_smem, v_smem, ready_bars, empty_bars, n_tiles, BLOCK_N, STAGES))],
            [1], [24])
    else:
        for i in gl.static_range(STAGES):
            _issue_kv(k_desc, v_desc, k_smem, v_smem, ready_bars, i, BLOCK_N, STAGES, i < n_tiles)
        _consume(k_desc=k_desc, v_desc=v_desc, q_smem=q_smem.index(0), k_smem=k_smem, v_smem=v_smem,
                 q_bar=q_bars.index(0), ready_bars=ready_bars, empty_bars=empty_bars, turn_bars=turn_bars, O=O, LSE=LSE,
                 STAT_COUNTS=STAT_COUNTS, STAT_MAX=STAT_MAX, o_base=o_base, stride_ot=stride_ot, bh=bh, h=h, m0=m0, T=T,
                 n_tiles=n_tiles, mask_from=mask_from, qk_scale=qk_scale, eps_u=eps_u, HEAD_DIM=HEAD_DIM, BLOCK_M=ROWS,
                 BLOCK_N=BLOCK_N, STAGES=STAGES, CAUSAL=CAUSAL, LOADER_WARP=LOADER_WARP, STAB=STAB, BETA=BETA, LOW=LOW,
                 HIGH=HIGH, BOUNDED=BOUNDED, STATS=STATS, PINGPONG=PINGPONG, WG=0)
    for i in gl.static_range(CONSUMERS):
        mbarrier.invalidate(q_bars.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready_bars.index(i))
        mbarrier.invalidate(empty_bars.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn_bars.index(i))


class Tile(NamedTuple):
    """One launch shape: query rows and keys per tile, K/V ring buffers, warps (a warpgroup per 64 rows), whether
    the grid runs each head's heaviest causal row block first, and pingpong (128 rows on two warpgroups of their
    own taking turns, `warps` 4: the kernel's, plus a worker warpgroup and the loader warp)."""
    block_m: int = 128
    block_n: int = 128
    stages: int = 3
    warps: int = 8
    heavy_first: bool = False
    pingpong: bool = False

    def __str__(self):
        return (f"{self.block_m}x{self.block_n}/{self.stages}st/{self.warps}w{'/heavy' if self.heavy_first else ''}"
                f"{'/pingpong' if self.pingpong else ''}")


class Choice(NamedTuple):
    """Where `launch.forward` launches the Gluon forward: its tile, from this sequence length on."""
    tile: Tile
    min_seq_len: int


# By head dim and whether the softmax does SFA's or the statistics' work; None keeps the Triton forward. Each choice
# and its shortest T come from same-run comparisons against the Triton forward (results/kernel-variants/).
FORWARD_TILES: dict[tuple[int, bool], Choice | None] = {
    (64, False): Choice(Tile(128, 64, 4, 8, heavy_first=True), 4096),
    (64, True): None,
    (128, False): Choice(Tile(128, 128, 3, 4, heavy_first=True, pingpong=True), 4096),
    (128, True): Choice(Tile(128, 128, 3, 4, heavy_first=True, pingpong=True), 4096),
}


def layouts(head_dim: int, dtype: torch.dtype, block_m: int, block_n: int):
    """Shared-memory layouts of the Q tile and of the K/V tiles (the wgmma operands' swizzle)."""
    gdtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gdtype),
            gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gdtype))


def constants(head_dim: int, dtype: torch.dtype, causal: bool, tile: Tile, *, stab: int, beta: float, low: float,
              high: float, bounded: bool, stats: bool, loader_warp: bool = False) -> dict:
    """The kernel's compile-time arguments but `num_warps` (the launch's, `tile.warps`): tile, layouts, switches;
    SFA's as `spec.KernelSpec` holds them (`stab` 0 plain, 1 SFA)."""
    if stab not in (0, 1):
        raise ValueError(f"stab: the Hopper forward does plain (0) or SFA (1) softmax, got {stab}")
    rows = tile.block_m // 2 if tile.pingpong else tile.block_m  # per computing warpgroup pair or group
    q_layout, kv_layout = layouts(head_dim, dtype, rows, tile.block_n)
    return dict(HEAD_DIM=head_dim, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, STAGES=tile.stages, CAUSAL=causal,
                LOADER_WARP=loader_warp or tile.pingpong, STAB=stab, BETA=beta, LOW=low, HIGH=high, BOUNDED=bounded,
                STATS=stats, HEAVY_FIRST=tile.heavy_first, PINGPONG=tile.pingpong, Q_LAYOUT=q_layout,
                KV_LAYOUT=kv_layout)


def grid(batch_heads: int, T: int, tile: Tile) -> tuple[int, int]:
    """(heads, query tiles) when each head's heaviest causal row block goes first, else (query tiles, heads)."""
    row_blocks = -(-T // tile.block_m)
    return (batch_heads, row_blocks) if tile.heavy_first else (row_blocks, batch_heads)
