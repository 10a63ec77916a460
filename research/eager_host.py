"""Eager forward+backward at one shape, for the package on PYTHONPATH: the eager, device and host times per call.

For fa2, SFA and SFA with the statistics (the calls of `benchmarks/attention.py`): the eager time as that benchmark
takes it (`do_bench` median), the device time from a CUDA graph, and the host time of one call with the GPU queue
drained first (so the host never waits). Public API only, so the same script measures two versions of the package:

    PYTHONPATH=OLD_TREE python research/eager_host.py --out OLD.json
    python research/eager_host.py --out NEW.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import triton

import stableflash
from stableflash import SFA, AttentionStats, flash_attention


def calls(num_heads: int) -> dict:
    stats = AttentionStats(num_heads)
    return {"fa2": lambda q, k, v: flash_attention(q, k, v, backend="triton"),
            "sfa": lambda q, k, v: flash_attention(q, k, v, backend="triton", stabilize=SFA()),
            "sfa-stats": lambda q, k, v: flash_attention(q, k, v, backend="triton", stabilize=SFA(), stats=stats)}


def host_us(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def measure(fn, shape) -> dict:
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        fn(q, k, v).backward(dout)

    step()  # compile and autotune
    eager = triton.testing.do_bench(step, warmup=25, rep=200, grad_to_none=[q, k, v], return_mode="median")
    graph = triton.testing.do_bench_cudagraph(step, rep=200, grad_to_none=[q, k, v], return_mode="median")
    return {"eager_ms": eager, "graph_ms": graph, "host_us": host_us(step, 200)}


def trace_steps(shape, steps: int) -> None:
    """Where a synced call's host time goes: the forward's and the backward's host time apart (each after draining
    the queue, as `host_us`), then torch.profiler's CPU-side table (CUDA runtime and driver calls included)."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    for name, fn in calls(shape[1]).items():
        def step(fn=fn):
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(q, k, v)
            middle = time.perf_counter()
            torch.cuda.synchronize()
            middle_synced = time.perf_counter()
            out.backward(dout)
            end = time.perf_counter()
            return (middle - start) * 1e6, (end - middle_synced) * 1e6

        for _ in range(20):
            step()
        times = [step() for _ in range(steps)]
        print(f"{name:<10} forward {statistics.median(t[0] for t in times):6.1f} us  "
              f"backward {statistics.median(t[1] for t in times):6.1f} us (host, synced before each)", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)


def section_steps(shape, steps: int) -> None:
    """Host µs per synced call spent in each part of this tree's eager path (wrapped with timers, ~1 µs each; the
    parts a tree lacks are left out): which part a slower host path loses its time in."""
    import importlib

    parts = {}

    def timed(owner, name, label):
        fn = getattr(owner, name, None)
        if fn is None:
            return
        parts[label] = []

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[label].append(time.perf_counter() - start)
        raw = owner.__dict__.get(name) if isinstance(owner, type) else None
        setattr(owner, name, staticmethod(wrapper) if isinstance(raw, staticmethod) else wrapper)

    for module, names in (("stableflash.attention.api", ["flash_attention"]),
                          ("stableflash.attention.triton", ["attention"]),
                          ("stableflash.attention.triton.launch", ["forward", "backward", "_launch_planned",
                                                                  "empty_in_layout_of", "_plan_key", "_launch",
                                                                  "_launch_tuned"]),
                          ("stableflash.attention.triton.ops", [])):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for name in names:
            timed(mod, name, f"{module.rsplit('.', 1)[-1]}.{name}")
    import stableflash.attention.api as api
    ops = importlib.import_module("stableflash.attention.triton.ops")
    if hasattr(ops, "FlashAttention"):
        timed(ops.FlashAttention, "forward", "FlashAttention.forward")
        timed(ops.FlashAttention, "backward", "FlashAttention.backward")
    for module, owner, name in (("stableflash.attention.triton.compiled", "BoundLaunch", "__call__"),
                                ("stableflash.attention.triton.launch", "PLANS", "key"),
                                ("stableflash.attention.triton.replay", "Plan", "replay"),  # the tree before
                                ("stableflash.attention.triton.replay", None, "describe")):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        target = getattr(mod, owner, None) if owner else mod
        if target is not None:
            timed(target, name, f"{owner or module.rsplit('.', 1)[-1]}.{name}")
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    fn = lambda q, k, v: api.flash_attention(q, k, v, backend="triton")  # noqa: E731
    whole = {"forward call": [], "backward call": []}
    for i in range(20 + steps):
        if i == 20:
            for times in (*parts.values(), *whole.values()):
                times.clear()
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(q, k, v)
        whole["forward call"].append(time.perf_counter() - start)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out.backward(dout)
        whole["backward call"].append(time.perf_counter() - start)
    for label, times in (*whole.items(), *parts.items()):
        if times:
            per_call = sum(times) / steps * 1e6
            print(f"{label:<32} {per_call:8.1f} us per step  ({len(times) / steps:.0f} calls)", flush=True)


