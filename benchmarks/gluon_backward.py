"""Study: the backward in Gluon, its matmuls overlapped with the elementwise work between them, against our Triton
backward and cuDNN's.

Why (docs/kernel-notes.md): the backward is ~70% of forward+backward and runs at 0.74-0.80x cuDNN's; Triton 3.6
waits for every wgmma but a loop-carried accumulator's, so in our kernels P's exponentials overlap no matmul (S is
waited for before them, dP = dO Vᵀ issued after them). The same two kernels as ours (`kernels._attn_bwd_dq`,
which also stores δ, then `kernels._attn_bwd_dkdv`), each owning a block of rows and streaming the other's tiles
past them by TMA through a ring of buffers:
- dK/dV, per query tile: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ issued together; Pᵀ computed while dPᵀ runs; dV += Pᵀ dO
  issued; dSᵀ = Pᵀ (dPᵀ - δ) computed while it runs; dK += dSᵀ Q issued; one full wait.
- dQ, per key tile: S and dP issued together, P computed while dP runs, dQ += dS K, one full wait.
- `Tile(pipelined=True)`: the next tile's S and dP are issued with this tile's accumulating matmuls and waited for
  in the same iteration (FA3's order, as in the forward; a partial wait across the loop's back edge made ptxas
  serialise every wgmma of the forward study, C7514), so that the next tile's P and dS run under them.
- The one-kernel backward ("one", the dK/dV kernel at `DQ_WORK` 3; FA2's and FA3's layout): it also computes each query tile's
  share of dQ, dS K, from dSᵀ in shared memory, and adds it into an fp32 buffer by vector atomics (four values per
  `red.global.add.v4.f32`: the buffer is laid out in the accumulator's fragment order); five matmuls per tile pair
  instead of the two kernels' seven, after a δ pass, before a pass that puts dQ back in row order.

- The same with dQ's reduction on a warp of its own ("one-ws", `_attn_bwd_one_ws_hopper`; FA3's dQ warp): the math
  warps (240 registers each, `gl.warp_specialize`) put each query tile's dQ share into a ring of fp32 buffers in
  shared memory and go on; a reducer warp (32 registers) adds each buffer into dQ's fp32 rows by `red.v4` and
  releases it. Session 14 measured that without the atomics the one-kernel backward beats cuDNN's at T >= 4096; with
  one reducer warp (1942696) it was 8-19% slower than the inline atomics (the math warps wait for it). Session 15
  ran the rest: four reducer warps (same registers) with a one-slot ring padded against bank conflicts, 7-12%
  faster than one warp but not than the inline atomics; and no reducer at all, each buffer added to dQ by a TMA
  reduction the math warps issue and wait for only when they reuse the buffer (`_tma_reduce_add`, FA3's mechanism;
  Gluon 3.6's builder has the operation, its Python API does not): the best of them, 4% faster than our two Triton
  kernels at (4,12,4096,64), 5-9% slower at D = 128, 28% slower at T = 1024.

Measured on the H200 (RESULTS.md, session 13): every tile passes its checks; the Gluon dK/dV kernel ties ours, the
Gluon dQ kernel is up to 16% slower, and the one-kernel backward is 2-37% slower than our two Triton kernels (at
D = 128 it spills). So `ops` keeps the Triton backward.

Native FA2 numerics as the Triton kernels compute them: P = exp2(min(S·scale·log2e - lse, 0)) from the forward's
base-2 log-sum-exp (rows with no visible key, lse = -inf, give P = 0), dS = P (dP - δ) with δ = rowsum(dO ∘ O) in
fp32, dQ and dK scaled once at the end. Causal or not, any T, head dims 64 and 128, bf16 and fp16, 16-byte aligned
rows. Every tile is checked (each gradient within twice the reference `fa2` backward's error against fp64) before
it is timed.

    python benchmarks/gluon_backward.py --out results/gluon-backward-h200.json     # on an H200: check, then time
The kernels compile for sm_90 on any machine (tests/attention/test_kernel_compile.py does, without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from stableflash import flash_attention
from stableflash.attention.precision import resolve
from stableflash.attention.triton import kernels, ops
from stableflash.attention.triton.spec import LOG2E, build_spec
from stableflash.benchmarking import parse_shapes, run_meta

SHAPES = [(16, 12, 1024, 64), (4, 12, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)]


@gluon.jit
def _issue_rows(a_desc, b_desc, a_smem, b_smem, bars, start, i, STAGES: gl.constexpr, pred):
    """TMA loads of the two tensors' tile from row `start` (Q and dO, or K and V) into buffer i % STAGES, counted on
    that buffer's barrier."""
    stage = i % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [start, 0], bar, a_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(b_desc, [start, 0], bar, b_smem.index(stage), pred=pred)


@gluon.jit
def _head_desc(X, b, h, stride_b, stride_h, stride_t, T, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, LAYOUT: gl.constexpr):
    """A tensor descriptor of one head's (T, HEAD_DIM) rows in blocks of ROWS (rows past T read as 0)."""
    return tma.make_tensor_descriptor(X + b * stride_b + h * stride_h, [T, HEAD_DIM], [stride_t, 1], [ROWS, HEAD_DIM],
                                      LAYOUT)


@gluon.jit
def _head_descs(Q, K, V, DO, bh, H, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb,
                stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, T, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr):
    """The (batch, head) `bh`'s descriptors: Q and dO in blocks of BLOCK_M rows, K and V in blocks of BLOCK_N."""
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    return (_head_desc(Q, b, h, stride_qb, stride_qh, stride_qt, T, BLOCK_M, HEAD_DIM, Q_LAYOUT),
            _head_desc(DO, b, h, stride_dob, stride_doh, stride_dot, T, BLOCK_M, HEAD_DIM, Q_LAYOUT),
            _head_desc(K, b, h, stride_kb, stride_kh, stride_kt, T, BLOCK_N, HEAD_DIM, KV_LAYOUT),
            _head_desc(V, b, h, stride_vb, stride_vh, stride_vt, T, BLOCK_N, HEAD_DIM, KV_LAYOUT))


