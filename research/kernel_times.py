"""Device time per kernel of one forward+backward, grouped-query attention against MHA at the same FLOPs.

Where does GQA's extra time go? torch.profiler's CUDA time per kernel name, summed over the timed calls and divided
by them, for each layout (k and v of H or H / group heads), after a warm-up call that compiles and autotunes:

    python research/kernel_times.py --out OUT.json [--shape 16,12,1024,64] [--group 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from stableflash import flash_attention


def kernel_times(B, H, T, D, group: int, calls: int) -> dict[str, float]:
    """Microseconds per call of each CUDA kernel in the causal bf16 forward+backward."""
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H // group, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)

    def step():
        flash_attention(q, k, v, backend="triton").backward(dout)

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
    parser.add_argument("--shape", default="16,12,1024,64")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    runs = {f"group {g}": kernel_times(*shape, g, args.calls) for g in (1, args.group)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"shape": shape, "calls": args.calls, "us_per_call": runs}, indent=2))
    names = sorted({n for r in runs.values() for n in r}, key=lambda n: -max(r.get(n, 0) for r in runs.values()))
    print(f"{'kernel':<48}" + "".join(f"{k:>12}" for k in runs) + "   µs per call, " + str(shape))
    for name in names:
        print(f"{name[:47]:<48}" + "".join(f"{r.get(name, 0):>12.1f}" for r in runs.values()))


if __name__ == "__main__":
    main()
