"""Study: a Hopper attention forward in Gluon that overlaps the softmax with the tensor cores (FA3's intra-warpgroup
pipelining), against our Triton forward and cuDNN.

Why (docs/kernel-notes.md): Triton 3.6 waits for every wgmma but a loop-carried accumulator's, and its warp
specialisation makes no partitions on sm_90, so our forward's softmax never overlaps a matmul; cuDNN's does. Gluon
exposes the pieces: asynchronous `warpgroup_mma`, `warpgroup_mma_wait(num_outstanding)`, TMA and mbarriers. Per
key tile j this kernel issues S_{j+1} = Q K_{j+1}ᵀ, rescales O, issues P̄_j V_j, waits for S_{j+1} alone and runs
its softmax while P̄_j V_j computes (FA3's order). (A first schedule ran tile j's softmax with S_{j+1} and
P̄_{j-1}V_{j-1} in flight and waited for the older alone; ptxas serialised every wgmma of that kernel, which is why
it measured no faster than our Triton forward: `offline.wgmma_serialization`.) K and V arrive by TMA
through a ring of STAGES buffers, a tile's buffer refilled once its P̄V has completed: by the computing warps
themselves, or (`loader_warp`, FA3's split) by a warp of their own through `gl.warp_specialize`, the computing warps
releasing each buffer on an mbarrier. With `Tile(pingpong=True)` the 128 rows are two partitions of one warpgroup
each, 240 registers apiece, that take turns to issue their matmuls through two mbarriers (FA3's inter-warpgroup
schedule: one's softmax under the other's matmuls); compiled offline only so far (docs/kernel-notes.md).

Native FA2 numerics, with or without SFA and the statistics (per 128-key tile, through the Triton kernels' own
`_top2`, `_sfa_max` and `_stats_combine`); no emulation: the study asks how much faster the forward gets, and what
SFA and the statistics cost in it. Scores are scaled by `mul.rn` before the maximum, as in our kernel
(docs/kernel-notes.md: NaN at huge scores otherwise).
Causal or not, any T (TMA zero-fills rows past T; columns past T are masked), head dims 64 and 128, bf16 and fp16;
16-byte aligned rows (device-side descriptors, one per head).

    python benchmarks/gluon_forward.py --out results/gluon-forward-h200.json     # on an H200: check, then time
The kernel compiles for sm_90 on any machine (tests/attention/test_kernel_compile.py does, without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from stableflash import SFA, AttentionStats, flash_attention
from stableflash.attention.precision import resolve
from stableflash.attention.triton import kernels
from stableflash.attention.triton.ops import ensure_scratch_allocator, tma_streamable
from stableflash.attention.triton.spec import build_spec

LOG2E = 1.4426950408889634
_LOG2E = gl.constexpr(LOG2E)
PINGPONG_REGS = gl.constexpr(240)  # registers per thread of the second computing warpgroup (the loader warp: 24)
SHAPES = [(16, 12, 1024, 64), (4, 12, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)]


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, tile, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, pred):
    """TMA loads of key tile `tile` (K and V) into buffer tile % STAGES, counted on that buffer's barrier."""
    stage = tile % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [tile * BLOCK_N, 0], bar, k_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [tile * BLOCK_N, 0], bar, v_smem.index(stage), pred=pred)


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
        rm, r2 = gl.reduce((gl.maximum(a, b), gl.minimum(a, b)), 1, kernels._top2)
        rows_layout: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)  # the same rows, named as the other row vectors
        rm = gl.convert_layout(rm, rows_layout, assert_trivial=True)
        r2 = gl.convert_layout(r2, rows_layout, assert_trivial=True)
        near_row = (r2 >= rm - eps_u) & (rm > float("-inf"))
        tile_max = rm
        if STATS:
            smax = gl.maximum(smax, gl.where(rm < float("inf"), rm, float("-inf")))
            repeated = gl.maximum(repeated, near_row.to(gl.int32))
        if STAB == 1:
            rm = kernels._sfa_max(rm, near_row, BETA, LOW, HIGH, BOUNDED, False)
    else:
        rm = gl.max(s, 1)
    m_new = gl.maximum(m_i, rm)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    p_op = p.to(DTYPE)
    if STATS:  # per score only on tiles where some row's second largest score is near the shift (see kernels.py)
        if gl.max((r2 >= m_new - 0.01).to(gl.int32), 0) > 0:
            ones += gl.sum((p_op == 1.0).to(gl.int32), 1)
        else:
            ones += (gl.exp2(tile_max - m_new).to(DTYPE) == 1.0).to(gl.int32)
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
    num_warps: gl.constexpr = gl.num_warps()
    # one warpgroup per 64 rows; S tiles and O in wgmma accumulator layouts, P̄ as the register A operand of P̄V
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    repeated = gl.zeros([BLOCK_M], gl.int32, layout=row_layout)  # statistics, per row until the end
    ones = gl.zeros([BLOCK_M], gl.int32, layout=row_layout)
    smax = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, alpha, m_i, l_i, repeated, ones, smax = _softmax_step(
        s, m_i, l_i, repeated, ones, smax, 0, rows, mask_from, T, qk_scale, eps_u, BLOCK_N, CAUSAL, s_layout,
        dtype, STAB, BETA, LOW, HIGH, BOUNDED, STATS)
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
            s, m_i, l_i, repeated, ones, smax, nxt, rows, mask_from, T, qk_scale, eps_u, BLOCK_N, CAUSAL, s_layout,
            dtype, STAB, BETA, LOW, HIGH, BOUNDED, STATS)
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

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o = acc / l_o[:, None]
    o_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + o_base + o_rows[:, None].to(gl.int64) * stride_ot + o_cols[None, :]
    gl.store(o_ptrs, o.to(dtype), mask=o_rows[:, None] < T)
    gl.store(LSE + bh.to(gl.int64) * T + rows, m_i + gl.log2(l_i), mask=rows < T)
    if STATS:  # one reduction over the rows (padding rows left out), then relaxed atomics, as in kernels.py
        row_ok = rows < T
        n_repeated, n_ones, row_max = gl.reduce((gl.where(row_ok, repeated, 0), gl.where(row_ok, ones, 0),
                                                 gl.where(row_ok, smax, float("-inf"))), 0, kernels._stats_combine)
        gl.atomic_add(STAT_COUNTS + h * 2, n_repeated, sem="relaxed")
        gl.atomic_add(STAT_COUNTS + h * 2 + 1, n_ones, sem="relaxed")
        gl.atomic_max(STAT_MAX + h, row_max / _LOG2E, sem="relaxed")


