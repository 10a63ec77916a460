"""The forwards' cost per program against their cost per key tile: causal bf16 forwards at equal FLOPs, rising T.

A causal forward of 128-row query tiles and 128-key tiles visits n(n + 1) / 2 tile pairs ("units") per head in n
programs (n = T / 128). If its time is a cost per unit and a cost per program, then the time per unit is
a + b · 2 / (n + 1), a line in x = 2 / (n + 1); b / a is one program's cost in key tiles. At B·H·T² fixed the FLOPs
are the same at every T, and only x changes. Arms: the Gluon forward at every T (its tile's shortest T set to 1),
the same made persistent (`hopper.Tile.persistent`; first checked bit for bit against it), the Triton forward
(`hopper_forward=False`, autotuned), each plain and with SFA, and cuDNN's forward; each timed from a CUDA graph, in
rounds whose arm order rotates:

    python research/forward_overhead.py --out OUT.json [--rounds 3] [--head-dim 128] [--check first|only|skip]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch
import triton
from baselines import cudnn_causal  # research/baselines.py: the script's own folder is on sys.path

from stableflash import SFA, AttentionStats, flash_attention
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


def _gluon_everywhere(persistent: bool = False):
    """The Gluon forward's table with every tile's shortest T set to 1; with `persistent`, its pingpong tiles made
    persistent."""
    def tile(t):
        return t._replace(persistent=True) if persistent and t.pingpong else t
    return {key: choice and choice._replace(tile=tile(choice.tile), min_seq_len=1)
            for key, choice in hopper.FORWARD_TILES.items()}


SHIPPED = hopper.FORWARD_TILES
TABLES = {"gluon": _gluon_everywhere(), "persistent": _gluon_everywhere(persistent=True)}


@contextlib.contextmanager
def forward_table(table: str | None):
    """The Gluon forward's table `TABLES[table]` inside the block (None: the shipped one), the shipped one after."""
    hopper.FORWARD_TILES = TABLES[table] if table else SHIPPED
    try:
        yield
    finally:
        hopper.FORWARD_TILES = SHIPPED


def arms():
    def ours(table: str | None, stabilize):
        def run(q, k, v):
            with forward_table(table), kernel_options(hopper_forward=table is not None):
                return flash_attention(q, k, v, backend="triton", layout="bhtd", causal=True, stabilize=stabilize)
        return run

    return {"gluon": ours("gluon", None), "gluon-sfa": ours("gluon", SFA()),
            "persistent": ours("persistent", None), "persistent-sfa": ours("persistent", SFA()),
            "triton": ours(None, None), "triton-sfa": ours(None, SFA()), "cudnn": cudnn_causal}


def check_persistent(cases) -> list[dict]:
    """The persistent forward against the pingpong one it reschedules: O, the log-sum-exp and the statistics bit
    for bit, at odd sizes, grouped heads, causal or not, plain, SFA and SFA with statistics."""
    results = []
    for seed, (B, H, G, T, causal) in enumerate(cases):
        g = torch.Generator("cuda").manual_seed(seed)
        q = torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        k, v = (torch.randn(B, T, H // G, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
                for _ in range(2))
        k[:, :, 3] = k[:, :, 5]  # tied keys: rows that repeat their maximum
        for stabilize, stats in ((None, False), (SFA(), False), (SFA(), True)):
            outs = {}
            for table in ("gluon", "persistent"):
                counters = AttentionStats(H, eps=SFA().eps) if stats else None
                with forward_table(table):
                    o, lse = flash_attention(q, k, v, backend="triton", causal=causal, stabilize=stabilize,
                                             stats=counters, return_lse=True)
                outs[table] = (o, lse, counters)
            (o1, l1, s1), (o2, l2, s2) = outs["gluon"], outs["persistent"]
            same = torch.equal(o1, o2) and torch.equal(l1, l2)
            if stats:
                same = same and all(torch.equal(getattr(s1, f), getattr(s2, f))
                                    for f in ("rows", "repeated_max_rows", "pbar_ones", "max_score"))
            results.append({"case": [B, H, G, T, causal], "seed": seed, "sfa": stabilize is not None, "stats": stats,
                            "bit_equal": bool(same)})
    return results


CHECK_CASES = ((2, 3, 1, 333, True), (1, 4, 2, 1000, True), (2, 2, 1, 257, False), (1, 8, 4, 2048, True),
               (3, 5, 1, 128, True), (1, 2, 1, 64, True))


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
    parser.add_argument("--check", choices=("first", "only", "skip"), default="first",
                        help="the persistent forward's bit-for-bit check: before the timing, alone, or not")
    args = parser.parse_args()
    checks = check_persistent(CHECK_CASES) if args.check != "skip" else []
    failed = [c for c in checks if not c["bit_equal"]]
    print(f"persistent against pingpong, bit for bit: {len(checks) - len(failed)} of {len(checks)} equal", flush=True)
    if args.check == "only":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "persistent_checks": checks}, indent=2))
        return
    runs = arms()
    names = list(runs)
    times = {name: {str(T): [] for _, _, T in SHAPES} for name in names}
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "head_dim": args.head_dim, "persistent_checks": checks,
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