def profile_steps(shape, steps: int) -> None:
    """Where the host's time goes in the steady state: the queue runs ahead, as in the eager benchmark."""
    import cProfile
    import pstats

    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    fn = calls(shape[1])["fa2"]

    def run(n):
        for _ in range(n):
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(dout)

    run(20)
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(steps)
    torch.cuda.synchronize()
    print(f"{(time.perf_counter() - start) / steps * 1e6:.1f} us per step, unprofiled")
    profiler = cProfile.Profile()
    profiler.enable()
    run(steps)
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def gap_steps(shape, steps: int) -> dict:
    """Where the GPU waits for the host in the eager benchmark's loop, as `do_bench` runs it (its 256 MB L2 flush,
    then one forward+backward from a drained-by-then queue): every GPU operation's start and end from
    torch.profiler's trace, and per operation the median idle time before it (since the previous one ended) and
    its median duration. An idle gap before a kernel is host time on the critical path (the profiler's own
    callbacks add a little to it)."""
    import tempfile

    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    report = {}
    for name, fn in calls(shape[1]).items():
        def step(fn=fn):
            flush.zero_()
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(dout)

        for _ in range(20):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()  # the host's issue time per step: the queue (~1000 entries) never fills here
        for _ in range(steps):
            step()
        host = (time.perf_counter() - start) / steps * 1e6
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as trace:
            prof.export_chrome_trace(trace.name)
            events = json.loads(Path(trace.name).read_text())["traceEvents"]
        ops = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
        idle, busy = {}, {}
        for before, op in zip(ops, ops[1:]):
            label = op["name"].split("(")[0][:40]
            idle.setdefault(label, []).append(op["ts"] - before["ts"] - before["dur"])
            busy.setdefault(label, []).append(op["dur"])
        per_op = {label: {"idle_us": statistics.median(idle[label]), "busy_us": statistics.median(busy[label]),
                          "count": len(idle[label])} for label in idle}
        print(f"{name}: host issue {host:.1f} µs per step; median idle before / duration of each GPU operation, µs, "
              f"over {steps} steps", flush=True)
        for label, row in per_op.items():
            print(f"  {label:<42} idle {row['idle_us']:7.1f}   busy {row['busy_us']:7.1f}   ({row['count']})", flush=True)
        report[name] = {**per_op, "host issue": {"us_per_step": host}}
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="16,12,1024,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="instead: cProfile this many back-to-back fa2 steps (no sync between them), print the top")
    parser.add_argument("--trace", type=int, default=0, metavar="STEPS",
                        help="instead: each call's forward and backward host time apart, and torch.profiler's table")
    parser.add_argument("--sections", type=int, default=0, metavar="STEPS",
                        help="instead: host µs per synced fa2 step in each part of the eager path")
    parser.add_argument("--gaps", type=int, default=0, metavar="STEPS",
                        help="instead: the GPU's idle time before each kernel of the eager benchmark's loop (JSON to --out)")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.trace:
        trace_steps(shape, args.trace)
        return
    if args.sections:
        section_steps(shape, args.sections)
        return
    if args.gaps:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(gap_steps(shape, args.gaps), indent=2))
        return
    if args.profile:
        profile_steps(shape, args.profile)
        return
    B, H, T, D = shape
    flops = 3.5 * 4 * B * H * T * T * D / 2
    rows = []
    for round_ in range(args.rounds):
        for name, fn in calls(H).items():
            row = {"round": round_, "call": name, **measure(fn, shape)}
            row["eager_tflops"], row["graph_tflops"] = (flops / (row[k] * 1e-3) / 1e12 for k in ("eager_ms", "graph_ms"))
            rows.append(row)
            print(f"{round_} {name:<10} eager {row['eager_tflops']:6.1f}  graph {row['graph_tflops']:6.1f} TFLOP/s  "
                  f"host {row['host_us']:6.1f} us", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"package": str(Path(stableflash.__file__).parent), "shape": shape, "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
