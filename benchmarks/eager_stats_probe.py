"""Eager forward+backward at (16,12,1024,64), SFA with and without statistics, replayed and through the launchers.

Why the eager statistics read slower than their device time: for each setting, over interleaved rounds, the eager
time as `benchmarks/attention.py` takes it (`do_bench`), the host time of one call (queue drained first) and the
time per call of 200 back-to-back calls; then a torch.profiler table and Chrome trace of 20 calls each (host ops,
allocations and launches by thread, next to the kernels' device times).

    python benchmarks/eager_stats_probe.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import attention  # benchmarks/attention.py: this script's directory is on sys.path
import torch
import triton
from host_overhead import host_us
from torch.profiler import ProfilerActivity, profile

from stableflash.attention.triton import ops
from stableflash.benchmarking import run_meta

SHAPE = (16, 12, 1024, 64)
NAMES = ("stableflash-sfa", "stableflash-sfa-stats")


def inputs():
    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)


def timings(fn) -> dict:
    q, k, v, dout = inputs()

    def fwdbwd():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(dout)

    fwdbwd()
    eager_ms = triton.testing.do_bench(fwdbwd, warmup=25, rep=200, return_mode="median")
    host = host_us(fwdbwd, 100)
    start = time.perf_counter()
    for _ in range(200):
        fwdbwd()
    torch.cuda.synchronize()
    return {"eager_us": eager_ms * 1e3, "host_us": host,
            "back_to_back_us": (time.perf_counter() - start) / 200 * 1e6}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    impls = attention.implementations(SHAPE[1])
    samples: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name in NAMES:
            for replayed in (True, False):
                with ops._eager_plans.switched(replayed):
                    samples.setdefault(name + ("" if replayed else "-launchers"), []).append(timings(impls[name]))
    for tag, rounds in samples.items():
        print(f"{tag:<34}" + "   ".join(f"eager {r['eager_us']:6.1f} host {r['host_us']:6.1f} "
                                         f"back-to-back {r['back_to_back_us']:6.1f}" for r in rounds) + "  (µs)")
    for name in NAMES:
        q, k, v, dout = inputs()
        impls[name](q, k, v).backward(dout)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                q.grad = k.grad = v.grad = None
                impls[name](q, k, v).backward(dout)
            torch.cuda.synchronize()
        print(name)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=50))
        prof.export_chrome_trace(str(args.out / f"trace-{name}.json"))
    (args.out / "eager-stats-probe.json").write_text(json.dumps({"meta": run_meta() | {"shape": SHAPE},
                                                                 "rounds": samples}, indent=1))


if __name__ == "__main__":
    main()
