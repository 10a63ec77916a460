"""Host time of our eager attention call's Python, on any machine: the launchers against replayed plans.

The kernels are stand-ins that take a launch's arguments and do nothing, the launch cache always holds one (so no
compile and no GPU), and the tensors are small CPU tensors (allocations cost about what the CUDA caching
allocator's do). What is left is the Python an eager call runs on the host: `autograd.Function`, the launchers
(`ops.forward`, `ops.backward`, `ops._Launches`) or a plan's replay (`replay.EagerPlans`), and the autograd engine
(which on the CPU runs the backward on the calling thread, without the hand-off to a device thread a CUDA backward
pays). Interleaved rounds; the ratio is replay's time over the launchers' in the same round.

    python benchmarks/host_path_cpu.py --out results/host-overhead/host-path-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from stableflash import SFA
from stableflash.attention import precision, stabilize
from stableflash.attention.triton import _kernel_key, ops, replay
from stableflash.benchmarking import run_meta


class StandInKernel:
    """Takes a launch's arguments as Triton's compiled kernels do; runs nothing."""
    function = packed_metadata = None

    class metadata:  # noqa: N801 (as Triton names it)
        global_scratch_size = 0

    def run(self, *args):
        pass


class StandInLaunchCache(dict):
    """`ops._Launches.cache` that holds a stand-in for every key: every launch takes the cached path."""

    def get(self, key, default=None):
        return StandInKernel(), {"BLOCK_M": 128, "BLOCK_N": 64}, ()


def stand_in_gpu() -> None:
    """No CUDA here: the launch cache hits stand-ins and the stream and device queries answer 0 (the replayed path's
    plans take CPU calls: `main`)."""
    ops._launches.cache = StandInLaunchCache()

    class Stream:
        cuda_stream = 0

    torch.cuda.current_stream = lambda device=None: Stream()
    torch.cuda.current_device = lambda: 0


def median_us(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def calls(stabilizer, stats: bool, shape=(1, 2, 64, 64)):
    """A forward (no grad) and a forward+backward through `FlashAttention`, on (B, T, H, D) heads viewed as (B, H, T, D)."""
    B, H, T, D = shape
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3))
    dout = torch.randn_like(q)
    key = _kernel_key(precision.resolve("fa2").cache_key, stabilize.cache_key(stabilizer), q.dtype, D, T)
    targets = ops.fresh_stat_targets(H, q.device) if stats else None
    args = (q, k, v, True, D**-0.5, key, stats, 1e-3 if stats else 0.0, targets)

    def fwd():
        with torch.no_grad():
            ops.FlashAttention.apply(*args)

    def fwdbwd():
        ops.FlashAttention.apply(*args).backward(dout)

    return fwd, fwdbwd


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    stand_in_gpu()
    paths = {"launchers": replay.EagerPlans(ops.ensure_scratch_allocator, enabled=False),
             "replay": replay.EagerPlans(ops.ensure_scratch_allocator, device_types=("cpu",))}
    settings = {"plain": (None, False), "sfa": (SFA(), False), "sfa-stats": (SFA(), True)}
    samples = {(s, p, m): [] for s in settings for p in paths for m in ("fwd", "fwdbwd")}
    for _ in range(args.rounds):
        for setting, (stabilizer, stats) in settings.items():
            for path, plans in paths.items():
                ops._eager_plans = plans
                for mode, call in zip(("fwd", "fwdbwd"), calls(stabilizer, stats)):
                    call()  # plans this signature (replay) before timing
                    samples[setting, path, mode].append(median_us(call, args.repeats))
    rows = []
    print(f"{'setting':<11}{'mode':<8}{'launchers':>11}{'replay':>9}{'replay/launchers':>18}   (median of rounds, µs)")
    for setting in settings:
        for mode in ("fwd", "fwdbwd"):
            launchers, replayed = (samples[setting, p, mode] for p in paths)
            ratios = [r / lnch for r, lnch in zip(replayed, launchers)]
            row = {"setting": setting, "mode": mode, "launchers_us": statistics.median(launchers),
                   "replay_us": statistics.median(replayed), "ratio_median": statistics.median(ratios),
                   "ratio_min": min(ratios), "ratio_max": max(ratios)}
            rows.append(row)
            print(f"{setting:<11}{mode:<8}{row['launchers_us']:11.1f}{row['replay_us']:9.1f}"
                  f"{row['ratio_median']:12.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})")
    if args.out:
        meta = run_meta() | {"rounds": args.rounds, "repeats": args.repeats, "kernels": "stand-ins (no GPU)",
                             "tensors": "CPU, (1, 2, 64, 64) bf16 heads of (B, T, H, D)",
                             "us": "median perf_counter time per call within a round; the median of rounds"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