@gluon.jit
def _store_rows(X, bh, H, stride_b, stride_h, stride_t, row0, value, T, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                LAYOUT: gl.constexpr):
    """Rows row0.. row0+ROWS of one head's (T, HEAD_DIM) gradient, from an fp32 tile in LAYOUT; rows past T are left."""
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LAYOUT))
    offsets = ((bh // H).to(gl.int64) * stride_b + (bh % H).to(gl.int64) * stride_h
               + rows[:, None].to(gl.int64) * stride_t + cols[None, :])
    gl.store(X + offsets, value.to(X.dtype.element_ty), mask=rows[:, None] < T)


@gluon.jit
def _store_delta(O, DO, DELTA, bh, H, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot, m0, T,
                 ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
    """δ = rowsum(dO ∘ O) in fp32 of rows m0.. m0+ROWS of one head, stored into DELTA ((B, H, T)) and returned."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    rows = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    in_t = rows[:, None] < T
    o = gl.load(O + b * stride_ob + h * stride_oh + rows[:, None].to(gl.int64) * stride_ot + cols[None, :],
                mask=in_t, other=0.0)
    do = gl.load(DO + b * stride_dob + h * stride_doh + rows[:, None].to(gl.int64) * stride_dot + cols[None, :],
                 mask=in_t, other=0.0)
    delta = gl.sum(o.to(gl.float32) * do.to(gl.float32), 1)
    gl.store(DELTA + bh.to(gl.int64) * T + rows, delta, mask=rows < T)
    return delta


@gluon.jit
def _query_stats(LSE, DELTA, row_off, queries, T):
    """The forward's base-2 lse of these queries (-inf, a row with no visible key, becomes +inf so that P = 0) and δ."""
    lse = gl.load(LSE + row_off + queries, mask=queries < T, other=0.0)
    delta = gl.load(DELTA + row_off + queries, mask=queries < T, other=0.0)
    return gl.where(lse == float("-inf"), float("inf"), lse), delta


@gluon.jit
def _probs(s, lse, queries, keys, T, qk_scale, masked, CAUSAL: gl.constexpr):
    """P recomputed (P <= 1 exactly: a recomputed score may exceed the saved lse by a few ulps), in whichever
    orientation `s`, `lse`, `queries` and `keys` broadcast to; masked where a key is past T or (causal) after its
    query, on the tiles that need it."""
    p = gl.exp2(gl.minimum(s * qk_scale - lse, 0.0))
    if masked:
        valid = (queries < T) & (keys < T)
        if CAUSAL:
            valid = valid & (queries >= keys)
        p = gl.where(valid, p, 0.0)
    return p


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Adds a shared-memory tile into global memory by a TMA reduction (`cp.reduce.async.bulk.tensor ... .add`),
    issued by one thread as a bulk group that `tma.store_wait` retires. Gluon 3.6's builder has the operation
    (`create_async_tma_reduce`) but its Hopper TMA module wraps only copies: this is that wrapper, as
    `tma.async_copy_shared_to_global` is written."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _acc_layout(num_warps, cols, split=1):
    """A wgmma accumulator layout for a tile `cols` wide: the warps along its rows, or split over `split` column
    blocks (dQ's share when a query tile has fewer than 64 rows per warpgroup)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps // split, split],
                                     instr_shape=[16, cols // split, 16])


@gluon.constexpr_function
def _packs_row_pairs(layout):
    """Whether four consecutive registers of a thread in `layout` (linear form) hold columns c, c+1 of rows r and
    r+8: the group that `_dq_fragment_offsets` lays out contiguously and `_red_add_v4` adds in one instruction."""
    return layout.reg_bases[:2] == [[0, 1], [8, 0]]


@gluon.jit
def _dq_fragment_offsets(ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, LAYOUT: gl.constexpr):
    """Where each element (r, c) of a (ROWS, HEAD_DIM) tile in a wgmma accumulator layout lives in the fp32 dQ
    buffer, in fragment order: per block of 16 rows (r = 16a + 8b + g) and 8 columns (c = 8j + 2t + e), lane
    4g + t's four values (e, b) side by side, the 32 lanes' groups in a row, so that one `red.v4` adds a group and a
    warp's 32 of them cover 512 contiguous bytes. `dq_from_fragments` undoes the order."""
    gl.static_assert(_packs_row_pairs(gl.to_linear_layout(LAYOUT, [ROWS, HEAD_DIM])),
                     "dQ's atomics add four registers at a time: columns c, c+1 of rows r, r+8")
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT))[:, None]
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LAYOUT))[None, :]
    return (r // 16) * (16 * HEAD_DIM) + (c // 8) * 128 + ((r % 8) * 4 + (c % 8) // 2) * 4 + ((r // 8) % 2) * 2 + c % 2


@gluon.jit
def _red_add_v4(address, value):
    """Adds each thread's groups of four consecutive registers of `value` (fp32) at the first one's address: one
    `red.global.add.v4.f32` (sm_90) per group instead of four scalar atomics, relaxed, nothing returned (the dummy
    result is what `inline_asm_elementwise` needs)."""
    return gl.inline_asm_elementwise(
        "red.global.add.v4.f32 [$4], {$8, $9, $10, $11};\n"
        "mov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;",
        "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [address.to(gl.int64, bitcast=True), value], dtype=gl.int32, is_pure=False,
        pack=4)


@gluon.jit
def _dkdv_step(i, start_m, n_tiles, k_tile, v_tile, q_desc, do_desc, q_smem, do_smem, ready_bars, ds_smem, LSE, DELTA,
               row_off, keys, T, qk_scale, diag_end, free_end, dk, dv, s_zero, dq_zero, BLOCK_M: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_WORK: gl.constexpr, col_layout: gl.constexpr,
               op_layout: gl.constexpr):
    """Query tile i (rows from start_m) of the unpipelined dK/dV schedule: Sᵀ and dPᵀ issued together, Pᵀ while dPᵀ
    runs, dV += Pᵀ dO issued, dSᵀ while it runs, dK += dSᵀ Q; with DQ_WORK >= 2 also dQ's share dS K (dSᵀ through
    shared memory, read transposed). Everything retires before buffer i % STAGES is refilled with tile i + STAGES.
    Returns dK, dV and dQ's share (`dq_zero` when there is none)."""
    dtype: gl.constexpr = q_smem.dtype
    stage = i % STAGES
    mbarrier.wait(ready_bars.index(stage), (i // STAGES) & 1)
    q_tile = q_smem.index(stage)
    do_tile = do_smem.index(stage)
    st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    queries = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
    lse, delta = _query_stats(LSE, DELTA, row_off, queries, T)
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
    pt = _probs(st, lse[None, :], queries[None, :], keys, T, qk_scale, (start_m < diag_end) | (start_m >= free_end),
                CAUSAL)
    pt_op = gl.convert_layout(pt.to(dtype), op_layout, assert_trivial=True)
    dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt,))  # dV's matmul may still run
    dst = (pt * (dpt - delta[None, :])).to(dtype)
    if DQ_WORK >= 1:
        ds_smem.store(dst)
    dst_op = gl.convert_layout(dst, op_layout, assert_trivial=True)
    dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
    # everything of this tile retired before the next: its operands' registers and its buffer are free then
    dq = dq_zero
    if DQ_WORK >= 2:
        fence_async_shared()
        gl.thread_barrier()  # every warpgroup's rows of dSᵀ stored before either reads all of them
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_tile, dq_zero, use_acc=False, is_async=True)
        dk, dv, dq, pt_op, dst_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, dq, pt_op, dst_op))
    else:
        dk, dv, pt_op, dst_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, pt_op, dst_op))
    # every warpgroup done with buffer `stage` (and with dSᵀ) before one thread refills it (or any rewrites dSᵀ)
    gl.thread_barrier()
    _issue_rows(q_desc, do_desc, q_smem, do_smem, ready_bars, start_m + STAGES * BLOCK_M, i + STAGES, STAGES,
                i + STAGES < n_tiles)
    return dk, dv, dq


