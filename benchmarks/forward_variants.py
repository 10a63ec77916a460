"""The forward kernel's study switches against the kernel as it ships, at the same tile, in the same process.

`TMA`: K and V tiles loaded by the tensor memory accelerator from one tensor descriptor per head, where the kernel as
it ships loads them through pointers (cp.async); docs/kernel-notes.md has the reasoning. For each shape and kernel:
the autotuner's tile, then forward TFLOP/s from a CUDA graph for the kernel as it ships and with the switch, in two
interleaved rounds (so the spread between rounds shows the noise), and whether the outputs are bit-identical (they
must be: only the loads change). Causal, bf16.

    python benchmarks/forward_variants.py --out results/forward-variants-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import triton

from stableflash import SFA
from stableflash.attention.precision import resolve
from stableflash.attention.triton import ops
from stableflash.attention.triton.spec import build_spec

SHAPES = [(16, 12, 1024, 64), (4, 12, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)]
# kernel -> (stabilizer, statistics, the switch under study)
KERNELS = {"plain": (None, False, "TMA"), "sfa": (SFA(), False, "TMA"), "sfa+stats": (SFA(), True, "TMA")}
ROUNDS = 2


def study(shape) -> list[dict]:
    B, H, T, D = shape
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale, flops = D ** -0.5, 4 * B * H * T * T * D / 2
    rows = []
    for name, (stab, stats, switch) in KERNELS.items():
        key = ops.register_spec(build_spec(resolve("fa2"), stab, torch.bfloat16, T))
        eps = stab.eps if stab is not None else 0.0
        ops.forward(q, k, v, True, scale, key, stats, eps)  # autotune, then pin its tile for both kernels
        tile = ops._fwd.best_config

        def run(on, tile=tile, key=key, stats=stats, eps=eps, switch=switch):
            return ops.forward(q, k, v, True, scale, key, stats, eps, tile=tile, **{switch: on})

        base, variant = run(False), run(True)
        same = all(torch.equal(a, b) for a, b in zip(base, variant))
        diff = (base[0].float() - variant[0].float()).abs().max().item()
        timed = {"base": [], "variant": []}
        for _ in range(ROUNDS):
            for which, on in (("base", False), ("variant", True)):
                ms = triton.testing.do_bench_cudagraph(lambda on=on: run(on), rep=100, return_mode="median")
                timed[which].append(flops / (ms * 1e-3) / 1e12)
        rows.append({"shape": list(shape), "kernel": name, "switch": switch,
                     "tile": f"{tile.kwargs['BLOCK_M']}x{tile.kwargs['BLOCK_N']}/w{tile.num_warps}/s{tile.num_stages}",
                     "fwd_tflops_base": timed["base"], "fwd_tflops_variant": timed["variant"],
                     "bit_identical": same, "out_max_abs_diff": diff})
        r = rows[-1]
        print(f"{str(shape):<22}{name:<11}{switch:<14}{r['tile']:<16}"
              + " ".join(f"{b:6.1f}/{x:6.1f}" for b, x in zip(timed["base"], timed["variant"]))
              + f"  x{sum(timed['variant']) / sum(timed['base']):.3f}  identical={same} diff={diff:.2e}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/forward-variants-h200.json"))
    parser.add_argument("--shapes", default=None, help="e.g. 16,12,1024,64;4,12,4096,64")
    args = parser.parse_args()
    # the TMA switch's device-side descriptors need global scratch
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    print(f"{'shape':<22}{'kernel':<11}{'switch':<14}{'tile':<16}TFLOP/s base/variant per round, ratio")
    rows = []
    for shape in shapes:
        rows += study(shape)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("STABLEFLASH_COMMIT"),
                "timing": "do_bench_cudagraph median, forward only, causal bf16, same tile for base and variant"}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
