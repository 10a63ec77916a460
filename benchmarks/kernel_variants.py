"""A/B study of compile-time variants of the fused forward (knobs in `ops._FWD_EXTRA`), each against the same
kernel with the knobs off on the tile the autotuner picked for the latter. Checks every variant's outputs and
counters equal the base's, bit for bit.

Variants: ONES_GUARD (statistics: count P̄ = 1 entries per score only on tiles where some row's second largest
score is near the shift; otherwise one exp2 per row), ORDER 2 (grid (heads, tiles), heaviest causal tiles first).

    python benchmarks/kernel_variants.py --out results/kernel-variants-h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton

from stableflash import SFA
from stableflash.attention.precision import PRESETS
from stableflash.attention.stabilize import cache_key
from stableflash.attention.triton import _kernel_key, ops

SHAPES = [(16, 12, 1024, 64), (4, 12, 4096, 64), (4, 16, 4096, 128)]
SETTINGS = {  # name: (stabilizer, statistics, variants)
    "plain": (None, False, {}),
    "sfa": (SFA(), False, {"order2": {"ORDER": 2}}),
    "sfa-stats": (SFA(), True, {"guard": {"ONES_GUARD": True}, "order2": {"ORDER": 2},
                                "guard+order2": {"ONES_GUARD": True, "ORDER": 2}}),
    "stats": (None, True, {"guard": {"ONES_GUARD": True}}),
}


def study(shape) -> list[dict]:
    B, H, T, D = shape
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * T * T * D / 2
    rows = []
    for setting, (stab, stats, variants) in SETTINGS.items():
        key = _kernel_key(PRESETS["fa2"].cache_key, cache_key(stab), torch.bfloat16, D, T)
        fwd = lambda key=key, stats=stats: ops.forward(q, k, v, True, D ** -0.5, key, stats, 1e-3)  # noqa: E731
        for name, extra in {"base": {}, **variants}.items():
            ops._FWD_EXTRA.clear()
            ops._FWD_EXTRA.update(extra)
            row = {"shape": list(shape), "setting": setting, "variant": name}
            try:
                out = fwd()
                if name == "base":
                    base = out
                    tuned = ops._fwd.best_config
                    row["tile"] = f"{tuned.kwargs['BLOCK_M']}x{tuned.kwargs['BLOCK_N']}/w{tuned.num_warps}"
                else:
                    row["same_bits"] = all(torch.equal(a, b) for a, b in zip(out, base))
                ms = triton.testing.do_bench(fwd, warmup=10, rep=100, return_mode="median")
                row["fwd_tflops"] = flops / (ms * 1e-3) / 1e12
            except Exception as error:  # noqa: BLE001 - a variant that does not compile is a result
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
            rows.append(row)
            print(row, flush=True)
    ops._FWD_EXTRA.clear()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/kernel-variants-h200.json"))
    args = parser.parse_args()
    rows = [row for shape in SHAPES for row in study(shape)]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "timing": "do_bench median on direct launches (the launch cache)",
            "flops": "forward, causal: 4*B*H*T^2*D/2"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{'shape':<20}{'setting':<11}{'variant':<14}{'fwd TFLOP/s':>12}  bits / error")
    for r in rows:
        t = f"{r['fwd_tflops']:12.1f}" if r.get("fwd_tflops") else f"{'-':>12}"
        print(f"{str(r['shape']):<20}{r['setting']:<11}{r['variant']:<14}{t}  {r.get('same_bits', '')}{r.get('error', '')}")


if __name__ == "__main__":
    main()
