"""Per-tile timings of the fused kernels: which tile the autotuner picks, and what every candidate costs.

For each shape (causal, bf16): the forward (plain, SFA, SFA + statistics) and the backward under every
candidate tile, one kernel varied at a time with the others at the autotuner's pick; the split of the
backward into its three kernels (torch.profiler); and SDPA's flash backend for scale. Prints a table and
writes JSON:

    python benchmarks/attention_tiles.py --out results/attention-tiles-h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from stableflash import SFA
from stableflash.attention.precision import PRESETS
from stableflash.attention.stabilize import cache_key
from stableflash.attention.triton import _kernel_key, ops
from stableflash.benchmarking import parse_shapes


class IdentityFunction(torch.autograd.Function):
    """The cheapest Python autograd function: what the autograd engine's hand-off costs by itself."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


SHAPES = [(16, 12, 1024, 64), (4, 12, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)]
cfg = ops._cfg
# every tile the kernels accept: forward and dQ need BLOCK_M % BLOCK_N == 0, dK/dV the reverse
FWD = [cfg(128, 64, 4, 3), cfg(128, 64, 8, 3), cfg(128, 128, 8, 3), cfg(64, 64, 4, 3), cfg(128, 32, 4, 3),
       cfg(128, 64, 4, 4)]
DKDV = [cfg(32, 128, 4, 3), cfg(32, 128, 4, 5), cfg(64, 128, 8, 3), cfg(64, 128, 4, 3), cfg(64, 64, 4, 3),
        cfg(32, 64, 4, 3), cfg(64, 128, 8, 2), cfg(32, 128, 8, 3), cfg(64, 64, 8, 3), cfg(32, 64, 4, 5),
        cfg(16, 64, 4, 3), cfg(16, 128, 4, 3), cfg(32, 32, 4, 3), cfg(64, 64, 4, 2)]
DQ = [cfg(128, 32, 4, 3), cfg(128, 32, 4, 5), cfg(128, 64, 8, 3), cfg(128, 64, 4, 3), cfg(64, 64, 4, 3),
      cfg(64, 32, 4, 3), cfg(128, 64, 8, 2), cfg(64, 64, 8, 3), cfg(64, 32, 4, 5), cfg(64, 16, 4, 3),
      cfg(128, 16, 4, 3), cfg(32, 32, 4, 3), cfg(64, 64, 4, 2)]


def name(c) -> str:
    return f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}/w{c.num_warps}/s{c.num_stages}"


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def kernel_split(fn) -> dict[str, float]:
    """Mean device milliseconds per call of each kernel `fn` launches."""
    fn()
    torch.cuda.synchronize()
    reps = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            out[e.key[:40]] = e.device_time_total / 1e3 / reps
    return out


def call_paths(shape) -> dict:
    """Forward+backward milliseconds through each layer of the call path, to find where time goes outside the kernels."""
    from stableflash import flash_attention

    B, H, T, D = shape
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    key = _kernel_key(PRESETS["fa2"].cache_key, None, torch.bfloat16, D, T)
    scale = D ** -0.5

    def direct():
        out, _, lse, _, _ = ops.forward(q, k, v, True, scale, key, False, 0.0)
        ops.backward(dout, q, k, v, out, lse, True, scale, key)

    def single_threaded():
        with torch.autograd.set_multithreading_enabled(False):
            ops.FlashAttention.apply(q, k, v, True, scale, key, False, 0.0, None).backward(dout)

    paths = {
        "python-identity-function+backward": lambda: IdentityFunction.apply(q).backward(dout),
        "ops.forward+ops.backward": direct,
        "FlashAttention.apply+backward, engine on the calling thread": single_threaded,
        "FlashAttention.apply+backward": lambda: ops.FlashAttention.apply(q, k, v, True, scale, key, False, 0.0, None)
        .backward(dout),
        "flash_attention+backward": lambda: flash_attention(q, k, v, backend="triton").backward(dout),
        "flash_attention(sfa)+backward": lambda: flash_attention(q, k, v, backend="triton", stabilize=SFA())
        .backward(dout),
        "sdpa-flash+backward": lambda: _sdpa_flash(q, k, v).backward(dout),
    }
    out = {}
    for name_, fn in paths.items():
        out[name_] = triton.testing.do_bench(fn, warmup=10, rep=100, grad_to_none=[q, k, v], return_mode="median")
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        out[name_ + " (host ms, unsynced)"] = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            paths["flash_attention+backward"]()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18), flush=True)
    return out