@gluon.jit
def _attn_bwd_dkdv_hopper(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC,
                          stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
                          stride_vt, stride_dob, stride_doh, stride_dot, stride_gb, stride_gh, stride_gt,
                          H, T, T_ACC, qk_scale, scale,
                          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          CAUSAL: gl.constexpr, PIPELINED: gl.constexpr, DQ_WORK: gl.constexpr,
                          DQ_SPLIT: gl.constexpr, Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
                          DS_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
    """dK and dV for BLOCK_N keys (one warpgroup per 64), over the query tiles that see them. Per query tile i:
    Sᵀ = K Qᵀ and dPᵀ = V dOᵀ issued together, Pᵀ computed while dPᵀ runs, dSᵀ = Pᵀ (dPᵀ - δ) while dV += Pᵀ dO
    runs, then dK += dSᵀ Q. PIPELINED: tile i+1's Sᵀ and dPᵀ are issued with tile i's dV and dK matmuls, so that
    Pᵀ and dSᵀ of tile i+1 run under those (FA3's order; more registers: two tiles' operands live).

    DQ_WORK 3 makes it the one-kernel backward (FA2's and FA3's layout): per query tile also its share of dQ, dS K,
    added into an fp32 buffer (DQ_ACC, (B·H, T_ACC, HEAD_DIM) in fragment order) by vector atomics; five matmuls
    per tile pair instead of the two kernels' seven. dSᵀ goes through shared memory, where dQ's matmul reads it
    transposed; dQ's accumulator splits its columns over DQ_SPLIT warpgroups when the query tile has fewer than 64
    rows per warpgroup. Not deterministic (the atomics' order varies), unlike the two kernels. DQ_WORK 2 and 1 leave
    out, for timing only (dQ comes out wrong), the atomics, then dQ's matmul too; 0 is the dK/dV kernel."""
    gl.static_assert(STAGES >= 2, "a query tile's buffer is refilled once its matmuls are done: two keep one ahead")
    gl.static_assert(DQ_WORK == 0 or not PIPELINED, "the one-kernel backward has no pipelined schedule")
    dtype: gl.constexpr = Q.dtype.element_ty
    pid_n = gl.program_id(0)  # key tile: the first ones see the most query tiles, so the heaviest start first
    bh = gl.program_id(1)
    q_desc, do_desc, k_desc, v_desc = _head_descs(
        Q, K, V, DO, bh, H, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
        stride_vt, stride_dob, stride_doh, stride_dot, T, BLOCK_M, BLOCK_N, HEAD_DIM, Q_LAYOUT, KV_LAYOUT)

    # Sᵀ and dPᵀ (keys x queries) and dK, dV (keys x head dim) in wgmma accumulator layouts; Pᵀ and dSᵀ as the
    # register A operands of dV's and dK's matmuls; the queries' lse and δ along Sᵀ's columns
    s_layout: gl.constexpr = _acc_layout(num_warps, BLOCK_M)
    g_layout: gl.constexpr = _acc_layout(num_warps, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dq_layout: gl.constexpr = _acc_layout(num_warps, HEAD_DIM, DQ_SPLIT)  # dQ's share, for the one-kernel backward

    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    ds_smem = k_smem  # stands in when dQ's work leaves dSᵀ in registers
    if DQ_WORK >= 1:
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], DS_LAYOUT)
    kv_bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bars.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)

    n0 = pid_n * BLOCK_N
    lo = (n0 // BLOCK_M) * BLOCK_M if CAUSAL else 0  # the first query tile that sees one of these keys
    n_tiles = gl.cdiv(T - lo, BLOCK_M)
    # query tiles crossing the diagonal (causal) or past T need a mask; the ones between do not
    diag_end = gl.minimum(n0 + BLOCK_N, T) if CAUSAL else lo
    free_end = (T // BLOCK_M) * BLOCK_M
    _issue_rows(k_desc, v_desc, k_smem, v_smem, kv_bars, n0, 0, 1, True)
    for i in gl.static_range(STAGES):
        _issue_rows(q_desc, do_desc, q_smem, do_smem, ready_bars, lo + i * BLOCK_M, i, STAGES, i < n_tiles)

    keys = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)))[:, None]
    row_off = bh.to(gl.int64) * T
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = s_zero  # stands in when there is no dQ matmul
    if DQ_WORK >= 2:
        dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    k_tile = k_smem.index(0)
    v_tile = v_smem.index(0)
    mbarrier.wait(kv_bars.index(0), 0)

    if PIPELINED:
        # prologue: tile 0's Pᵀ and dSᵀ
        mbarrier.wait(ready_bars.index(0), 0)
        st = warpgroup_mma(k_tile, q_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_tile, do_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        queries = lo + gl.arange(0, BLOCK_M, layout=col_layout)
        lse, delta = _query_stats(LSE, DELTA, row_off, queries, T)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
        pt = _probs(st, lse[None, :], queries[None, :], keys, T, qk_scale, (lo < diag_end) | (lo >= free_end), CAUSAL)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
        pt_op = gl.convert_layout(pt.to(dtype), op_layout, assert_trivial=True)
        dst_op = gl.convert_layout((pt * (dpt - delta[None, :])).to(dtype), op_layout, assert_trivial=True)
        for i in range(n_tiles - 1):
            nxt = i + 1
            start_m = lo + nxt * BLOCK_M
            mbarrier.wait(ready_bars.index(nxt % STAGES), (nxt // STAGES) & 1)
            st = warpgroup_mma(k_tile, q_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
            dpt = warpgroup_mma(v_tile, do_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)
            dv = warpgroup_mma(pt_op, do_smem.index(i % STAGES), dv, is_async=True)
            dk = warpgroup_mma(dst_op, q_smem.index(i % STAGES), dk, is_async=True)
            queries = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
            lse, delta = _query_stats(LSE, DELTA, row_off, queries, T)
            # groups issued this iteration, oldest first: Sᵀ_{i+1}, dPᵀ_{i+1}, dV_i, dK_i
            st = warpgroup_mma_wait(num_outstanding=3, deps=(st,))
            pt = _probs(st, lse[None, :], queries[None, :], keys, T, qk_scale,
                        (start_m < diag_end) | (start_m >= free_end), CAUSAL)
            dpt = warpgroup_mma_wait(num_outstanding=2, deps=(dpt,))
            dst = pt * (dpt - delta[None, :])
            # tile i's operands (registers and buffer) are free once its matmuls retire
            dk, dv, pt_op, dst_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, pt_op, dst_op))
            gl.thread_barrier()  # every warpgroup done with buffer i % STAGES before one thread refills it
            _issue_rows(q_desc, do_desc, q_smem, do_smem, ready_bars, lo + (i + STAGES) * BLOCK_M, i + STAGES, STAGES,
                        i + STAGES < n_tiles)
            pt_op = gl.convert_layout(pt.to(dtype), op_layout, assert_trivial=True)
            dst_op = gl.convert_layout(dst.to(dtype), op_layout, assert_trivial=True)
        last = (n_tiles - 1) % STAGES
        dv = warpgroup_mma(pt_op, do_smem.index(last), dv, is_async=True)
        dk = warpgroup_mma(dst_op, q_smem.index(last), dk, is_async=True)
        dk, dv, pt_op, dst_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, pt_op, dst_op))
    else:
        for i in range(n_tiles):
            start_m = lo + i * BLOCK_M
            dk, dv, dq = _dkdv_step(i, start_m, n_tiles, k_tile, v_tile, q_desc, do_desc, q_smem, do_smem, ready_bars,
                                    ds_smem, LSE, DELTA, row_off, keys, T, qk_scale, diag_end, free_end, dk, dv,
                                    s_zero, dq_zero, BLOCK_M, STAGES, CAUSAL, DQ_WORK, col_layout, op_layout)
            if DQ_WORK >= 3:  # addresses formed here, not before the loop: D = 128's spills 176 -> 88-104 bytes (64x64)
                dq_rows = DQ_ACC + (bh.to(gl.int64) * T_ACC + start_m) * HEAD_DIM
                _red_add_v4(dq_rows + _dq_fragment_offsets(BLOCK_M, HEAD_DIM, dq_layout), dq)  # padding rows add 0

    mbarrier.invalidate(kv_bars.index(0))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready_bars.index(i))
    _store_rows(DK, bh, H, stride_gb, stride_gh, stride_gt, n0, dk * scale, T, BLOCK_N, HEAD_DIM, g_layout)
    _store_rows(DV, bh, H, stride_gb, stride_gh, stride_gt, n0, dv, T, BLOCK_N, HEAD_DIM, g_layout)


