"""Device time per kernel of one forward+backward, grouped-query attention against MHA at the same FLOPs.

Where does GQA's extra time go? torch.profiler's CUDA time per kernel name, summed over the timed calls and divided
by them, for each layout: MHA (k and v of H heads), GQA with the group summed in the dK/dV programs, and GQA with
each query head's share summed afterwards (`KernelOptions(group_sum_in_program=False)`); after a warm-up call that
compiles and autotunes:

    python research/kernel_times.py --out OUT.json [--shapes "16,12,1024,64;4,12,4096,64"] [--group 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from stableflash import flash_attention
from stableflash.attention.triton import kernel_options

SHAPES = "16,12,1024,64;4,12,4096,64;4,16,4096,128;1,16,16384,128"


def kernel_times(B, H, T, D, group: int, calls: int, in_program: bool = True) -> dict[str, float]:
    """Microseconds per call of each CUDA kernel in the causal bf16 forward+backward."""
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H // group, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)

    def step():
        flash_attention(q, k, v, backend="triton").backward(dout)

    with kernel_options(group_sum_in_program=in_program):
        return profiled(step, calls)


def profiled(step, calls: int) -> dict[str, float]:
    """Microseconds per call of each CUDA kernel `step()` launches, after one untimed call (compile, autotune)."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=SHAPES, help="B,H,T,D;B,H,T,D...")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    report = {"group": args.group, "calls": args.calls, "shapes": {}}
    for text in args.shapes.split(";"):
        shape = tuple(int(x) for x in text.split(","))
        runs = {"MHA": kernel_times(*shape, 1, args.calls),
                f"GQA {args.group}, in program": kernel_times(*shape, args.group, args.calls),
                f"GQA {args.group}, shares": kernel_times(*shape, args.group, args.calls, in_program=False)}
        report["shapes"][text] = runs
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))  # after every shape: a call cut short keeps what it measured
        names = sorted({n for r in runs.values() for n in r}, key=lambda n: -max(r.get(n, 0) for r in runs.values()))
        print(f"\n{'kernel':<48}" + "".join(f"{k:>22}" for k in runs) + "   µs per call, " + text)
        for name in names:
            print(f"{name[:47]:<48}" + "".join(f"{r.get(name, 0):>22.1f}" for r in runs.values()))
        print(f"{'total':<48}" + "".join(f"{sum(r.values()):>22.1f}" for r in runs.values()), flush=True)


if __name__ == "__main__":
    main()