@gluon.jit
def _attn_fwd_hopper(Q, K, V, O, LSE, STAT_COUNTS, STAT_MAX,
                     stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                     stride_ob, stride_oh, stride_ot, H, T, qk_scale, eps_u,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, LOADER_WARP: gl.constexpr, STAB: gl.constexpr, BETA: gl.constexpr,
                     LOW: gl.constexpr, HIGH: gl.constexpr, BOUNDED: gl.constexpr, STATS: gl.constexpr,
                     HEAVY_FIRST: gl.constexpr, PINGPONG: gl.constexpr, Q_LAYOUT: gl.constexpr,
                     KV_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
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
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, [T, HEAD_DIM], [stride_qt, 1],
                                        [ROWS, HEAD_DIM], Q_LAYOUT)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, [T, HEAD_DIM], [stride_kt, 1],
                                        [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, [T, HEAD_DIM], [stride_vt, 1],
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
    if CAUSAL:
        hi = gl.minimum(T, m0 + BLOCK_M)
        mask_from = m0
    else:
        hi = T
        mask_from = T
    n_tiles = gl.cdiv(hi, BLOCK_N)

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
        _consume(k_desc, v_desc, q_smem.index(0), k_smem, v_smem, q_bars.index(0), ready_bars, empty_bars,
                 turn_bars, O, LSE, STAT_COUNTS, STAT_MAX, o_base, stride_ot, bh, h, m0, T, n_tiles, mask_from, qk_scale,
                 eps_u, HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, LOADER_WARP, STAB, BETA, LOW, HIGH, BOUNDED, STATS,
                 PINGPONG, 0)
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


def tile_for(head_dim: int) -> Tile:
    """The study's tile: 128 query rows on two warpgroups, one CTA per SM; three K/V buffers fit 227 KB at D = 128."""
    return Tile(stages=3) if head_dim == 128 else Tile(stages=4)


# The sweep (`--sweep`): with 128 rows on 8 warps only one CTA fits an SM (registers at D = 64, shared memory at
# D = 128), so nothing hides its prologue and epilogue or runs during its softmax; one warpgroup per CTA (64 rows)
# lets two or more CTAs share an SM and the scheduler interleave them (pingpong without barriers).
# CTAs per SM offline (sm_90, plain / SFA + statistics): D = 64: 128x128/4 1/1, 64x128/3 2/2, 64x64/3 and /4 3/3,
# 128x64/4 2/1; D = 128: 128x128/3 1/1, 64x64/3 2/2, 64x128/3 1/1, 128x64/4 1/1.
# Pingpong (last, so that a hang there, which only a GPU can show, loses nothing else; `--only pingpong` runs them
# alone): 128 rows on two warpgroups of 64 that take turns, 240 registers each, and the loader warp.
SWEEP_TILES = {
    64: [Tile(128, 128, 4, 8), Tile(128, 128, 4, 8, True), Tile(64, 128, 3, 4, True), Tile(64, 64, 3, 4, True),
         Tile(64, 64, 4, 4, True), Tile(128, 64, 4, 8, True), Tile(128, 128, 4, 4, True, True),
         Tile(128, 64, 4, 4, True, True)],
    128: [Tile(128, 128, 3, 8), Tile(128, 128, 3, 8, True), Tile(64, 64, 3, 4, True), Tile(64, 128, 3, 4, True),
          Tile(128, 64, 4, 8, True), Tile(128, 128, 3, 4, True, True), Tile(128, 64, 4, 4, True, True)],
}
SWEEP_CHECK_SHAPES = {64: [(2, 3, 77, 64), (1, 4, 513, 64)], 128: [(1, 3, 333, 128), (2, 2, 1000, 128)]}


def layouts(head_dim: int, dtype, block_m: int, block_n: int):
    gdtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gdtype),
            gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gdtype))


