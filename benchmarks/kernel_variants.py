"""A/B study of compile-time variants of the fused kernels (knobs in `ops._EXTRA`), each against the same kernel
with the knobs off, on the tile the autotuner picked for the latter; and cuDNN's SDPA for scale.

Variants: ORDER (1: causal query tiles launched heaviest first; 2: grid (heads, tiles), heaviest first) and WS
(`tl.range(warp_specialize=True)` on the unmasked loop). Checks that each variant gives the same bits.

    python benchmarks/kernel_variants.py --out results/kernel-variants-h200.json
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

SHAPES = [(16, 12, 1024, 64), (4, 16, 4096, 128)]
VARIANTS = {"order1": {"ORDER": 1}, "order2": {"ORDER": 2}, "ws": {"WS": True}}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=80, return_mode="median")


def _try(fn):
    try:
        return fn(), None
    except Exception as error:  # noqa: BLE001 - a variant that does not compile is a result
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def study(shape) -> list[dict]:
    B, H, T, D = shape
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = D ** -0.5
    flops = 4 * B * H * T * T * D / 2
    tflops = lambda ms, mult=1.0: mult * flops / (ms * 1e-3) / 1e12  # noqa: E731
    rows = []
    for setting, stab, stats in (("plain", None, False), ("sfa", SFA(), False)):
        key = _kernel_key(PRESETS["fa2"].cache_key, cache_key(stab), torch.bfloat16, D, T)
        for which in ops._EXTRA:
            ops._EXTRA[which] = {}
        fwd = lambda key=key, stats=stats: ops.forward(q, k, v, True, scale, key, stats, 1e-3)  # noqa: E731
        base_out = fwd()
        base_ms = bench(fwd)
        rows.append({"shape": list(shape), "kernel": "fwd", "setting": setting, "variant": "base",
                     "tflops": tflops(base_ms), "tile": _tile(ops._fwd)})
        for name, extra in VARIANTS.items():
            ops._EXTRA["fwd"] = extra
            out, error = _try(fwd)
            row = {"shape": list(shape), "kernel": "fwd", "setting": setting, "variant": name}
            if error is None:
                row.update(tflops=tflops(bench(fwd)), same_bits=all(torch.equal(a, b) for a, b in zip(out, base_out)))
            else:
                row["error"] = error
            rows.append(row)
            print(row, flush=True)
        ops._EXTRA["fwd"] = {}
        if setting != "plain":
            continue
        out, _, lse, _, _ = base_out
        bwd = lambda out=out, lse=lse, key=key: ops.backward(dout, q, k, v, out, lse, True, scale, key)  # noqa: E731
        base_grads = bwd()
        rows.append({"shape": list(shape), "kernel": "bwd", "setting": setting, "variant": "base",
                     "tflops": tflops(bench(bwd), 2.5), "tile": [_tile(ops._dkdv), _tile(ops._dq)]})
        for name, extra in VARIANTS.items():
            for kernels in (("dq",), ("dkdv",)):
                for which in kernels:
                    ops._EXTRA[which] = extra
                grads, error = _try(bwd)
                row = {"shape": list(shape), "kernel": "bwd:" + "+".join(kernels), "setting": setting, "variant": name}
                if error is None:
                    row.update(tflops=tflops(bench(bwd), 2.5),
                               same_bits=all(torch.equal(a, b) for a, b in zip(grads, base_grads)))
                else:
                    row["error"] = error
                rows.append(row)
                print(row, flush=True)
                for which in kernels:
                    ops._EXTRA[which] = {}
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        rows.append({"shape": list(shape), "kernel": "fwd", "setting": "sdpa-cudnn", "variant": "-",
                     "tflops": tflops(bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))})
        rows.append({"shape": list(shape), "kernel": "bwd", "setting": "sdpa-cudnn", "variant": "-",
                     "tflops": tflops(bench(lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)), 2.5)})
    return rows


def _tile(tuned) -> str | None:
    c = tuned.best_config
    return None if c is None else f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}/w{c.num_warps}/s{c.num_stages}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/kernel-variants-h200.json"))
    args = parser.parse_args()
    rows = [row for shape in SHAPES for row in study(shape)]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "timing": "do_bench median (launch cache: little host work)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{'shape':<20}{'kernel':<10}{'setting':<11}{'variant':<11}{'TFLOP/s':>9}  bits / error")
    for r in rows:
        t = f"{r['tflops']:9.1f}" if r.get("tflops") else f"{'-':>9}"
        print(f"{str(r['shape']):<20}{r['kernel']:<10}{r['setting']:<11}{r['variant']:<11}{t}  "
              f"{r.get('same_bits', '')}{r.get('error', '')}")


if __name__ == "__main__":
    main()
