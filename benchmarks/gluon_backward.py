"""Study: the dK/dV half of the backward in Gluon, its matmuls overlapped with the elementwise work between them,
against our Triton dK/dV kernel and cuDNN's backward.

Why (docs/kernel-notes.md): the backward is ~70% of forward+backward and runs at 0.74-0.80x cuDNN's; Triton 3.6
waits for every wgmma but a loop-carried accumulator's, so in our dK/dV kernel Pᵀ's exponentials wait for
dPᵀ = V dOᵀ to finish although they need only Sᵀ = K Qᵀ. Per query tile j this kernel issues Sᵀ_j and dPᵀ_j, waits
for Sᵀ_j alone and computes Pᵀ_j while dPᵀ_j runs, issues dV += Pᵀ_j dO_j, waits for dPᵀ_j alone and computes
dSᵀ_j = Pᵀ_j (dPᵀ_j - δ) while dV's matmul runs, issues dK += dSᵀ_j Q_j, and retires everything before the next
tile (one full wait per iteration: a partial wait across the loop's back edge made ptxas serialise every wgmma of
the forward study, C7514). K and V stay in shared memory; Q and dO tiles arrive by TMA through a ring of STAGES
buffers, refilled once a tile's matmuls are done. Each program owns BLOCK_N keys on BLOCK_N / 16 warps.

Native FA2 numerics as `kernels._attn_bwd_dkdv` computes them: Pᵀ = exp2(min(Sᵀ·scale·log2e - lse, 0)) from the
forward's base-2 log-sum-exp (rows with no visible key, lse = -inf, give P = 0), dSᵀ = Pᵀ (dPᵀ - δ) with δ =
rowsum(dO ∘ O) in fp32 (the dQ kernel's), dK scaled once at the end. Causal or not, any T, head dims 64 and 128,
bf16 and fp16, 16-byte aligned rows. Not wired into `ops` (a study, as the forward was first).

    python benchmarks/gluon_backward.py --out results/gluon-backward-h200.json     # on an H200: check, then time
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
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from stableflash import flash_attention
from stableflash.attention.precision import resolve
from stableflash.attention.triton import kernels, ops
from stableflash.attention.triton.spec import LOG2E, build_spec

SHAPES = [(16, 12, 1024, 64), (4, 12, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)]


@gluon.jit
def _issue_q_do(q_desc, do_desc, q_smem, do_smem, bars, start_m, i, STAGES: gl.constexpr, pred):
    """TMA loads of the query tile from row `start_m` (Q and dO) into buffer i % STAGES, counted on its barrier."""
    stage = i % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], bar, q_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(do_desc, [start_m, 0], bar, do_smem.index(stage), pred=pred)


@gluon.jit
def _attn_bwd_dkdv_hopper(Q, K, V, DO, LSE, DELTA, DK, DV,
                          stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
                          stride_vt, stride_dob, stride_doh, stride_dot, stride_gb, stride_gh, stride_gt,
                          H, T, qk_scale, scale,
                          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          CAUSAL: gl.constexpr, Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
                          num_warps: gl.constexpr):
    gl.static_assert(STAGES >= 2, "a query tile's buffer is refilled once its matmuls are done: two keep one ahead")
    dtype: gl.constexpr = Q.dtype.element_ty
    pid_n = gl.program_id(0)  # key tile: the first ones see the most query tiles, so the heaviest start first
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, [T, HEAD_DIM], [stride_qt, 1],
                                        [BLOCK_M, HEAD_DIM], Q_LAYOUT)
    do_desc = tma.make_tensor_descriptor(DO + b * stride_dob + h * stride_doh, [T, HEAD_DIM], [stride_dot, 1],
                                         [BLOCK_M, HEAD_DIM], Q_LAYOUT)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, [T, HEAD_DIM], [stride_kt, 1],
                                        [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, [T, HEAD_DIM], [stride_vt, 1],
                                        [BLOCK_N, HEAD_DIM], KV_LAYOUT)

    # Sᵀ and dPᵀ (keys x queries) and dK, dV (keys x head dim) in wgmma accumulator layouts, one warpgroup per 64 keys;
    # Pᵀ and dSᵀ as the register A operands of dV's and dK's matmuls; the queries' lse and δ along Sᵀ's columns
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)

    n0 = pid_n * BLOCK_N
    lo = (n0 // BLOCK_M) * BLOCK_M if CAUSAL else 0  # the first query tile that sees one of these keys
    n_tiles = gl.cdiv(T - lo, BLOCK_M)
    # query tiles crossing the diagonal (causal) or past T need a mask; the ones between do not
    diag_end = gl.minimum(n0 + BLOCK_N, T) if CAUSAL else lo
    free_end = (T // BLOCK_M) * BLOCK_M

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [n0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [n0, 0], kv_bar, v_smem)
    for i in gl.static_range(STAGES):
        _issue_q_do(q_desc, do_desc, q_smem, do_smem, ready_bars, lo + i * BLOCK_M, i, STAGES, i < n_tiles)

    keys = n0 + gl.arange(0, BLOCK_N, layout=row_layout)
    row_off = bh.to(gl.int64) * T
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    mbarrier.wait(kv_bar, 0)

    for i in range(n_tiles):
        start_m = lo + i * BLOCK_M
        stage = i % STAGES
        mbarrier.wait(ready_bars.index(stage), (i // STAGES) & 1)
        q_tile = q_smem.index(stage)
        do_tile = do_smem.index(stage)
        # Sᵀ = K Qᵀ, then dPᵀ = V dOᵀ; the queries' statistics load while they run
        st = warpgroup_mma(k_smem, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        queries = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
        lse = gl.load(LSE + row_off + queries, mask=queries < T, other=0.0)
        lse = gl.where(lse == float("-inf"), float("inf"), lse)  # rows with no visible key: P = 0
        delta = gl.load(DELTA + row_off + queries, mask=queries < T, other=0.0)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
        # Pᵀ while dPᵀ computes (P <= 1 exactly: a recomputed score may exceed the saved lse by a few ulps)
        pt = gl.exp2(gl.minimum(st * qk_scale - lse[None, :], 0.0))
        if (start_m < diag_end) | (start_m >= free_end):
            valid = (queries[None, :] < T) & (keys[:, None] < T)
            if CAUSAL:
                valid = valid & (queries[None, :] >= keys[:, None])
            pt = gl.where(valid, pt, 0.0)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout, assert_trivial=True)
        dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
        # dPᵀ done (dV's matmul may still run): dSᵀ while it does
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt,))
        dst = pt * (dpt - delta[None, :])
        dst_op = gl.convert_layout(dst.to(dtype), op_layout, assert_trivial=True)
        dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
        # everything of this tile retired before the next: its operands' registers and its buffer are free then
        dk, dv, pt_op, dst_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, pt_op, dst_op))
        gl.thread_barrier()  # every warpgroup done with buffer `stage` before one thread refills it
        _issue_q_do(q_desc, do_desc, q_smem, do_smem, ready_bars, start_m + STAGES * BLOCK_M, i + STAGES, STAGES,
                    i + STAGES < n_tiles)

    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready_bars.index(i))
    g_rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, g_layout))
    g_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))
    out = b * stride_gb + h * stride_gh + g_rows[:, None].to(gl.int64) * stride_gt + g_cols[None, :]
    gl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=g_rows[:, None] < T)
    gl.store(DV + out, dv.to(DV.dtype.element_ty), mask=g_rows[:, None] < T)


class Tile(NamedTuple):
    """Keys per program (one warpgroup per 64: `warps` = block_n // 16), queries per tile, Q/dO ring buffers."""
    block_n: int = 128
    block_m: int = 64
    stages: int = 2

    @property
    def warps(self) -> int:
        return self.block_n // 16

    def __str__(self):
        return f"{self.block_n}x{self.block_m}/{self.stages}st/{self.warps}w"


TILES = {64: [Tile(128, 64, 3), Tile(64, 64, 3), Tile(128, 32, 4)], 128: [Tile(128, 64, 2), Tile(128, 32, 3), Tile(64, 64, 3)]}


def launch_constants(head_dim: int, dtype, causal: bool, tile: Tile) -> dict:
    gdtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return dict(HEAD_DIM=head_dim, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, STAGES=tile.stages, CAUSAL=causal,
                Q_LAYOUT=gl.NVMMASharedLayout.get_default_for([tile.block_m, head_dim], gdtype),
                KV_LAYOUT=gl.NVMMASharedLayout.get_default_for([tile.block_n, head_dim], gdtype),
                num_warps=tile.warps)


def dkdv(dout, q, k, v, lse, delta, causal: bool, scale: float, tile: Tile):
    """dK and dV from the Gluon kernel, given the forward's base-2 lse and δ = rowsum(dO ∘ O) (both (B, H, T) fp32)."""
    B, H, T, D = q.shape
    if not ops.tma_streamable(q, k, v, dout):
        raise ValueError("q, k, v, dout: the Gluon study loads rows by TMA: 16-byte aligned bases and row strides")
    ops.ensure_scratch_allocator()
    dk = torch.empty_like(k)
    dv = torch.empty_like(dk, dtype=v.dtype)  # the kernel writes both through dK's strides
    grid = (triton.cdiv(T, tile.block_n), B * H)
    _attn_bwd_dkdv_hopper[grid](q, k, v, dout, lse, delta, dk, dv, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                *dout.stride()[:3], *dk.stride()[:3], H, T, scale * LOG2E, scale,
                                **launch_constants(D, q.dtype, causal, tile))
    return dk, dv


def forward_for_backward(q, k, v, causal: bool):
    """Our forward's output and base-2 lse, and δ = rowsum(dO ∘ O) in fp32 as the dQ kernel computes it."""
    key = ops.register_spec(build_spec(resolve("fa2"), None, q.dtype, q.shape[2]))
    out, _, lse, _, _ = ops.forward(q, k, v, causal, q.shape[-1] ** -0.5, key, False, 0.0)
    return out, lse, key


def check(shape, causal: bool, tile: Tile) -> dict:
    """Our kernels' rule: dK and dV within twice the reference `fa2` backward's error against fp64, plus an ulp."""
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    out, lse, _ = forward_for_backward(q, k, v, causal)
    delta = (dout.float() * out.float()).sum(-1)
    dk, dv = dkdv(dout, q, k, v, lse, delta, causal, shape[-1] ** -0.5, tile)
    result = {"shape": list(shape), "causal": causal, "tile": str(tile), "ok": True}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, causal=causal, precision="fa2", backend="reference").backward(dout)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*exact, is_causal=causal).backward(dout.double())
    for name, ours, ref, want in (("dk", dk, leaves[1].grad, exact[1].grad), ("dv", dv, leaves[2].grad, exact[2].grad)):
        err = (ours.double() - want).abs().max().item()
        ref_err = (ref.double() - want).abs().max().item()
        ok = bool(torch.isfinite(ours).all()) and err <= 2 * ref_err + want.abs().max().item() * 2.0 ** -8
        result |= {f"{name}_err": err, f"{name}_reference_err": ref_err}
        result["ok"] &= ok
    return result