def softmax_constants(stabilize, stats_eps: float | None, dtype, T: int) -> dict:
    """SFA's compile-time constants, whether to count statistics, and eps in base 2 (SFA's, else the statistics'),
    as our Triton kernel gets them."""
    spec = build_spec(resolve("fa2"), stabilize, dtype, T)
    eps_u = spec.eps if stabilize is not None else (stats_eps or 0.0) * LOG2E
    return dict(STAB=spec.stab, BETA=spec.beta, LOW=spec.low, HIGH=spec.high, BOUNDED=spec.bounded,
                STATS=stats_eps is not None, eps_u=eps_u)


def launch_constants(head_dim: int, dtype, T: int, causal: bool, loader_warp: bool = False, stabilize=None,
                     stats_eps=None, tile: Tile | None = None) -> tuple[dict, float]:
    """The kernel's compile-time arguments (tile, layouts, switches, warps) and its runtime eps, base 2."""
    tile = tile or tile_for(head_dim)
    rows = tile.block_m // 2 if tile.pingpong else tile.block_m  # per computing warpgroup pair or group
    q_layout, kv_layout = layouts(head_dim, dtype, rows, tile.block_n)
    softmax = softmax_constants(stabilize, stats_eps, dtype, T)
    eps_u = softmax.pop("eps_u")
    return dict(HEAD_DIM=head_dim, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, STAGES=tile.stages, CAUSAL=causal,
                LOADER_WARP=loader_warp or tile.pingpong, **softmax, HEAVY_FIRST=tile.heavy_first,
                PINGPONG=tile.pingpong, Q_LAYOUT=q_layout, KV_LAYOUT=kv_layout, num_warps=tile.warps), eps_u


def forward(q, k, v, causal: bool, scale: float, loader_warp: bool = False, stabilize=None, stats_eps=None,
            tile: Tile | None = None):
    """The Gluon kernel: attention output (B, H, T, D), log-sum-exp (B, H, T, base 2), and the statistics (rows with
    a repeated maximum and P̄ = 1 entries per head, (H, 2) int32; largest score per head, (H,)) when `stats_eps` is
    given. `loader_warp`: K and V streamed by a warp of their own (`gl.warp_specialize`) rather than by the
    computing warps; `stabilize`: None or an `SFA`; `tile`: the launch shape (default `tile_for(D)`)."""
    B, H, T, D = q.shape
    if D not in (64, 128) or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q: the Gluon study takes head dims 64 and 128 in bf16 or fp16, got {D} and {q.dtype}")
    if not tma_streamable(q, k, v):
        raise ValueError("q, k, v: the Gluon study loads rows by TMA: 16-byte aligned bases and row strides needed")
    ensure_scratch_allocator()  # device-side descriptors
    constants, eps_u = launch_constants(D, q.dtype, T, causal, loader_warp, stabilize, stats_eps, tile)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    counts = torch.zeros(H, 2, device=q.device, dtype=torch.int32)
    smax = torch.full((H,), float("-inf"), device=q.device, dtype=torch.float32)
    row_blocks = triton.cdiv(T, constants["BLOCK_M"])
    grid = (B * H, row_blocks) if constants["HEAVY_FIRST"] else (row_blocks, B * H)
    _attn_fwd_hopper[grid](q, k, v, out, lse, counts, smax, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                           *out.stride()[:3], H, T, scale * LOG2E, eps_u, **constants)
    return out, lse, counts, smax