@gluon.jit
def _ring_slot(ring, slot, DQ_STAGES: gl.constexpr):
    """Slot `slot` of the dQ ring: the buffer itself when it has one (2-D, padded), else an index of the 3-D ring."""
    if DQ_STAGES == 1:
        buffer = ring
    else:
        buffer = ring.index(slot)
    return buffer


@gluon.jit
def _one_ws_math(q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bars, ready_bars, dq_full,
                 dq_empty, dq_desc, LSE, DELTA, DK, DV, bh, H, stride_gb, stride_gh, stride_gt, T, qk_scale, scale, n0,
                 lo, n_tiles, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, DQ_STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_SPLIT: gl.constexpr,
                 DQ_TMA: gl.constexpr):
    """The math warps of the one-kernel backward with dQ's reduction off their path: `_dkdv_step` per query tile,
    then dQ's share stored into the ring buffer i % DQ_STAGES and handed on: to the reducer warps (`_dq_reducer`,
    by mbarriers), or with DQ_TMA to a TMA reduction into dQ's fp32 rows (`dq_desc`) that runs while these warps go
    on; a buffer is rewritten once its reduction has read it (`tma.store_wait`, DQ_STAGES - 1 left in flight)."""
    num_warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _acc_layout(num_warps, BLOCK_M)
    g_layout: gl.constexpr = _acc_layout(num_warps, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    dq_layout: gl.constexpr = _acc_layout(num_warps, HEAD_DIM, DQ_SPLIT)
    diag_end = gl.minimum(n0 + BLOCK_N, T) if CAUSAL else lo
    free_end = (T // BLOCK_M) * BLOCK_M
    keys = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)))[:, None]
    row_off = bh.to(gl.int64) * T
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    k_tile = k_smem.index(0)
    v_tile = v_smem.index(0)
    mbarrier.wait(kv_bars.index(0), 0)
    for i in range(n_tiles):
        dk, dv, dq = _dkdv_step(i, lo + i * BLOCK_M, n_tiles, k_tile, v_tile, q_desc, do_desc, q_smem, do_smem,
                                ready_bars, ds_smem, LSE, DELTA, row_off, keys, T, qk_scale, diag_end, free_end, dk, dv,
                                s_zero, dq_zero, BLOCK_M, STAGES, CAUSAL, 3, gl.SliceLayout(0, s_layout), op_layout)
        slot = i % DQ_STAGES
        if DQ_TMA:
            tma.store_wait(DQ_STAGES - 1)  # the issuing thread: the slot's previous reduction has read it
            gl.thread_barrier()  # ... before any warp rewrites it
            dq_smem.index(slot).store(dq)
            fence_async_shared()  # the generic-proxy stores visible to the TMA unit
            gl.thread_barrier()  # every warp's rows stored before the reduction is issued
            _tma_reduce_add(dq_desc, [lo + i * BLOCK_M, 0], dq_smem.index(slot))
        else:
            # the reducer has read the slot's previous tile (a fresh barrier counts as released)
            mbarrier.wait(dq_empty.index(slot), ((i // DQ_STAGES) & 1) ^ 1)
            _ring_slot(dq_smem, slot, DQ_STAGES).store(dq)
            gl.thread_barrier()  # every math warp's rows stored before the hand-over
            mbarrier.arrive(dq_full.index(slot))
    if DQ_TMA:
        tma.store_wait(0)  # the ring stays allocated until the last reduction has read it
    _store_rows(DK, bh, H, stride_gb, stride_gh, stride_gt, n0, dk * scale, T, BLOCK_N, HEAD_DIM, g_layout)
    _store_rows(DV, bh, H, stride_gb, stride_gh, stride_gt, n0, dv, T, BLOCK_N, HEAD_DIM, g_layout)


@gluon.jit
def _dq_reducer(dq_smem, dq_full, dq_empty, DQ_ACC, bh, T_ACC, lo, n_tiles, HEAD_DIM: gl.constexpr,
                BLOCK_M: gl.constexpr, DQ_STAGES: gl.constexpr, CHUNK: gl.constexpr):
    """The reducer warp(s): each tile's dQ share from the ring into the fp32 rows of DQ_ACC ((B·H, T_ACC, HEAD_DIM),
    row order), CHUNK rows at a time, four contiguous columns per `red.global.add.v4.f32`; then the slot is released.
    The math warps meanwhile go on to the next tile: the reduction is off their path (FA3's dQ warp)."""
    lanes_per_row: gl.constexpr = HEAD_DIM // 4
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // lanes_per_row, lanes_per_row], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))[:, None]
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))[None, :]
    for i in range(n_tiles):
        slot = i % DQ_STAGES
        mbarrier.wait(dq_full.index(slot), (i // DQ_STAGES) & 1)
        tile_rows = DQ_ACC + (bh.to(gl.int64) * T_ACC + lo + i * BLOCK_M) * HEAD_DIM
        for r in gl.static_range(0, BLOCK_M, CHUNK):
            part = _ring_slot(dq_smem, slot, DQ_STAGES).slice(r, CHUNK).load(layout)
            _red_add_v4(tile_rows + (r + rows) * HEAD_DIM + cols, part)  # padding rows add 0
        mbarrier.arrive(dq_empty.index(slot))


@gluon.jit
def _attn_bwd_one_ws_hopper(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC,
                            stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
                            stride_vt, stride_dob, stride_doh, stride_dot, stride_gb, stride_gh, stride_gt,
                            H, T, T_ACC, qk_scale, scale,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, DQ_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                            DQ_SPLIT: gl.constexpr, Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
                            DS_LAYOUT: gl.constexpr, REDUCER_WARPS: gl.constexpr, REDUCER_REGS: gl.constexpr,
                            CHUNK: gl.constexpr, DQ_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
    """The one-kernel backward with its dQ reduction on warps of its own (`gl.warp_specialize`): the math warps
    (`_one_ws_math`, the kernel's num_warps) compute dK, dV and each query tile's dQ share and put the share in a
    ring of DQ_STAGES fp32 buffers in shared memory; REDUCER_WARPS warps (`_dq_reducer`) add each buffer into the fp32
    rows of DQ_ACC by vector atomics and release it. REDUCER_WARPS 0: no reducer; each buffer (in DQ_LAYOUT, a TMA
    layout) goes to dQ's rows by a TMA reduction, FA3's way. Same numerics as `_attn_bwd_dkdv_hopper` at DQ_WORK 3;
    dQ's buffer in row order. Not deterministic (the atomics' order varies)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    q_desc, do_desc, k_desc, v_desc = _head_descs(
        Q, K, V, DO, bh, H, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
        stride_vt, stride_dob, stride_doh, stride_dot, T, BLOCK_M, BLOCK_N, HEAD_DIM, Q_LAYOUT, KV_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], DS_LAYOUT)
    # the reducer reads the ring a row slice at a time, which Gluon 3.6 cannot do within a swizzle period, and it
    # indexes no padded buffer of several slots. Several slots: row-major, unswizzled; the accumulator's stores (a
    # warp: 8 rows, 32 contiguous bytes of each, per instruction) then hit the same 8 banks, 3 excess accesses per
    # wavefront (`gl.bank_conflicts`). One slot: rows padded by 32 bytes, so that the 8 rows start 8 banks apart and
    # fill the 32 banks twice, no excess (by hand: `gl.bank_conflicts` does not take padded layouts)
    if REDUCER_WARPS == 0:
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_STAGES, BLOCK_M, HEAD_DIM], DQ_LAYOUT)
    elif DQ_STAGES == 1:
        dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], gl.PaddedSharedLayout.with_identity_for(
            [[HEAD_DIM, 8]], [BLOCK_M, HEAD_DIM], [1, 0]))
    else:
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_STAGES, BLOCK_M, HEAD_DIM],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    kv_bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_STAGES, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bars.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
    for i in gl.static_range(DQ_STAGES):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)

    n0 = pid_n * BLOCK_N
    lo = (n0 // BLOCK_M) * BLOCK_M if CAUSAL else 0
    n_tiles = gl.cdiv(T - lo, BLOCK_M)
    _issue_rows(k_desc, v_desc, k_smem, v_smem, kv_bars, n0, 0, 1, True)
    for i in gl.static_range(STAGES):
        _issue_rows(q_desc, do_desc, q_smem, do_smem, ready_bars, lo + i * BLOCK_M, i, STAGES, i < n_tiles)
    if REDUCER_WARPS == 0:  # TMA reductions, issued by the math warps themselves
        dq_desc = tma.make_tensor_descriptor(DQ_ACC + bh.to(gl.int64) * T_ACC * HEAD_DIM, [T_ACC, HEAD_DIM],
                                             [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM], DQ_LAYOUT)
        _one_ws_math(q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bars, ready_bars, dq_full,
                     dq_empty, dq_desc, LSE, DELTA, DK, DV, bh, H, stride_gb, stride_gh, stride_gt, T, qk_scale, scale,
                     n0, lo, n_tiles, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_STAGES, CAUSAL, DQ_SPLIT, True)
    else:
        gl.warp_specialize([
            (_one_ws_math, (q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bars, ready_bars,
                            dq_full, dq_empty, None, LSE, DELTA, DK, DV, bh, H, stride_gb, stride_gh, stride_gt, T,
                            qk_scale, scale, n0, lo, n_tiles, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_STAGES, CAUSAL,
                            DQ_SPLIT, False)),
            (_dq_reducer, (dq_smem, dq_full, dq_empty, DQ_ACC, bh, T_ACC, lo, n_tiles, HEAD_DIM, BLOCK_M, DQ_STAGES,
                           CHUNK))],
            [REDUCER_WARPS], [REDUCER_REGS])
    mbarrier.invalidate(kv_bars.index(0))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready_bars.index(i))
    for i in gl.static_range(DQ_STAGES):
        mbarrier.invalidate(dq_full.index(i))
        mbarrier.invalidate(dq_empty.index(i))


@gluon.jit
def _attn_bwd_dq_hopper(Q, K, V, DO, O, LSE, DELTA, DQ,
                        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
                        stride_vt, stride_dob, stride_doh, stride_dot, stride_ob, stride_oh, stride_ot,
                        stride_gb, stride_gh, stride_gt, H, T, qk_scale, scale,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        CAUSAL: gl.constexpr, PIPELINED: gl.constexpr, Q_LAYOUT: gl.constexpr,
                        KV_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
    """dQ for BLOCK_M queries (one warpgroup per 64), over the key tiles they see; first δ = rowsum(dO ∘ O) of its
    rows in fp32, stored for the dK/dV kernel (launched after it), as `kernels._attn_bwd_dq` does. Per key tile j:
    S = Q Kᵀ and dP = dO Vᵀ issued together, P computed while dP runs, then dQ += dS K. PIPELINED: tile j+1's S and
    dP are issued with tile j's dQ matmul, so that P and dS of tile j+1 run under it."""
    gl.static_assert(STAGES >= 2, "a key tile's buffer is refilled once its matmuls are done: two keep one ahead")
    dtype: gl.constexpr = Q.dtype.element_ty
    # query tile: under a causal mask the last ones see the most keys, so the heaviest start first
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)
    bh = gl.program_id(1)
    q_desc, do_desc, k_desc, v_desc = _head_descs(
        Q, K, V, DO, bh, H, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
        stride_vt, stride_dob, stride_doh, stride_dot, T, BLOCK_M, BLOCK_N, HEAD_DIM, Q_LAYOUT, KV_LAYOUT)

    s_layout: gl.constexpr = _acc_layout(num_warps, BLOCK_N)
    g_layout: gl.constexpr = _acc_layout(num_warps, HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    do_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bars.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)

    m0 = pid_m * BLOCK_M
    hi = gl.minimum(T, m0 + BLOCK_M) if CAUSAL else T
    n_tiles = gl.cdiv(hi, BLOCK_N)
    mask_from = m0 if CAUSAL else (T // BLOCK_N) * BLOCK_N  # key tiles from here on need a mask
    _issue_rows(q_desc, do_desc, q_smem, do_smem, q_bars, m0, 0, 1, True)
    for i in gl.static_range(STAGES):
        _issue_rows(k_desc, v_desc, k_smem, v_smem, ready_bars, i * BLOCK_N, i, STAGES, i < n_tiles)

    # δ of these rows while the tiles arrive
    delta = _store_delta(O, DO, DELTA, bh, H, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot, m0, T,
                         BLOCK_M, HEAD_DIM, num_warps)
    row_off = bh.to(gl.int64) * T
    delta = gl.convert_layout(delta, row_layout)
    query_index = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    lse = gl.load(LSE + row_off + query_index, mask=query_index < T, other=0.0)
    lse = gl.where(lse == float("-inf"), float("inf"), lse)[:, None]  # rows with no visible key: P = 0
    queries = query_index[:, None]

    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=g_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    q_tile = q_smem.index(0)
    do_tile = do_smem.index(0)
    mbarrier.wait(q_bars.index(0), 0)

    if PIPELINED:
        mbarrier.wait(ready_bars.index(0), 0)
        s = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_tile, v_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        keys = gl.arange(0, BLOCK_N, layout=col_layout)[None, :]
        p = _probs(s, lse, queries, keys, T, qk_scale, BLOCK_N > mask_from, CAUSAL)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), op_layout, assert_trivial=True)
        for j in range(n_tiles - 1):
            nxt = j + 1
            mbarrier.wait(ready_bars.index(nxt % STAGES), (nxt // STAGES) & 1)
            s = warpgroup_mma(q_tile, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_tile, v_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
            dq = warpgroup_mma(ds_op, k_smem.index(j % STAGES), dq, is_async=True)
            # groups issued this iteration, oldest first: S_{j+1}, dP_{j+1}, dQ_j
            s = warpgroup_mma_wait(num_outstanding=2, deps=(s,))
            keys = (nxt * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout))[None, :]
            p = _probs(s, lse, queries, keys, T, qk_scale, (nxt + 1) * BLOCK_N > mask_from, CAUSAL)
            dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))
            ds = p * (dp - delta[:, None])
            dq, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_op))
            gl.thread_barrier()  # every warpgroup done with buffer j % STAGES before one thread refills it
            _issue_rows(k_desc, v_desc, k_smem, v_smem, ready_bars, (j + STAGES) * BLOCK_N, j + STAGES, STAGES,
                        j + STAGES < n_tiles)
            ds_op = gl.convert_layout(ds.to(dtype), op_layout, assert_trivial=True)
        dq = warpgroup_mma(ds_op, k_smem.index((n_tiles - 1) % STAGES), dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_op))
    else:
        for j in range(n_tiles):
            stage = j % STAGES
            mbarrier.wait(ready_bars.index(stage), (j // STAGES) & 1)
            s = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_tile, v_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            keys = (j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout))[None, :]
            p = _probs(s, lse, queries, keys, T, qk_scale, (j + 1) * BLOCK_N > mask_from, CAUSAL)
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
            ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), op_layout, assert_trivial=True)
            dq = warpgroup_mma(ds_op, k_smem.index(stage), dq, is_async=True)
            dq, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_op))
            gl.thread_barrier()  # every warpgroup done with buffer `stage` before one thread refills it
            _issue_rows(k_desc, v_desc, k_smem, v_smem, ready_bars, (j + STAGES) * BLOCK_N, j + STAGES, STAGES,
                        j + STAGES < n_tiles)

    mbarrier.invalidate(q_bars.index(0))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready_bars.index(i))
    _store_rows(DQ, bh, H, stride_gb, stride_gh, stride_gt, m0, dq * scale, T, BLOCK_M, HEAD_DIM, g_layout)


