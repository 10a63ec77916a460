"""Host time per eager attention call: where the small shapes' eager figures go that a CUDA graph does not see.

At (16,12,1024,64) a forward+backward takes ~0.4 ms of GPU time, and the eager benchmark has read 0.49-0.79 ms for
the same kernels in different processes. For each implementation this measures, at one shape: the host time of a
forward and of a forward+backward (the queue drained before each call, so the host never waits for the GPU), the
eager time as `benchmarks/attention.py` takes it (`do_bench`) and the device time from a CUDA graph; ours twice, with
eager calls replayed from plans (as shipped) and through the launchers every call (`-launchers`, with
`replay.EagerPlans.enabled` off): the A/B of `attention/triton/replay.py` in one process. It also times the autograd
engine alone (a backward through one Python `autograd.Function` against one built-in op, on a 1-element
CUDA tensor) and profiles our forward+backward's Python (cProfile, by own time).

    python benchmarks/host_overhead.py --out results/host-overhead/host-overhead-h200.json [--pin-cpu 3]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import attention  # benchmarks/attention.py: this script's directory is on sys.path
import torch
import triton
from attention_tiles import IdentityFunction
from feature_cost import IMPLS  # the same four calls as the cost study

from stableflash.attention.triton import ops
from stableflash.benchmarking import parse_shapes, run_meta


def implementations(num_heads: int) -> dict:
    """The eager calls of `benchmarks/attention.py` that this study compares."""
    impls = attention.implementations(num_heads)
    return {name: impls[name] for name in IMPLS}


def host_us(call, repeats: int) -> float:
    """Median host microseconds of `call()`, the GPU queue drained before each (so no call waits for the GPU)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def engine_us(repeats: int) -> dict:
    """The autograd engine's own cost per backward on CUDA: through a Python node and through a built-in one."""
    x = torch.ones(1, device="cuda", requires_grad=True)
    return {"python_node_backward_us": host_us(lambda: IdentityFunction.apply(x).sum().backward(), repeats),
            "builtin_node_backward_us": host_us(lambda: (x * 1.0).sum().backward(), repeats)}


def profile_top(call, repeats: int, top: int) -> list[dict]:
    """The functions with most own time over `repeats` calls (cProfile), per call."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = [{"function": f"{os.path.basename(file)}:{line}({name})", "calls_per_call": calls / repeats,
             "own_us_per_call": own / repeats * 1e6, "cumulative_us_per_call": cumulative / repeats * 1e6}
            for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items()]
    return sorted(rows, key=lambda r: -r["own_us_per_call"])[:top]


def measure(name: str, fn, shape: tuple[int, ...], repeats: int) -> dict:
    """One implementation's row at one shape (its calls compiled and autotuned first)."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwdbwd():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(dout)

    fwdbwd()
    row = {"shape": list(shape), "impl": name,
           "fwd_host_us": host_us(fwd, repeats), "fwdbwd_host_us": host_us(fwdbwd, repeats),
           "fwdbwd_eager_us": 1e3 * triton.testing.do_bench(fwdbwd, warmup=25, rep=200, return_mode="median"),
           "fwdbwd_graph_us": 1e3 * triton.testing.do_bench_cudagraph(fwdbwd, rep=200, return_mode="median")}
    if name.startswith("stableflash"):
        row["profile"] = profile_top(fwdbwd, repeats, 12)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None, help='"B,H,T,D;..." (default 16,12,1024,64)')
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--pin-cpu", type=int, default=None, help="run on this one CPU core (before any thread starts)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.pin_cpu is not None:
        os.sched_setaffinity(0, {args.pin_cpu})
    rows = []
    for shape in parse_shapes(args.shapes, [(16, 12, 1024, 64)]):
        runs = [(name, fn, replayed) for name, fn in implementations(shape[1]).items()
                for replayed in ((True, False) if name.startswith("stableflash") else (True,))]
        for name, fn, replayed in runs:
            name = name if replayed else f"{name}-launchers"
            with ops._eager_plans.switched(replayed):
                row = measure(name, fn, shape, args.repeats)
            rows.append(row)
            print(f"{str(shape):<20}{name:<34}fwd host {row['fwd_host_us']:7.1f} us   fwd+bwd host "
                  f"{row['fwdbwd_host_us']:7.1f} us   eager {row['fwdbwd_eager_us']:7.1f} us   graph "
                  f"{row['fwdbwd_graph_us']:7.1f} us")
    engine = engine_us(args.repeats)
    print(f"autograd engine, 1-element CUDA backward: Python node {engine['python_node_backward_us']:.1f} us, "
          f"built-in node {engine['builtin_node_backward_us']:.1f} us")
    for row in rows:
        if "profile" in row:
            print(f"\n{row['impl']}: most own time per forward+backward (cProfile; its own overhead included)")
            for p in row["profile"]:
                print(f"  {p['own_us_per_call']:7.1f} us own {p['cumulative_us_per_call']:8.1f} us cum "
                      f"{p['calls_per_call']:5.1f}x  {p['function']}")
    if args.out:
        meta = run_meta() | {"pinned_cpu": args.pin_cpu, "cpus": len(os.sched_getaffinity(0)), "repeats": args.repeats,
                             "host_us": "median perf_counter time of the call, the GPU queue drained before each",
                             "eager_us": "do_bench median (as benchmarks/attention.py), L2 cleared before each call",
                             "graph_us": "do_bench_cudagraph median: device time only"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "engine": engine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
