"""The host's time for one eager attention call, our Python alone, on a machine without a GPU: two trees compared.

Each call goes through the public `flash_attention` with `backend="triton"` on CPU tensors dressed as CUDA ones, with
autotuning off. With `--launches stood-in` (the default) Triton's launches are stood in for (`launch._launch`, the
one function every launch goes through), so what is timed is the package's Python and torch's operator and autograd
layers. With `--launches triton` Triton's own launch path runs too (its argument binder, kernel cache and launcher
lookup, through a stand-in driver whose launcher launches nothing: the kernels compile for sm_90 on first use), so
the difference between the two is Triton's Python per launch. Neither has the driver's own launch, nor the autograd
engine's hand-off to its CUDA thread. Both trees run in child processes, interleaved round by round; a tree is a
folder holding `stableflash/` (`git archive REV stableflash | tar -x -C DIR`).

    python research/host_time.py --before DIR [--after .] --out OUT.json [--rounds 7] [--launches triton]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CALLS = ("fa2", "sfa", "sfa-stats")
SHAPE = (1, 2, 64, 64)  # small: the stood-in launches make the size matter only through allocations


def stand_in_driver() -> None:
    """Triton's launch path without a GPU: a driver for an sm_90 device whose kernels load as nothing and whose
    launcher launches nothing, so that Triton's binder, kernel cache and launcher lookup run as on the GPU."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class NoLaunch:
        def __init__(self, src, metadata):
            pass

        def __call__(self, *args):
            pass

    class Utils:
        def load_binary(self, name, kernel, shared, device):
            return 1, 1, 0, 0, 1024  # module, function, registers, spills, threads

        def get_device_properties(self, device):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    class StandIn:
        utils, launcher_cls = Utils(), NoLaunch

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def map_python_to_cpp_type(self, ty):
            return ty

    driver.set_active(StandIn())


@functools.cache
def _dressed_class():
    """A CPU tensor that says it is on a GPU, with torch's own operators (torch imported here: the parent process
    that runs the children never needs it)."""
    import torch

    class Dressed(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @property
        def is_cuda(self):
            return True

    return Dressed


def dressed_inputs(shape=SHAPE):
    """(q, k, v, dout) from a fixed seed: bf16, q, k and v dressed as GPU tensors and taking gradients."""
    import torch

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.Tensor._make_subclass(_dressed_class(), torch.randn(shape, generator=generator,
                                                                         dtype=torch.bfloat16), True)
               for _ in range(3))
    return q, k, v, torch.randn(shape, generator=generator, dtype=torch.bfloat16)


def without_gpu(launches: str = "stood-in") -> None:
    """Let the package's Triton route run here: its launches stood in for (or Triton's launch path through
    `stand_in_driver`), autotuning off, and the route taken for the dressed tensors."""
    import stableflash.attention.api as api
    from stableflash.attention.triton import launch, set_kernel_options

    if launches == "triton":
        stand_in_driver()
    else:
        launch._launch = lambda *args, **kwargs: None
    set_kernel_options(autotune=False)
    api._HAS_TRITON = True
    api.triton_available = lambda q: True


def timed(step, repeats: int) -> float:
    """Median µs of `step` over `repeats` calls, after a tenth as many untimed."""
    for _ in range(repeats // 10):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(repeats: int, launches: str) -> dict:
    """Median host µs per call in this process's tree: forward+backward, forward alone, backward alone."""
    import torch

    from stableflash import SFA, AttentionStats, flash_attention

    without_gpu(launches)
    q, k, v, dout = dressed_inputs()
    stats = AttentionStats(SHAPE[1])
    calls = {"fa2": lambda: flash_attention(q, k, v, causal=True, backend="triton"),
             "sfa": lambda: flash_attention(q, k, v, causal=True, backend="triton", stabilize=SFA()),
             "sfa-stats": lambda: flash_attention(q, k, v, causal=True, backend="triton", stabilize=SFA(),
                                                  stats=stats)}

    report = {}
    for name, call in calls.items():
        def both(call=call):
            q.grad = k.grad = v.grad = None
            call().backward(dout)

        out = call()
        report[name] = {"fwd_bwd_us": timed(both, repeats), "fwd_us": timed(call, repeats),
                        "bwd_us": timed(lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                        repeats)}
    return report


def run_tree(tree: Path, repeats: int, launches: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, __file__, "--measure", "--repeats", str(repeats), "--launches", launches],
                          env=env, check=True, capture_output=True, text=True, cwd=tree)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="the baseline tree (a folder holding stableflash/)")
    parser.add_argument("--after", type=Path, default=Path("."), help="the tree measured against it (default: .)")
    parser.add_argument("--out", type=Path, help="write the rounds and the summary here as JSON")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=2000, help="calls timed per measurement")
    parser.add_argument("--launches", choices=("stood-in", "triton"), default="stood-in",
                        help="stand in for Triton's launches, or run its launch path with a stand-in driver")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # a child: one tree, one round
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.repeats, args.launches)))
        return
    if args.before is None or args.out is None:
        parser.error("--before and --out are required")
    for tree in (args.before, args.after):
        if not (tree / "stableflash" / "__init__.py").is_file():
            parser.error(f"{tree}: expected a folder holding stableflash/")
    rounds = []
    for i in range(args.rounds):
        rounds.append({"before": run_tree(args.before, args.repeats, args.launches),
                       "after": run_tree(args.after, args.repeats, args.launches)})
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    summary = {}
    print(f"{'call':<10} {'part':<7} {'before µs':>10} {'after µs':>10} {'after/before':>13} {'rounds < 1':>11}")
    for name in CALLS:
        for part in ("fwd_bwd_us", "fwd_us", "bwd_us"):
            before = [r["before"][name][part] for r in rounds]
            after = [r["after"][name][part] for r in rounds]
            ratios = [a / b for a, b in zip(after, before)]
            row = {"before_us": statistics.median(before), "after_us": statistics.median(after),
                   "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                   "rounds_below_1": sum(r < 1 for r in ratios)}
            summary[f"{name}/{part}"] = row
            print(f"{name:<10} {part[:-3]:<7} {row['before_us']:10.1f} {row['after_us']:10.1f} {row['ratio']:13.3f} "
                  f"{row['rounds_below_1']:>7}/{len(ratios)}")
    machine = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "shape": SHAPE, "repeats": args.repeats,
               "launches": args.launches}
    args.out.write_text(json.dumps({"machine": machine, "summary": summary, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