@gluon.jit
def _attn_bwd_delta_hopper(O, DO, DELTA, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot, H, T,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
    """δ = rowsum(dO ∘ O) of BLOCK_M rows, for the one-kernel backward (which needs every query's δ from its start)."""
    _store_delta(O, DO, DELTA, gl.program_id(1), H, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh,
                 stride_dot, gl.program_id(0) * BLOCK_M, T, BLOCK_M, HEAD_DIM, num_warps)


class Tile(NamedTuple):
    """A program's own rows (keys for dK/dV, queries for dQ; one warpgroup per 64), the rows of each tile streamed
    past them, the ring's buffers, and the pipelined schedule."""
    own: int = 128
    streamed: int = 64
    stages: int = 2
    pipelined: bool = False

    @property
    def warps(self) -> int:
        return self.own // 16

    def __str__(self):
        return f"{self.own}x{self.streamed}/{self.stages}st/{self.warps}w{'/pipelined' if self.pipelined else ''}"


# offline (sm_90): D = 128 at 64 streamed rows needs all 255 registers and spills 40 bytes unpipelined
DKDV_TILES = {64: [Tile(128, 64, 3), Tile(64, 64, 3), Tile(128, 32, 4), Tile(128, 64, 3, True), Tile(128, 32, 4, True)],
              128: [Tile(128, 64, 2), Tile(128, 32, 3), Tile(64, 64, 3), Tile(128, 32, 3, True)]}
DQ_TILES = {64: [Tile(128, 64, 3), Tile(64, 64, 3), Tile(128, 64, 3, True), Tile(128, 128, 2)],
            128: [Tile(128, 64, 2), Tile(64, 64, 3), Tile(128, 64, 2, True), Tile(128, 32, 3, True), Tile(64, 64, 3, True)]}
# the one-kernel backward: dQ's matmul needs 64 query rows per warpgroup, so no 32-row streamed tiles
ONE_KERNEL_TILES = {64: [Tile(128, 64, 3), Tile(64, 64, 3), Tile(128, 128, 2)],
                    128: [Tile(128, 64, 2), Tile(64, 64, 3), Tile(64, 64, 2)]}


class ReducerTile(NamedTuple):
    """The one-kernel backward with dQ's reduction off the math warps (kind "one-ws"): `Tile`'s own keys, streamed
    query rows and ring, plus the dQ ring's fp32 buffers and the reducer partition's warps and registers (0 warps:
    no reducer, TMA reductions issued by the math warps)."""
    own: int = 128
    streamed: int = 64
    stages: int = 2
    dq_stages: int = 1
    reducer_warps: int = 1
    reducer_regs: int = 32

    @property
    def warps(self) -> int:
        return self.own // 16

    def __str__(self):
        reducer = f"reducer{self.reducer_warps}w" if self.reducer_warps else "tma-reduce"
        return f"{self.own}x{self.streamed}/{self.stages}st/{self.warps}w/dq-ring{self.dq_stages}/{reducer}"


# shared memory at D = 128: 128x64 with 2 stages and one 32 KB dQ buffer 176 KB (1 CTA per SM, as without it);
# 64x64 with 2 stages 138.5 KB (1 CTA per SM, against 2 without the buffer)
ONE_WS_TILES = {64: [ReducerTile(128, 64, 3, 2), ReducerTile(64, 64, 3, 2), ReducerTile(128, 64, 3, 1, 4),
                     ReducerTile(64, 64, 3, 1, 4), ReducerTile(128, 64, 3, 2, 0), ReducerTile(64, 64, 3, 2, 0)],
                128: [ReducerTile(128, 64, 2, 1), ReducerTile(128, 64, 2, 2), ReducerTile(64, 64, 2, 1),
                      ReducerTile(128, 64, 2, 1, 4), ReducerTile(64, 64, 2, 1, 4), ReducerTile(128, 64, 2, 2, 0),
                      ReducerTile(64, 64, 2, 2, 0)]}
KERNELS = {"dkdv": _attn_bwd_dkdv_hopper, "dq": _attn_bwd_dq_hopper, "one": _attn_bwd_dkdv_hopper,
           "one-ws": _attn_bwd_one_ws_hopper}
TILES = {"dkdv": DKDV_TILES, "dq": DQ_TILES, "one": ONE_KERNEL_TILES, "one-ws": ONE_WS_TILES}


def launch_constants(kernel: str, head_dim: int, dtype, causal: bool, tile: Tile, dq_work: int = 3) -> dict:
    """Compile-time arguments of the "dkdv", "dq", "one" (one-kernel backward; `dq_work` < 3: its timing-only
    ablations) or "one-ws" (its reduction off the math warps, at a `ReducerTile`) kernel at `tile`."""
    gdtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    block_m, block_n = (tile.own, tile.streamed) if kernel == "dq" else (tile.streamed, tile.own)
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=tile.stages, CAUSAL=causal,
                  Q_LAYOUT=gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gdtype),
                  KV_LAYOUT=gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gdtype), num_warps=tile.warps)
    if kernel == "dq":
        return consts | dict(PIPELINED=tile.pipelined)
    if kernel == "dkdv":
        return consts | dict(PIPELINED=tile.pipelined, DQ_WORK=0, DQ_SPLIT=1, DS_LAYOUT=None)
    assert (isinstance(tile, ReducerTile) or not tile.pipelined) and block_m >= 64, \
        f"the one-kernel backward has no tile {tile}"
    one = dict(DQ_SPLIT=tile.warps // min(tile.warps, block_m // 16),
               DS_LAYOUT=gl.NVMMASharedLayout.get_default_for([block_n, block_m], gdtype))
    if kernel == "one-ws":
        return consts | one | dict(DQ_STAGES=tile.dq_stages, REDUCER_WARPS=tile.reducer_warps,
                                   REDUCER_REGS=tile.reducer_regs,
                                   CHUNK=max(1, tile.reducer_warps) * 32 // (head_dim // 4),  # one pass of the lanes
                                   DQ_LAYOUT=gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gl.float32))
    return consts | one | dict(PIPELINED=False, DQ_WORK=dq_work)