def timed(shape, tiles) -> dict:
    """Milliseconds from CUDA graphs, causal: our Triton backward (dQ and dK/dV kernels), our Triton dK/dV kernel
    alone, the Gluon dK/dV kernel at each tile, and cuDNN's backward (its forward+backward less its forward); and
    TFLOP/s: the backward's conventional 2.5x the forward's FLOPs (five matmuls), the dK/dV kernels' four of them."""
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
    for tile in tiles:
        runs[f"gluon-dkdv {tile}"] = (lambda t=tile: dkdv(dout, q, k, v, lse, delta, True, scale, t), 4)
    row = {"shape": list(shape)}
    for name, (fn, _) in runs.items():
        row[name] = {"ms": ms(fn)}
    row["cudnn-backward"] = {"ms": ms(cudnn(True)) - ms(cudnn(False))}
    runs["cudnn-backward"] = (None, 5)
    for name, (_, matmuls) in runs.items():
        row[name]["tflops"] = matmuls * matmul_flops / (row[name]["ms"] * 1e9)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/gluon-backward-h200.json"))
    parser.add_argument("--shapes", default=None, help="B,H,T,D;...")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("STABLEFLASH_COMMIT"),
            "timing": "do_bench_cudagraph median, causal bf16",
            "flops": "per matmul 2*B*H*T^2*D/2 (causal); backward 5 of them, dK/dV 4"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "checks": [], "rows": []}
    passed = {}
    for head_dim, tiles in TILES.items():
        for tile in tiles:
            checks = [check(shape, causal, tile) for shape in [(2, 3, 77, head_dim), (1, 4, 513, head_dim)]
                      for causal in (True, False)]
            passed[head_dim, tile] = all(c["ok"] for c in checks)
            result["checks"] += checks
            print(f"D={head_dim} {str(tile):<16} checks {'ok' if passed[head_dim, tile] else 'FAILED'}", flush=True)
            args.out.write_text(json.dumps(result, indent=1))
    for shape in shapes:
        row = timed(shape, [t for t in TILES[shape[-1]] if passed[shape[-1], t]])
        result["rows"].append(row)
        print(f"{str(shape):<22}" + "  ".join(f"{name} {value['tflops']:.0f} ({value['ms']:.3f} ms)"
                                            for name, value in row.items() if name != "shape"), flush=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
