"""Study: the Hopper forward in Gluon (`stableflash/attention/triton/hopper.py`, FA3's schedule: the softmax under the
tensor cores' work), over launch tiles, against our Triton forward and cuDNN. Its measurements chose
`hopper.FORWARD_TILES`, the tiles `ops.forward` launches on sm_90.

History (docs/kernel-notes.md): a first schedule ran tile j's softmax with S_{j+1} and P̄_{j-1}V_{j-1} in flight
and waited for the older alone; ptxas serialised every wgmma of it (`offline.wgmma_serialization`), so it was no
faster than Triton. FA3's order (issue S_{j+1}, rescale, issue P̄_jV_j, wait for S_{j+1} alone) gave 1.05x our
forward at D = 64; pingpong (two warpgroups taking turns) 1.07x at D = 128.

Every timed variant is first checked: the error against fp64 within twice that of the reference backend under the
same numerics (`fa2`, SFA per 128-key tile), statistics equal to the reference's.

    python benchmarks/gluon_forward.py --out results/gluon-forward-h200.json     # on an H200: check, then time
    python benchmarks/gluon_forward.py --sweep --only pingpong --shapes "4,16,4096,128"
The kernel compiles for sm_90 on any machine (tests/attention/test_kernel_compile.py does, without a GPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from stableflash import SFA, AttentionStats, flash_attention
from stableflash.attention.precision import resolve
from stableflash.attention.triton import ops
from stableflash.attention.triton.hopper import Tile, _attn_fwd_hopper, constants, grid
from stableflash.attention.triton.ops import ensure_scratch_allocator, fresh_stat_targets, tma_streamable
from stableflash.attention.triton.spec import LOG2E, build_spec
from stableflash.benchmarking import parse_shapes, run_meta

SHAPES = [(16, 12, 1024, 64), (4, 12, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)]


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


def softmax_constants(stabilize, stats_eps: float | None, dtype, T: int) -> tuple[dict, float]:
    """SFA's compile-time constants and whether to count statistics, as our Triton kernel gets them, and eps in base 2
    (SFA's, else the statistics')."""
    spec = build_spec(resolve("fa2"), stabilize, dtype, T)
    eps_u = spec.eps if stabilize is not None else (stats_eps or 0.0) * LOG2E
    return dict(stab=spec.stab, beta=spec.beta, low=spec.low, high=spec.high, bounded=spec.bounded,
                stats=stats_eps is not None), eps_u


def launch_constants(head_dim: int, dtype, T: int, causal: bool, loader_warp: bool = False, stabilize=None,
                     stats_eps=None, tile: Tile | None = None) -> tuple[dict, float]:
    """The kernel's compile-time arguments (tile, layouts, switches, warps) and its runtime eps, base 2."""
    tile = tile or tile_for(head_dim)
    softmax, eps_u = softmax_constants(stabilize, stats_eps, dtype, T)
    return {**constants(head_dim, dtype, causal, tile, **softmax, loader_warp=loader_warp), "num_warps": tile.warps}, eps_u


def forward(q, k, v, causal: bool, scale: float, loader_warp: bool = False, stabilize=None, stats_eps=None,
            tile: Tile | None = None):
    """The Gluon kernel: attention output (B, H, T, D), log-sum-exp (B, H, T, base 2), and the statistics (rows with
    a repeated maximum, P̄ = 1 entries and rows per head, (H, 3) int64; largest score per head, (H,)) when `stats_eps` is
    given. `loader_warp`: K and V streamed by a warp of their own (`gl.warp_specialize`) rather than by the
    computing warps; `stabilize`: None or an `SFA`; `tile`: the launch shape (default `tile_for(D)`)."""
    B, H, T, D = q.shape
    if D not in (64, 128) or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q: the Gluon study takes head dims 64 and 128 in bf16 or fp16, got {D} and {q.dtype}")
    if not tma_streamable(q, k, v):
        raise ValueError("q, k, v: the Gluon study loads rows by TMA: 16-byte aligned bases and row strides needed")
    ensure_scratch_allocator()  # device-side descriptors
    tile = tile or tile_for(D)
    consts, eps_u = launch_constants(D, q.dtype, T, causal, loader_warp, stabilize, stats_eps, tile)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    counts, smax = fresh_stat_targets(H, q.device)
    _attn_fwd_hopper[grid(B * H, T, tile)](q, k, v, out, lse, counts, smax, *q.stride()[:3], *k.stride()[:3],
                                           *v.stride()[:3], *out.stride()[:3], H, T, scale * LOG2E, eps_u, **consts)
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
    """Forward TFLOP/s from a CUDA graph: the Gluon study, our kernels (fa2 numerics) as `ops` launches them (the
    "triton" runs: on sm_90 at T >= 4096 the Gluon forward where `hopper.FORWARD_TILES` has a tile) and SDPA's
    cuDNN; the runs named in `skip` are left out (None)."""
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
    """Forward TFLOP/s from a CUDA graph on one launch tile, plain, with SFA, and with SFA + statistics, and their
    ratios to `base` (a `timed` row: our Triton forward and cuDNN at the same shape)."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * shape[0] * shape[1] * shape[2] ** 2 * shape[3] / 2
    scale, stats_eps = shape[-1] ** -0.5, AttentionStats(1).eps
    runs = {"plain": lambda: forward(q, k, v, True, scale, tile=tile),
            "sfa": lambda: forward(q, k, v, True, scale, stabilize=SFA(), tile=tile),
            "sfa-stats": lambda: forward(q, k, v, True, scale, stabilize=SFA(), stats_eps=stats_eps, tile=tile)}
    row = {"shape": list(shape)}
    for name, fn in runs.items():
        fn()
        row[name] = flops / (triton.testing.do_bench_cudagraph(fn, rep=100) * 1e-3) / 1e12
    return {**row, "vs_triton": row["plain"] / base["triton"], "vs_cudnn": row["plain"] / base["cudnn"],
            "sfa_vs_triton": row["sfa"] / base["triton-sfa"], "sfa_stats_vs_triton": row["sfa-stats"] / base["triton-sfa-stats"]}


def sweep(shapes, out: Path, meta: dict, only: str = "") -> None:
    """Every tile of SWEEP_TILES (whose name contains `only`) at the shapes of its head dim: four checks (both
    shapes, causal and not, plain and SFA + statistics), then, if all pass, forward TFLOP/s plain, with SFA and with
    SFA + statistics beside our forward as shipped (`timed`) and cuDNN. The JSON is rewritten after each tile, so a
    run cut short keeps what it measured."""
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
                f" sfa {r['sfa']:.0f} ({r['sfa_vs_triton']:.2f}x), sfa+stats {r['sfa-stats']:.0f}"
                f" ({r['sfa_stats_vs_triton']:.2f}x)" for r in entry["rows"]), flush=True)
            out.write_text(json.dumps(result, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/gluon-forward-h200.json"))
    parser.add_argument("--shapes", default=None, help="B,H,T,D;...")
    parser.add_argument("--sweep", action="store_true", help="the launch tiles of SWEEP_TILES instead of the study")
    parser.add_argument("--only", default="", help="with --sweep: only the tiles whose name contains this")
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes, SHAPES)
    meta = run_meta() | {"timing": "do_bench_cudagraph median, forward only, causal bf16", "flops": "4*B*H*T^2*D/2"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # the baselines named "triton" must be the Triton forward: `flash_attention` would launch the Gluon kernel on
    # sm_90 where `hopper.FORWARD_TILES` says (at 693ebc9 it did, and the short-T sweep timed the kernel against
    # itself); this study launches its Gluon variants directly
    ops.HOPPER_FORWARD = False
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
