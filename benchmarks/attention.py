"""Attention TFLOP/s: our fused kernels against torch SDPA's backends and a plain-PyTorch tiled version.

Causal, bf16. Forward FLOPs 4·B·H·T²·D/2, forward+backward 3.5x that; median of
`triton.testing.do_bench` over fresh random inputs. Prints a table and writes JSON:

    python benchmarks/attention.py --out results/attention-bench/attention-bench-h200.json
    python benchmarks/attention.py --summary results/attention-bench/attention-bench-h200.json   # the ratio table again, no GPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from common import parse_shapes, run_meta  # benchmarks/common.py: the script's own folder is on sys.path
from torch.nn.attention import SDPBackend, sdpa_kernel

from stableflash import SFA, AttentionStats, flash_attention
from stableflash.attention import PV_PATH, resolve
from stableflash.attention import triton as kernels

SHAPES = [(16, 12, 1024, 64), (4, 12, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)]


def _ours(options=None, **kw):
    if options is None:
        return lambda q, k, v: flash_attention(q, k, v, backend="triton", **kw)

    def run(q, k, v):
        with kernels.kernel_options(**options):
            return flash_attention(q, k, v, backend="triton", **kw)
    return run


def _pv_in_e8m4():
    """`paper` with its P̄V path (P̄'s operand, P̄V, the rescaled and the running accumulator) in e8m4."""
    return resolve("paper").with_sites(**{site: "e8m4" for site in PV_PATH})


def _sdpa(backend):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def implementations(num_heads):
    stats = AttentionStats(num_heads)
    return {
        "stableflash": _ours(),
        "stableflash-sfa": _ours(stabilize=SFA()),
        "stableflash-sfa-stats": _ours(stabilize=SFA(), stats=stats),
        "stableflash-paper": _ours(precision="paper"),
        # grouped-query attention (k, v with H / 4 heads, `GROUPED`): the same FLOPs as the MHA rows
        "stableflash-gqa": _ours(),
        "stableflash-sfa-gqa": _ours(stabilize=SFA()),
        # dK/dV of each query head stored and summed over its group afterwards, as flash-attn 2 does
        "stableflash-gqa-shares": _ours(options={"group_sum_in_program": False}),
        "stableflash-sfa-gqa-shares": _ours(options={"group_sum_in_program": False}, stabilize=SFA()),
        # no dQ kernel: the dK/dV programs add dQ with atomics (FA2's backward; not deterministic, so opt-in)
        "stableflash-atomic-dq": _ours(options={"atomic_dq": True}),
        "stableflash-sfa-atomic-dq": _ours(options={"atomic_dq": True}, stabilize=SFA()),
        # the dose-response study's numerics, as a ratio to `paper` (the same emulation kernels, other roundings)
        "stableflash-pv-e8m4": _ours(precision=_pv_in_e8m4()),
        "stableflash-pv-e8m4-tz": _ours(precision=_pv_in_e8m4().with_rounding("toward_zero", PV_PATH)),
        "stableflash-pv-e8m4-sr": _ours(precision=_pv_in_e8m4().with_rounding("stochastic", PV_PATH)),
        "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "torch-tiled-bf16": lambda q, k, v: flash_attention(q, k, v, backend="reference", precision="bf16"),
        # the same preset as stableflash-paper, for the emulation-speed ratio
        "torch-tiled-paper": lambda q, k, v: flash_attention(q, k, v, backend="reference", precision="paper"),
    }


GROUPED = {name: 4 for name in ("stableflash-gqa", "stableflash-sfa-gqa", "stableflash-gqa-shares",
                                 "stableflash-sfa-gqa-shares")}  # query heads per key/value head


def measure(fn, shape, mode: str, group: int = 1) -> float:
    """Median milliseconds of fn on fresh random inputs: forward ("fwd"), forward+backward ("fwdbwd"), or either
    replayed from a CUDA graph ("fwd_graph", "fwdbwd_graph": device time without the host's launch work). With
    `group` > 1, k and v have H / group heads."""
    grad = mode.startswith("fwdbwd")
    B, H, T, D = shape
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k, v = (torch.randn(B, H // group, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
            for _ in range(2))
    if mode == "fwd":
        with torch.no_grad():
            return triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=200, return_mode="median")
    if mode == "fwd_graph":
        with torch.no_grad():
            fn(q, k, v)  # compile and autotune outside the capture
            return triton.testing.do_bench_cudagraph(lambda: fn(q, k, v), rep=200, return_mode="median")
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if mode == "fwdbwd_graph":
        fn(q, k, v).backward(dout)  # compile and autotune outside the capture
        return triton.testing.do_bench_cudagraph(lambda: fn(q, k, v).backward(dout), rep=200, grad_to_none=[q, k, v],
                                                 return_mode="median")
    return triton.testing.do_bench(lambda: fn(q, k, v).backward(dout), warmup=25, rep=200,
                                   grad_to_none=[q, k, v], return_mode="median")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/attention-bench/attention-bench-h200.json"))
    parser.add_argument("--impls", default=None, help="comma-separated subset of the implementations")
    parser.add_argument("--shapes", default=None, help="e.g. 16,12,1024,64;4,12,4096,64")
    parser.add_argument("--summary", type=Path, default=None, help="print the ratio table of this JSON and exit")
    parser.add_argument("--modes", default=None, help="a subset of fwd,fwdbwd,fwd_graph,fwdbwd_graph (default: all)")
    args = parser.parse_args()
    if args.summary is not None:
        print_summary(json.loads(args.summary.read_text())["rows"])
        return
    shapes = parse_shapes(args.shapes, SHAPES)
    rows = []
    meta = run_meta() | {
        "dtype": "bf16", "causal": True, "timing": "triton.testing.do_bench median, warmup 25 ms, rep 200 ms",
        "flops": "fwd 4*B*H*T^2*D/2, fwd+bwd 3.5x",
        "fwd_tflops_cudagraph": "forward replayed from a CUDA graph (do_bench_cudagraph): launch overhead removed",
        "fwdbwd_tflops_cudagraph": "forward+backward replayed from a CUDA graph: device time, no host work",
        # on sm_90 our native forward is the Gluon kernel where `hopper.FORWARD_TILES` has a tile
        "gluon_forward": kernels.options.current().hopper_forward and torch.cuda.get_device_capability() == (9, 0)}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(complete: bool) -> None:
        # after every row, so that a run cut short keeps what it measured; with the autotuner's pick for each
        # launch of our kernels (key: kernel, candidates, T, dtype, switches)
        args.out.write_text(json.dumps({"meta": meta | {"complete": complete}, "rows": rows,
                                        "tile_picks": kernels.tile_picks_state_dict()}, indent=2))

    print(f"{'shape':<22}{'impl':<24}{'fwd':>10}{'fwd+bwd':>10}{'fwd graph':>11}{'f+b graph':>11}   TFLOP/s")
    for shape in shapes:
        B, H, T, D = shape
        fwd_flops = 4 * B * H * T * T * D / 2
        impls = implementations(H)
        for name in (args.impls.split(",") if args.impls else impls):
            row = {"shape": list(shape), "impl": name}
            modes = [("fwd_tflops", "fwd", fwd_flops), ("fwdbwd_tflops", "fwdbwd", 3.5 * fwd_flops)]
            if not name.startswith("torch-tiled"):
                modes += [("fwd_tflops_cudagraph", "fwd_graph", fwd_flops),
                          ("fwdbwd_tflops_cudagraph", "fwdbwd_graph", 3.5 * fwd_flops)]
            for key, mode, flops in modes:
                if args.modes and mode not in args.modes.split(","):
                    row[key] = None
                    continue
                try:
                    ms = measure(impls[name], shape, mode, GROUPED.get(name, 1))
                    row[key] = flops / (ms * 1e-3) / 1e12
                except Exception as error:  # one implementation's failure is its row's (e.g. a refused shape)
                    row[key] = None
                    row.setdefault("error", str(error).splitlines()[0][:200])
                torch.cuda.empty_cache()
            rows.append(row)
            print(f"{str(shape):<22}{name:<24}{_fmt(row['fwd_tflops']):>10}{_fmt(row['fwdbwd_tflops']):>10}"
                  f"{_fmt(row.get('fwd_tflops_cudagraph')):>11}{_fmt(row.get('fwdbwd_tflops_cudagraph')):>11}", flush=True)
            write(complete=False)

    write(complete=True)
    print_summary(rows)


def _fmt(x):
    return "-" if x is None else f"{x:.1f}"


def print_summary(rows):
    """The ratios the issue's targets are stated in, per shape, forward+backward: eager (host work included) and from
    a CUDA graph (device time). Costs are the slowdown against the kernel without the feature, in percent."""
    by = {(tuple(r["shape"]), r["impl"]): r for r in rows}

    def value(shape, impl, key):
        return by.get((shape, impl), {}).get(key)

    def ratio(shape, a, b, key):
        x, y = value(shape, a, key), value(shape, b, key)
        return "-" if x is None or y is None else f"{x / y:.2f}x"

    def cost(shape, with_it, without, key):
        x, y = value(shape, with_it, key), value(shape, without, key)
        return "-" if x is None or y is None else f"{100 * (1 - x / y):.1f}%"

    print(f"\n{'shape':<22}{'timing':<8}{'sfa/fa2':>9}{'sfa/cudnn':>11}{'sfa cost':>10}{'stats cost':>12}{'paper/tiled':>13}"
          f"{'e8m4/paper':>12}{'tz/paper':>10}{'sr/paper':>10}{'gqa/mha':>9}{'sfa gqa/mha':>13}{'shares/mha':>12}"
          f"{'sfa shares/mha':>16}  (fwd+bwd)")
    for shape in dict.fromkeys(tuple(r["shape"]) for r in rows):
        for timing, key in (("eager", "fwdbwd_tflops"), ("graph", "fwdbwd_tflops_cudagraph")):
            # the tiled reference has no graph column: its ratio is eager on both lines
            print(f"{str(shape):<22}{timing:<8}{ratio(shape, 'stableflash-sfa', 'sdpa-flash', key):>9}"
                  f"{ratio(shape, 'stableflash-sfa', 'sdpa-cudnn', key):>11}"
                  f"{cost(shape, 'stableflash-sfa', 'stableflash', key):>10}"
                  f"{cost(shape, 'stableflash-sfa-stats', 'stableflash-sfa', key):>12}"
                  f"{ratio(shape, 'stableflash-paper', 'torch-tiled-paper', 'fwdbwd_tflops'):>13}"
                  f"{ratio(shape, 'stableflash-pv-e8m4', 'stableflash-paper', key):>12}"
                  f"{ratio(shape, 'stableflash-pv-e8m4-tz', 'stableflash-paper', key):>10}"
                  f"{ratio(shape, 'stableflash-pv-e8m4-sr', 'stableflash-paper', key):>10}"
                  f"{ratio(shape, 'stableflash-gqa', 'stableflash', key):>9}"
                  f"{ratio(shape, 'stableflash-sfa-gqa', 'stableflash-sfa', key):>13}"
                  f"{ratio(shape, 'stableflash-gqa-shares', 'stableflash', key):>12}"
                  f"{ratio(shape, 'stableflash-sfa-gqa-shares', 'stableflash-sfa', key):>16}")


if __name__ == "__main__":
    main()