def _streamable(*tensors):
    if not ops.tma_streamable(*tensors):
        raise ValueError("q, k, v, dout: the Gluon study loads rows by TMA: 16-byte aligned bases and row strides")
    ops.ensure_scratch_allocator()


def dkdv(dout, q, k, v, lse, delta, causal: bool, scale: float, tile: Tile):
    """dK and dV from the Gluon kernel, given the forward's base-2 lse and δ = rowsum(dO ∘ O) (both (B, H, T) fp32)."""
    B, H, T, D = q.shape
    _streamable(q, k, v, dout)
    dk = torch.empty_like(k)
    dv = torch.empty_like(dk, dtype=v.dtype)  # the kernel writes both through dK's strides
    grid = (triton.cdiv(T, tile.own), B * H)
    _attn_bwd_dkdv_hopper[grid](q, k, v, dout, lse, delta, dk, dv, dk, *q.stride()[:3], *k.stride()[:3],
                                *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3], H, T, 0, scale * LOG2E, scale,
                                **launch_constants("dkdv", D, q.dtype, causal, tile))  # no dQ buffer: dK's stands in
    return dk, dv


def dq_and_delta(dout, q, k, v, out, lse, causal: bool, scale: float, tile: Tile):
    """dQ from the Gluon kernel, and the δ = rowsum(dO ∘ O) it stores for the dK/dV kernel."""
    B, H, T, D = q.shape
    _streamable(q, k, v, dout)
    dq = torch.empty_like(q)
    delta = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(T, tile.own), B * H)
    _attn_bwd_dq_hopper[grid](q, k, v, dout, out, lse, delta, dq, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                              *dout.stride()[:3], *out.stride()[:3], *dq.stride()[:3], H, T, scale * LOG2E, scale,
                              **launch_constants("dq", D, q.dtype, causal, tile))
    return dq, delta


