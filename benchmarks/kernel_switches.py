"""The kernels' study switches against the kernels' pointer-load path, at the same tiles, in the same process.

`TMA`: the streamed tiles loaded by the tensor memory accelerator from one tensor descriptor per head, where the
pointer path loads them with cp.async: K and V in the forward and in the dQ kernel, Q and dO in the dK/dV kernel
(docs/kernel-notes.md has the reasoning; since a1db43a the autotuner picks TMA per tile at D >= 128, and this study
pins the pointer path's tile to time the switch alone). For each shape and kernel: the pointer path's tiles,
then TFLOP/s from a CUDA graph for the pointer path and with the switch, in two interleaved rounds (so the
spread between rounds shows the noise), and whether the outputs are bit-identical (they must be: only the loads
change). Forward for plain, SFA and SFA + statistics; backward (dQ and dK/dV kernels together) for the plain
kernel (SFA changes only the forward). Causal, bf16.

    python benchmarks/kernel_switches.py --out results/kernel-switches-h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from stableflash import SFA
from stableflash.attention.precision import resolve
from stableflash.attention.triton import ops
from stableflash.attention.triton.spec import build_spec
from stableflash.benchmarking import parse_shapes, run_meta

SHAPES = [(16, 12, 1024, 64), (4, 12, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)]
# forward kernel -> (stabilizer, statistics)
FORWARD = {"plain": (None, False), "sfa": (SFA(), False), "sfa+stats": (SFA(), True)}
SWITCH = "TMA"
ROUNDS = 2


def _tile_name(cfg) -> str:
    return f"{cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']}/w{cfg.num_warps}/s{cfg.num_stages}"


def _compare(name, shape, tiles, run, flops) -> dict:
    """Time `run(False)` against `run(True)` from CUDA graphs in interleaved rounds; compare their outputs."""
    base, variant = run(False), run(True)
    same = all(torch.equal(a, b) for a, b in zip(base, variant))
    timed = {"base": [], "variant": []}
    for _ in range(ROUNDS):
        for which, on in (("base", False), ("variant", True)):
            ms = triton.testing.do_bench_cudagraph(lambda on=on: run(on), rep=100, return_mode="median")
            timed[which].append(flops / (ms * 1e-3) / 1e12)
    ratio = sum(timed["variant"]) / sum(timed["base"])
    print(f"{str(shape):<22}{name:<14}{tiles:<30}"
          + " ".join(f"{b:6.1f}/{x:6.1f}" for b, x in zip(timed["base"], timed["variant"]))
          + f"  x{ratio:.3f}  identical={same}", flush=True)
    return {"shape": list(shape), "kernel": name, "switch": SWITCH, "tile": tiles, "tflops_base": timed["base"],
            "tflops_variant": timed["variant"], "ratio": ratio, "bit_identical": same}


def study(shape) -> list[dict]:
    B, H, T, D = shape
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale, fwd_flops = D ** -0.5, 4 * B * H * T * T * D / 2
    rows = []
    for name, (stab, stats) in FORWARD.items():
        key = ops.register_spec(build_spec(resolve("fa2"), stab, torch.bfloat16, T))
        eps = stab.eps if stab is not None else 0.0
        ops.forward(q, k, v, True, scale, key, stats, eps, **{SWITCH: False})  # autotune pointers, pin the tile
        tile = ops._fwd.best_config

        def forward(on, tile=tile, key=key, stats=stats, eps=eps):
            return ops.forward(q, k, v, True, scale, key, stats, eps, tile=tile, **{SWITCH: on})

        rows.append(_compare(f"fwd {name}", shape, _tile_name(tile), forward, fwd_flops))

    key = ops.register_spec(build_spec(resolve("fa2"), None, torch.bfloat16, T))
    out, o_saved, lse, _, _ = ops.forward(q, k, v, True, scale, key, False, 0.0)
    saved = o_saved if o_saved.numel() else out
    ops.backward(dout, q, k, v, saved, lse, True, scale, key, **{SWITCH: False})  # autotune pointers, pin the tiles
    tiles = (ops._dkdv.best_config, ops._dq.best_config)

    def backward(on):
        return ops.backward(dout, q, k, v, saved, lse, True, scale, key, tiles=tiles, **{SWITCH: on})

    names = f"dkdv {_tile_name(tiles[0])} dq {_tile_name(tiles[1])}"
    rows.append(_compare("bwd plain", shape, names, backward, 2.5 * fwd_flops))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/kernel-switches-h200.json"))
    parser.add_argument("--shapes", default=None, help="e.g. 16,12,1024,64;4,12,4096,64")
    args = parser.parse_args()
    # the TMA switch's device-side descriptors need global scratch
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    shapes = parse_shapes(args.shapes, SHAPES)
    print(f"{'shape':<22}{'kernel':<14}{'tiles':<30}TFLOP/s base/variant per round, ratio")
    rows = []
    for shape in shapes:
        rows += study(shape)
        meta = run_meta() | {"timing": "do_bench_cudagraph median, causal bf16, the same tiles for base and variant",
                             "flops": "fwd 4*B*H*T^2*D/2, bwd 2.5x that"}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