def check(shape, causal: bool, loader_warp: bool, stabilize=None, stats: bool = False, tile: Tile | None = None) -> dict:
    """Our Triton kernels' rules: the error against fp64 within twice that of the reference backend under the same
    numerics (`fa2`, SFA per 128-key tile as here), plus an ulp; statistics equal to the reference's at the same
    tiles. Keys 3 and 5 are made the same large key, so most rows repeat their maximum (SFA shifts them; the
    statistics count them)."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if stabilize is not None or stats:
        k[:, :, 3] = k[:, :, 5] = (4 * q.float().mean(dim=2)).to(k.dtype)
    scale = shape[-1] ** -0.5
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    ref_stats = AttentionStats(shape[1]) if stats else None
    tile = tile or tile_for(shape[-1])
    ours, _, counts, smax = forward(q, k, v, causal, scale, loader_warp, stabilize,
                                    ref_stats.eps if stats else None, tile)
    fa2_at_tile = resolve("fa2").replace(block_m=tile.block_m, block_n=tile.block_n)
    reference = flash_attention(q, k, v, causal=causal, precision=fa2_at_tile,
                                stabilize=stabilize, backend="reference", stats=ref_stats)
    err = (ours.double() - exact).abs().max().item()
    ref_err = (reference.double() - exact).abs().max().item()
    ulp = exact.abs().max().item() * 2.0 ** -8
    ok = bool(torch.isfinite(ours).all()) and err <= 2 * ref_err + ulp
    if stats:
        ok = (ok and counts[:, 0].tolist() == ref_stats.repeated_max_rows.tolist()
              and counts[:, 1].tolist() == ref_stats.pbar_ones.tolist()
              and torch.allclose(smax.cpu(), ref_stats.max_score.cpu(), rtol=1e-2))
    return {"shape": list(shape), "causal": causal, "loader_warp": loader_warp, "sfa": stabilize is not None,
            "stats": stats, "tile": str(tile), "max_err": err, "reference_max_err": ref_err, "ok": ok}


# the Gluon variants timed, by their (loader_warp, sfa, stats) switches: a variant whose check failed is not timed
GLUON_RUNS = {"gluon": (False, False, False), "gluon-loader-warp": (True, False, False),
              "gluon-sfa": (False, True, False), "gluon-sfa-stats": (False, True, True)}


def timed(shape, skip=()) -> dict:
    """Forward TFLOP/s from a CUDA graph: the Gluon study, our Triton kernel (fa2 numerics) and SDPA's cuDNN;
    the runs named in `skip` are left out (None)."""
    B, H, T, D = shape
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * T * T * D / 2

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    sfa, stats = SFA(), AttentionStats(H)
    runs = {"gluon": lambda: forward(q, k, v, True, D ** -0.5),
            "gluon-loader-warp": lambda: forward(q, k, v, True, D ** -0.5, loader_warp=True),
            "gluon-sfa": lambda: forward(q, k, v, True, D ** -0.5, stabilize=sfa),
            "gluon-sfa-stats": lambda: forward(q, k, v, True, D ** -0.5, stabilize=sfa, stats_eps=stats.eps),
            "triton": lambda: flash_attention(q, k, v, causal=True, backend="triton"),
            "triton-sfa": lambda: flash_attention(q, k, v, causal=True, backend="triton", stabilize=sfa),
            "triton-sfa-stats": lambda: flash_attention(q, k, v, causal=True, backend="triton", stabilize=sfa,
                                                        stats=stats),
            "cudnn": cudnn}
    row = {"shape": list(shape)}
    for name, fn in runs.items():
        if name in skip:
            row[name] = None
            continue
        fn()
        row[name] = flops / (triton.testing.do_bench_cudagraph(fn, rep=100) * 1e-3) / 1e12
    return row


def timed_tile(shape, tile: Tile, base: dict) -> dict:
    """Forward TFLOP/s from a CUDA graph on one launch tile, plain and with SFA + statistics, and their ratios to
    `base` (a `timed` row: our Triton forward and cuDNN at the same shape)."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * shape[0] * shape[1] * shape[2] ** 2 * shape[3] / 2
    scale, stats_eps = shape[-1] ** -0.5, AttentionStats(1).eps
    runs = {"plain": lambda: forward(q, k, v, True, scale, tile=tile),
            "sfa-stats": lambda: forward(q, k, v, True, scale, stabilize=SFA(), stats_eps=stats_eps, tile=tile)}
    row = {"shape": list(shape)}
    for name, fn in runs.items():
        fn()
        row[name] = flops / (triton.testing.do_bench_cudagraph(fn, rep=100) * 1e-3) / 1e12
    return {**row, "vs_triton": row["plain"] / base["triton"], "vs_cudnn": row["plain"] / base["cudnn"],
            "sfa_stats_vs_triton": row["sfa-stats"] / base["triton-sfa-stats"]}