def one_kernel(dout, q, k, v, out, lse, causal: bool, scale: float, tile, dq_work: int = 3):
    """dQ, dK and dV from the one-kernel backward: a δ pass, the kernel, then dQ scaled and cast. At a `Tile` the
    math warps add dQ into a zeroed fp32 buffer in fragment order, put back in row order here (`dq_work` < 3: an
    ablation, for timing only); at a `ReducerTile` a reducer warp adds it in row order (the "one-ws" kernel)."""
    B, H, T, D = q.shape
    _streamable(q, k, v, dout)
    delta = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    _attn_bwd_delta_hopper[(triton.cdiv(T, 128), B * H)](out, dout, delta, *out.stride()[:3], *dout.stride()[:3], H, T,
                                                         HEAD_DIM=D, BLOCK_M=128, num_warps=8)
    t_acc = triton.cdiv(T, 128) * 128  # every query tile's rows, padding included (BLOCK_M divides 128)
    dq_acc = torch.zeros(B * H, t_acc, D, device=q.device, dtype=torch.float32)
    dk = torch.empty_like(k)
    dv = torch.empty_like(dk, dtype=v.dtype)
    reducer = isinstance(tile, ReducerTile)
    kernel, constants = ((_attn_bwd_one_ws_hopper, launch_constants("one-ws", D, q.dtype, causal, tile)) if reducer
                         else (_attn_bwd_dkdv_hopper, launch_constants("one", D, q.dtype, causal, tile, dq_work)))
    kernel[(triton.cdiv(T, tile.own), B * H)](
        q, k, v, dout, lse, delta, dk, dv, dq_acc, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *dout.stride()[:3], *dk.stride()[:3], H, T, t_acc, scale * LOG2E, scale, **constants)
    dq = (dq_acc[:, :T] * scale).to(q.dtype) if reducer else dq_from_fragments(dq_acc, T, scale, q.dtype)
    return dq.view(B, H, T, D), dk, dv


def dq_from_fragments(dq_acc, T: int, scale: float, dtype):
    """The fp32 dQ buffer of `_dq_fragment_offsets` back in row order: per 16 rows (a, b, g) and 8 columns (j, t, e),
    stored as (a, j, g, t, b, e); the first T rows, scaled, in `dtype`."""
    BH, t_acc, D = dq_acc.shape
    tiles = dq_acc.view(BH, t_acc // 16, D // 8, 8, 4, 2, 2).permute(0, 1, 5, 3, 2, 4, 6)
    return (tiles.reshape(BH, t_acc, D)[:, :T] * scale).to(dtype)


def forward_for_backward(q, k, v, causal: bool):
    """Our forward's output and base-2 lse, and its spec's key."""
    key = ops.register_spec(build_spec(resolve("fa2"), None, q.dtype, q.shape[2]))
    out, _, lse, _, _ = ops.forward(q, k, v, causal, q.shape[-1] ** -0.5, key, False, 0.0)
    return out, lse, key


def check(kernel: str, shape, causal: bool, tile: Tile, dtype=torch.bfloat16) -> dict:
    """Our kernels' rule: each gradient within twice the reference `fa2` backward's error against fp64, plus an ulp
    of the largest entry; the dQ kernel's δ equal to rowsum(dO ∘ O) in fp32 within fp32 rounding."""
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    scale = shape[-1] ** -0.5
    out, lse, _ = forward_for_backward(q, k, v, causal)
    delta = (dout.float() * out.float()).sum(-1)
    if kernel == "dkdv":
        ours = dict(zip(("dk", "dv"), dkdv(dout, q, k, v, lse, delta, causal, scale, tile)))
    elif kernel in ("one", "one-ws"):
        ours = dict(zip(("dq", "dk", "dv"), one_kernel(dout, q, k, v, out, lse, causal, scale, tile)))
    else:
        dq, their_delta = dq_and_delta(dout, q, k, v, out, lse, causal, scale, tile)
        ours = {"dq": dq}
    result = {"kernel": kernel, "shape": list(shape), "causal": causal, "tile": str(tile), "dtype": str(dtype),
              "ok": True}
    if kernel == "dq":
        result["delta_err"] = (their_delta - delta).abs().max().item()
        result["ok"] = result["delta_err"] <= 1e-5 * max(1.0, delta.abs().max().item())
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, causal=causal, precision="fa2", backend="reference").backward(dout)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*exact, is_causal=causal).backward(dout.double())
    for i, name in enumerate(("dq", "dk", "dv")):
        if name not in ours:
            continue
        want = exact[i].grad
        err = (ours[name].double() - want).abs().max().item()
        ref_err = (leaves[i].grad.double() - want).abs().max().item()
        result |= {f"{name}_err": err, f"{name}_reference_err": ref_err}
        result["ok"] &= bool(torch.isfinite(ours[name]).all()) and err <= 2 * ref_err + want.abs().max().item() * 2.0 ** -8
    return result


