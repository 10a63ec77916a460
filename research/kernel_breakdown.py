"""Where a causal bf16 forward+backward spends its device time, per kernel: ours against cuDNN's.

For each shape, torch.profiler's CUDA time per kernel (µs per call, after a warm-up call that compiles and
autotunes) of `fa2`, SFA, SFA + statistics (the fused kernels) and SDPA's cuDNN backend, each kernel named in one of
four parts: forward, dQ (with δ: our dQ kernel writes it), dK/dV (cuDNN: its one fused backward kernel, dQ
by atomics included; ours too with `KernelOptions(atomic_dq=True)`), and other (preprocessing, dQ conversion, fills,
sums):

    python research/kernel_breakdown.py --out OUT.json [--shapes "16,12,1024,64;8,32,2048,128"]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from baselines import cudnn_causal  # research/baselines.py: the script's own folder is on sys.path
from kernel_times import profiled  # research/kernel_times.py

from stableflash import SFA, AttentionStats, flash_attention
from stableflash.attention.triton import kernel_options

SHAPES = "16,12,1024,64;4,12,4096,64;4,16,4096,128;8,32,2048,128;1,16,16384,128"
PARTS = ("forward", "dQ", "dK/dV", "other")


def part_of(kernel: str) -> str:
    name = kernel.lower()
    if "attn_fwd" in name or "fprop" in name or "fwd" in name:
        return "forward"
    if "dkdv" in name or "dk_dv" in name or "bprop" in name:  # cuDNN: one fused backward kernel
        return "dK/dV"
    if "bwd_dq" in name or "dq" in name:
        return "dQ"
    return "other"


def implementations(H: int):
    stats = AttentionStats(H, eps=SFA().eps)
    ours = {"fa2": {}, "SFA": {"stabilize": SFA()}, "SFA + stats": {"stabilize": SFA(), "stats": stats}}
    runs = {name: (lambda q, k, v, o=options: flash_attention(q, k, v, backend="triton", layout="bhtd", **o))
            for name, options in ours.items()}

    def atomic_dq(q, k, v):  # SFA without the dQ kernel: dQ added by the dK/dV programs (`KernelOptions.atomic_dq`)
        with kernel_options(atomic_dq=True):
            return flash_attention(q, k, v, backend="triton", layout="bhtd", stabilize=SFA())
    runs["SFA, dQ by atomics"] = atomic_dq

    return {**runs, "cuDNN": cudnn_causal}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=SHAPES, help="B,H,T,D;B,H,T,D...")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    report = {"calls": args.calls, "shapes": {}}
    for text in args.shapes.split(";"):
        B, H, T, D = (int(x) for x in text.split(","))
        g = torch.Generator("cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
                   .requires_grad_() for _ in range(3))  # a model's heads: (B, T, H, D) in memory
        dout = torch.randn_like(q)
        runs = {}
        for name, attend in implementations(H).items():
            runs[name] = profiled(lambda a=attend, q=q, k=k, v=v, g=dout: a(q, k, v).backward(g), args.calls)
        parts = {name: {part: sum(t for kernel, t in r.items() if part_of(kernel) == part) for part in PARTS}
                 for name, r in runs.items()}
        report["shapes"][text] = {"kernels": runs, "parts": parts}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))  # after every shape: a call cut short keeps what it measured
        print(f"\n{text}: µs per causal forward+backward" + "".join(f"{p:>10}" for p in (*PARTS, "total")))
        for name, p in parts.items():
            ratio = sum(p.values()) / sum(parts["cuDNN"].values())
            print(f"{name:<14}" + " " * 28 + "".join(f"{p[part]:>10.1f}" for part in PARTS)
                  + f"{sum(p.values()):>10.1f}  ({ratio:.2f}x cuDNN's time)", flush=True)


if __name__ == "__main__":
    main()