def sweep(shapes, out: Path, meta: dict, only: str = "") -> None:
    """Every tile of SWEEP_TILES (whose name contains `only`) at the shapes of its head dim: four checks (both
    shapes, causal and not, plain and SFA + statistics), then, if all pass, forward TFLOP/s plain and with SFA +
    statistics beside our Triton forward and cuDNN. The JSON is rewritten after each tile, so a run cut short keeps
    what it measured."""
    sfa = SFA()
    baselines = {shape: timed(shape, skip=set(GLUON_RUNS)) for shape in shapes}
    result = {"meta": meta, "baselines": [baselines[s] for s in shapes], "tiles": []}
    for head_dim in sorted({s[-1] for s in shapes}):
        small, big = SWEEP_CHECK_SHAPES[head_dim]
        for tile in (t for t in SWEEP_TILES[head_dim] if only in str(t)):
            checks = [check(small, True, False, tile=tile), check(big, True, False, sfa, True, tile),
                      check(big, False, False, tile=tile), check(small, False, False, sfa, True, tile)]
            ok = all(c["ok"] for c in checks)
            entry = {"head_dim": head_dim, "tile": str(tile), "checks": checks}
            entry["rows"] = [timed_tile(shape, tile, baselines[shape]) for shape in shapes
                             if shape[-1] == head_dim and ok]
            result["tiles"].append(entry)
            print(f"D={head_dim} {str(tile):<24} checks {'ok' if ok else 'FAILED'}" + "".join(
                f"  {tuple(r['shape'])}: {r['plain']:.0f} ({r['vs_triton']:.2f}x triton, {r['vs_cudnn']:.2f}x cudnn),"
                f" sfa+stats {r['sfa-stats']:.0f} ({r['sfa_stats_vs_triton']:.2f}x)" for r in entry["rows"]), flush=True)
            out.write_text(json.dumps(result, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/gluon-forward-h200.json"))
    parser.add_argument("--shapes", default=None, help="B,H,T,D;...")
    parser.add_argument("--sweep", action="store_true", help="the launch tiles of SWEEP_TILES instead of the study")
    parser.add_argument("--only", default="", help="with --sweep: only the tiles whose name contains this")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("STABLEFLASH_COMMIT"),
            "timing": "do_bench_cudagraph median, forward only, causal bf16", "flops": "4*B*H*T^2*D/2"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        sweep(shapes, args.out, meta, args.only)
        return
    checks = [check(s, c, w, z, st) for s in [(2, 3, 77, 64), (1, 4, 513, 64), (2, 2, 1000, 128)]
              for c in (True, False) for w in (False, True) for z in (None, SFA()) for st in (False, True)]
    for c in checks:
        print(f"check {c['shape']} causal={c['causal']} loader_warp={c['loader_warp']} sfa={c['sfa']} "
              f"stats={c['stats']}: max err {c['max_err']:.2e} (reference {c['reference_max_err']:.2e}) "
              f"{'ok' if c['ok'] else 'FAILED'}", flush=True)
    names = ("gluon", "gluon-loader-warp", "gluon-sfa", "gluon-sfa-stats", "triton", "triton-sfa", "triton-sfa-stats",
             "cudnn")
    print(f"\n{'shape':<22}" + "".join(f"{n:>18}" for n in names) + "   forward TFLOP/s from a CUDA graph, causal bf16")
    failed = {(c["loader_warp"], c["sfa"], c["stats"]) for c in checks if not c["ok"]}
    skip = {name for name, switches in GLUON_RUNS.items() if switches in failed}
    rows = []
    for shape in shapes:
        rows.append(timed(shape, skip))
        print(f"{str(shape):<22}" + "".join(f"{'failed':>18}" if rows[-1][n] is None else f"{rows[-1][n]:>18.1f}"
                                            for n in names), flush=True)
    args.out.write_text(json.dumps({"meta": meta, "checks": checks, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