# the one-kernel backward's timing-only variants (`DQ_WORK`), each leaving out one more part of dQ's work
ABLATIONS = {2: "without the atomics", 1: "without dQ's matmul either", 0: "without dSᵀ's store either"}


def timed(shape, tiles: dict, ablate: bool = False) -> dict:
    """Milliseconds from CUDA graphs, causal: our Triton backward (dQ and dK/dV kernels), our Triton dK/dV kernel
    alone, the Gluon kernels at each of their `tiles` ({"dkdv" | "dq" | "one": [Tile]}; `ablate`: the one-kernel
    backward's `ABLATIONS` after each of its tiles), and cuDNN's backward (its forward+backward less its forward);
    and TFLOP/s: the backward's conventional 2.5x the forward's FLOPs (five matmuls, as the one-kernel backward
    computes; its ablations are counted the same, so that they compare in time); the dK/dV kernels' four of them,
    the dQ kernels' three (they recompute S and dP)."""
    B, H, T, D = shape
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse, key = forward_for_backward(q, k, v, True)
    delta = (dout.float() * out.float()).sum(-1)
    scale = D ** -0.5
    matmul_flops = 2 * B * H * T * T * D / 2  # one matmul over the visible (causal) scores

    def triton_dkdv():
        spec, _, _, meta, dkdv_meta, _ = ops._meta(key)
        meta = dict(meta)
        either = ops._choose_load_path(meta, spec, D, False, q, k, v, dout)
        dk = torch.empty_like(k)
        dv = torch.empty_like(dk)
        ops._launch(ops._dkdv_either if either else ops._dkdv, kernels._attn_bwd_dkdv,
                    lambda m: (triton.cdiv(T, m["BLOCK_N"]), B * H), q, k, v, dout, lse, delta, dk, dv,
                    *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3], H, T,
                    scale * LOG2E, scale, spec.logical_m, HEAD_DIM=D, CAUSAL=True, **meta, **dkdv_meta)

    def cudnn(backward: bool):
        leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
            if backward:
                torch.autograd.grad(o, leaves, dout)
        return run

    def ms(fn):
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=100)

    runs = {"triton-backward": (lambda: ops.backward(dout, q, k, v, out, lse, True, scale, key), 5),
            "triton-dkdv": (triton_dkdv, 4)}
    for tile in tiles.get("dkdv", ()):
        runs[f"gluon-dkdv {tile}"] = (lambda t=tile: dkdv(dout, q, k, v, lse, delta, True, scale, t), 4)
    for tile in tiles.get("dq", ()):
        runs[f"gluon-dq {tile}"] = (lambda t=tile: dq_and_delta(dout, q, k, v, out, lse, True, scale, t), 3)
    for tile in tiles.get("one", ()):
        runs[f"gluon-one-kernel {tile}"] = (lambda t=tile: one_kernel(dout, q, k, v, out, lse, True, scale, t), 5)
        for work, left_out in ABLATIONS.items() if ablate else ():
            runs[f"gluon-one-kernel {tile} {left_out}"] = (
                lambda t=tile, w=work: one_kernel(dout, q, k, v, out, lse, True, scale, t, w), 5)
    for tile in tiles.get("one-ws", ()):
        runs[f"gluon-one-ws {tile}"] = (lambda t=tile: one_kernel(dout, q, k, v, out, lse, True, scale, t), 5)
    row = {"shape": list(shape)}
    for name, (fn, _) in runs.items():
        row[name] = {"ms": ms(fn)}
    row["cudnn-backward"] = {"ms": ms(cudnn(True)) - ms(cudnn(False))}
    runs["cudnn-backward"] = (None, 5)
    best = [min((row[n]["ms"] for n in runs if n.startswith(f"gluon-{kind} ")), default=None) for kind in ("dq", "dkdv")]
    if None not in best:  # the two best Gluon kernels, one after the other
        row["gluon-backward (best dq + best dkdv)"] = {"ms": sum(best)}
        runs["gluon-backward (best dq + best dkdv)"] = (None, 5)
    for name, (_, matmuls) in runs.items():
        row[name]["tflops"] = matmuls * matmul_flops / (row[name]["ms"] * 1e9)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/gluon-backward-h200.json"))
    parser.add_argument("--shapes", default=None, help="B,H,T,D;...")
    parser.add_argument("--kernels", default="dkdv,dq,one",
                        help="which Gluon kernels to check and time: dkdv, dq, one, one-ws")
    parser.add_argument("--ablate", action="store_true", help="time the one-kernel backward without parts of dQ's work")
    parser.add_argument("--only", default="", help="only the tiles whose name contains this (e.g. tma-reduce)")
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes, SHAPES)
    tiles = {kernel: {d: [t for t in by_d if args.only in str(t)] for d, by_d in TILES[kernel].items()}
             for kernel in args.kernels.split(",")}
    meta = run_meta() | {"timing": "do_bench_cudagraph median, causal bf16",
                         "flops": "per matmul 2*B*H*T^2*D/2 (causal); backward 5 of them, dK/dV 4, dQ 3"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "checks": [], "rows": []}
    passed = {}
    for kernel, by_head_dim in tiles.items():
        for head_dim in sorted({s[-1] for s in shapes}):
            for tile in by_head_dim[head_dim]:
                checks = [check(kernel, shape, causal, tile) for shape in [(2, 3, 77, head_dim), (1, 4, 513, head_dim)]
                          for causal in (True, False)] + [check(kernel, (2, 3, 77, head_dim), True, tile, torch.float16)]
                passed[kernel, head_dim, tile] = all(c["ok"] for c in checks)
                result["checks"] += checks
                print(f"{kernel} D={head_dim} {str(tile):<24} checks "
                      f"{'ok' if passed[kernel, head_dim, tile] else 'FAILED'}", flush=True)
                args.out.write_text(json.dumps(result, indent=1))
    for shape in shapes:
        D = shape[-1]
        row = timed(shape, {kernel: [t for t in by_head_dim[D] if passed[kernel, D, t]]
                            for kernel, by_head_dim in tiles.items()}, args.ablate)
        result["rows"].append(row)
        print(f"{str(shape)}\n" + "".join(f"    {name:<56} {value['tflops']:6.0f} TFLOP/s  {value['ms']:.3f} ms\n"
                                          for name, value in row.items() if name != "shape"), flush=True)
        args.out.write_text(json.dumps(result, indent=1))

if __name__ == "__main__":
    main()
