"""Why a forward+backward reads slower eagerly than from a CUDA graph: the L2 flush, idle GPU, or slower kernels.

For SFA (the fused kernels) and cuDNN at one shape, a causal bf16 forward+backward is timed four ways in one
process: `do_bench` (L2 cleared before each call: the attention benchmark's eager column), a loop of CUDA events
with L2 cleared before each call, the same loop with L2 kept, and `do_bench_cudagraph`. Then a few eager calls are
profiled: per call, the kernels' summed device time, and the span from the first kernel's start to the last one's
end, each call profiled on its own (the span less the sum is the GPU idle between kernels):

    python research/eager_gap.py --out OUT.json [--shape 1,16,16384,128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import triton
from baselines import cudnn_causal  # research/baselines.py: the script's own folder is on sys.path
from torch.profiler import ProfilerActivity, profile

from stableflash import SFA, flash_attention

L2_FLUSH_BYTES = 256 * 2**20  # what `do_bench` zeroes between calls


def arms():
    def sfa(q, k, v):
        return flash_attention(q, k, v, backend="triton", layout="bhtd", stabilize=SFA())

    return {"SFA": sfa, "cuDNN": cudnn_causal}


def event_loop_ms(step, leaves, calls: int, flush: torch.Tensor | None) -> float:
    """Median ms of `step()` between two CUDA events, L2 cleared before each call when `flush` is given."""
    times = []
    for _ in range(calls):
        for x in leaves:
            x.grad = None
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()  # one call at a time: each call's timing starts with the GPU idle and L2 as set
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profiled_calls(step, leaves, calls: int) -> list[dict]:
    """Per eager call, each profiled on its own: the kernels' count, summed device time and span (first start to
    last end), µs."""
    out = []
    for _ in range(calls):
        for x in leaves:
            x.grad = None
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text())["traceEvents"]
        out.append(call_summary([(e["ts"], e["dur"]) for e in events if e.get("cat") == "kernel"]))
    return out


def call_summary(kernels: list[tuple[float, float]]) -> dict:
    """One call's kernels (start, duration): their count, summed time and span."""
    kernels = sorted(kernels)
    return {"kernels": len(kernels), "busy_us": sum(d for _, d in kernels),
            "span_us": max(t + d for t, d in kernels) - kernels[0][0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="1,16,16384,128", help="B,H,T,D")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    B, H, T, D = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": [B, H, T, D], "arms": {}}
    for name, attend in arms().items():
        def step(a=attend):
            a(q, k, v).backward(dout)
        step()  # compile and autotune
        ms = {"do_bench": triton.testing.do_bench(step, warmup=25, rep=200, grad_to_none=[q, k, v],
                                                  return_mode="median"),
              "events_l2_cleared": event_loop_ms(step, (q, k, v), args.calls, flush),
              "events_l2_kept": event_loop_ms(step, (q, k, v), args.calls, None),
              "graph": triton.testing.do_bench_cudagraph(step, rep=200, grad_to_none=[q, k, v], return_mode="median")}
        calls = profiled_calls(step, (q, k, v), 5)
        report["arms"][name] = {"ms": ms, "profiled_calls": calls}
        busy = statistics.median(c["busy_us"] for c in calls) / 1e3
        span = statistics.median(c["span_us"] for c in calls) / 1e3
        print(f"{name:<6}" + "".join(f"  {key} {value:.3f}" for key, value in ms.items())
              + f"  | profiled: kernels {calls[0]['kernels']}, busy {busy:.3f}, span {span:.3f} (ms)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
