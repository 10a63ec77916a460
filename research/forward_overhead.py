"""The forwards' cost per program against their cost per key tile: causal bf16 forwards at equal FLOPs, rising T.

A causal forward of 128-row query tiles and 128-key tiles visits n(n + 1) / 2 tile pairs ("units") per head in n
programs (n = T / 128). If its time is a cost per unit and a cost per program, then the time per unit is
a + b · 2 / (n + 1), a line in x = 2 / (n + 1); b / a is one program's cost in key tiles. At B·H·T² fixed the FLOPs
are the same at every T, and only x changes. Arms: the Gluon forward at every T (its tile's shortest T set to 1),
the Triton forward (`hopper_forward=False`, autotuned), each plain and with SFA, and cuDNN's forward; each timed
from a CUDA graph, in rounds whose arm order rotates:

    python research/forward_overhead.py --out OUT.json [--rounds 3] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import triton
from baselines import cudnn_causal  # research/baselines.py: the script's own folder is on sys.path

from stableflash import SFA, flash_attention
from stableflash.attention.triton import hopper, kernel_options
from stableflash.attention.triton.tuning import TILE_PICKS

# (B, H, T): B·H·T² = 2^29 at every T
SHAPES = ((128, 16, 512), (32, 16, 1024), (8, 16, 2048), (2, 16, 4096), (1, 8, 8192))
UNIT = 128  # rows and keys of the block unit the fit counts


def units(B: int, H: int, T: int) -> int:
    n = T // UNIT
    return B * H * n * (n + 1) // 2


def program_share(T: int) -> float:
    """x = programs per unit: 2 / (n + 1)."""
    return 2 / (T // UNIT + 1)


def fit(xs, ys) -> dict:
    """Least squares of y = a + b x; b / a in units, and each point's residual relative to its y."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    residuals = [float((y - (a + b * x)) / y) for x, y in zip(xs, ys)]
    return {"a_us": float(a), "b_us": float(b), "b_over_a": float(b / a), "residuals": residuals}


# the Gluon forward's table with every tile's shortest T set to 1
GLUON_EVERYWHERE = {key: choice and choice._replace(min_seq_len=1) for key, choice in hopper.FORWARD_TILES.items()}


def arms():
    def ours(gluon: bool, stabilize):
        def run(q, k, v):
            with (mock.patch.object(hopper, "FORWARD_TILES", GLUON_EVERYWHERE) if gluon else contextlib.nullcontext(),
                  kernel_options(hopper_forward=gluon)):
                return flash_attention(q, k, v, backend="triton", layout="bhtd", causal=True, stabilize=stabilize)
        return run

    return {"gluon": ours(True, None), "gluon-sfa": ours(True, SFA()), "triton": ours(False, None),
            "triton-sfa": ours(False, SFA()), "cudnn": cudnn_causal}


def time_forward(run, B: int, H: int, T: int, D: int) -> float:
    """Median µs of one forward replayed from a CUDA graph, after a call that compiles and autotunes."""
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        run(q, k, v)
        return 1e3 * triton.testing.do_bench_cudagraph(lambda: run(q, k, v), rep=100, return_mode="median")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    runs = arms()
    names = list(runs)
    times = {name: {str(T): [] for _, _, T in SHAPES} for name in names}
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "head_dim": args.head_dim,
              "shapes": [list(s) for s in SHAPES], "units": {str(T): units(B, H, T) for B, H, T in SHAPES},
              "times_us": times}
    start = time.time()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for B, H, T in SHAPES:
            for name in order:
                times[name][str(T)].append(time_forward(runs[name], B, H, T, args.head_dim))
        print(f"round {r + 1}: {time.time() - start:.0f} s", flush=True)
        _summarise(report)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))  # after every round: a call cut short keeps its rounds


def _summarise(report: dict) -> None:
    """Per arm: µs per unit at each T (median over rounds), the fit, and each arm's time over cuDNN's."""
    Ts = [str(T) for _, _, T in SHAPES]
    per_unit = {name: [float(np.median(t[T])) / report["units"][T] for T in Ts] for name, t in report["times_us"].items()}
    xs = [program_share(int(T)) for T in Ts]
    report["per_unit_us"] = per_unit
    report["fits"] = {name: fit(xs, ys) for name, ys in per_unit.items()}
    report["picks"] = TILE_PICKS.state_dict()
    print(f"{'arm':<11}" + "".join(f"{'T=' + T:>9}" for T in Ts) + f"{'a':>9}{'b':>9}{'b/a':>7}  max residual")
    for name, ys in per_unit.items():
        f = report["fits"][name]
        print(f"{name:<11}" + "".join(f"{y * 1e3:>9.2f}" for y in ys) + f"{f['a_us'] * 1e3:>9.2f}{f['b_us'] * 1e3:>9.2f}"
              f"{f['b_over_a']:>7.2f}  {max(abs(e) for e in f['residuals']):.1%}   (ns per unit)")
    cudnn = per_unit["cudnn"]
    for name, ys in per_unit.items():
        print(f"{name:<11}" + "".join(f"{y / c:>9.2f}" for y, c in zip(ys, cudnn)) + "   (time over cuDNN's)")


if __name__ == "__main__":
    main()