def _sdpa_flash(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def study(shape):
    B, H, T, D = shape
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = D ** -0.5
    keys = {name_: _kernel_key(PRESETS["fa2"].cache_key, cache_key(stab), torch.bfloat16, D, T)
            for name_, stab in (("plain", None), ("sfa", SFA()))}
    flops = 4 * B * H * T * T * D / 2
    tf = lambda ms, mult=1.0: mult * flops / (ms * 1e-3) / 1e12  # noqa: E731
    row = {"shape": list(shape)}

    # autotuned picks of the pointer-load path (run once so the autotuners have chosen; at D >= 128 the kernels as
    # they ship also try TMA per tile: benchmarks/kernel_switches.py times that switch)
    out, _, lse, _, _ = ops.forward(q, k, v, True, scale, keys["plain"], False, 0.0, TMA=False)
    ops.backward(dout, q, k, v, out, lse, True, scale, keys["plain"], TMA=False)
    pick = {}
    for kname, tuned in (("fwd", ops._fwd), ("dkdv", ops._dkdv), ("dq", ops._dq)):
        pick[kname] = name(tuned.best_config) if tuned.best_config is not None else None
    row["autotuned"] = pick
    best_dkdv, best_dq = ops._dkdv.best_config, ops._dq.best_config

    fwd = {}
    for c in FWD:
        if D >= 128 and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 128 * 64 and c.num_warps < 8:
            continue
        entry = {}
        for variant, key, stats in (("plain", keys["plain"], False), ("sfa", keys["sfa"], False),
                                    ("sfa_stats", keys["sfa"], True)):
            try:
                ms = bench(lambda key=key, stats=stats, c=c: ops.forward(q, k, v, True, scale, key, stats, 0.0, tile=c))
                entry[variant] = tf(ms)
            except Exception as error:  # noqa: BLE001 - a tile that does not compile (shared memory) is a result
                entry[variant] = None
                entry["error"] = str(error).splitlines()[0][:120]
        fwd[name(c)] = entry
    row["fwd_tflops"] = fwd

    bwd_flops_mult = 2.5

    def backward_by_tile(configs, tiles):
        """Backward TFLOP/s with each of `configs` in the place `tiles(c)` puts it (the other kernel at its pick)."""
        timed = {}
        for c in configs:
            try:
                timed[name(c)] = tf(bench(lambda c=c: ops.backward(dout, q, k, v, out, lse, True, scale, keys["plain"],
                                                                   tiles=tiles(c))), bwd_flops_mult)
            except Exception as error:  # noqa: BLE001 - a tile that does not compile is a result
                timed[name(c)] = str(error).splitlines()[0][:120]
        return timed

    row["bwd_tflops_by_dkdv_tile"] = backward_by_tile(DKDV, lambda c: (c, best_dq))
    row["bwd_tflops_by_dq_tile"] = backward_by_tile(DQ, lambda c: (best_dkdv, c))
    row["bwd_tflops_autotuned"] = tf(bench(lambda: ops.backward(dout, q, k, v, out, lse, True, scale, keys["plain"])),
                                     bwd_flops_mult)
    row["bwd_split_ms"] = kernel_split(lambda: ops.backward(dout, q, k, v, out, lse, True, scale, keys["plain"]))

    # SDPA flash backward alone, for scale
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        row["sdpa_flash_bwd_tflops"] = tf(bench(lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)),
                                          bwd_flops_mult)
        row["sdpa_flash_bwd_split_ms"] = kernel_split(
            lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/attention-tiles-h200.json"))
    parser.add_argument("--shapes", default=None, help="e.g. 16,12,1024,64;4,12,4096,64")
    parser.add_argument("--parts", default="paths,tiles",
                        help="comma-separated: paths (call-path layers), tiles (every candidate tile)")
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes, SHAPES)
    parts = set(args.parts.split(","))
    rows = []
    for shape in shapes:
        t0 = time.time()
        row = study(shape) if "tiles" in parts else {"shape": list(shape)}
        if "paths" in parts:
            row["fwdbwd_ms_by_path"] = paths = call_paths(shape)
            print(f"== {shape} fwd+bwd ms by call path: " + ", ".join(f"{k} {v:.3f}" for k, v in paths.items()),
                  flush=True)
        rows.append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                 "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")},
                                        "rows": rows}, indent=1))
        if "tiles" in parts:
            print_tiles(row, time.time() - t0)


def print_tiles(row, seconds):
    print(f"\n== {tuple(row['shape'])}  ({seconds:.0f} s)  autotuned {row['autotuned']}")
    print("fwd TFLOP/s plain/sfa/sfa+stats  " + "  ".join(
        f"{k}: " + "/".join("-" if x is None else f"{x:.0f}" for x in (e.get("plain"), e.get("sfa"), e.get("sfa_stats")))
        for k, e in row["fwd_tflops"].items()))
    print("bwd TFLOP/s by dK/dV tile  " + "  ".join(f"{k}: {_f(x)}" for k, x in row["bwd_tflops_by_dkdv_tile"].items()))
    print("bwd TFLOP/s by dQ tile  " + "  ".join(f"{k}: {_f(x)}" for k, x in row["bwd_tflops_by_dq_tile"].items()))
    print(f"bwd autotuned {row['bwd_tflops_autotuned']:.0f} TFLOP/s vs sdpa flash {row['sdpa_flash_bwd_tflops']:.0f};"
          f" split (ms) ours {_split(row['bwd_split_ms'])} | sdpa {_split(row['sdpa_flash_bwd_split_ms'])}", flush=True)

def _f(x):
    return f"{x:.0f}" if isinstance(x, float) else "err"


def _split(d):
    return ", ".join(f"{k.split('(')[0][:24]} {v:.3f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:4])


if __name__ == "__main__":
    main()
