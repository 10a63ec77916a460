"""Gradient error of each δ formula against fp64, per preset and logit scale (CPU, random inputs).

Why the isolation's δ experiments blow the `bf16` preset up: see RESULTS.md "Reproduction status".

    python research/delta_formula_errors.py --out results/delta-formulas/delta-formulas-cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from stableflash.attention import flash_attention
from stableflash.attention.precision import DELTA_FORMULAS, resolve


def gradients(q, k, v, dout, precision, dtype):
    leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=True, backend="reference", precision=precision)
    out.backward(dout.to(dtype))
    return [t.grad.double() for t in leaves]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="2,4,256,64", help="B,H,T,D")
    args = parser.parse_args()
    B, H, T, D = map(int, args.shape.split(","))
    torch.manual_seed(0)
    rows = []
    for logit_scale in (1.0, 8.0, 30.0):  # q and k scaled by sqrt(logit_scale): logits ~ logit_scale x N(0,1)
        q, k = (torch.randn(B, H, T, D, dtype=torch.float64) * logit_scale ** 0.5 for _ in range(2))
        v, dout = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(2))
        exact = gradients(q, k, v, dout, "fp64", torch.float64)
        for preset in ("bf16", "paper", "fa2"):
            for formula in DELTA_FORMULAS:
                got = gradients(q, k, v, dout, resolve(preset).with_delta(formula), torch.bfloat16)
                row = {"logit_scale": logit_scale, "preset": preset, "delta": formula}
                for name, g, e in zip(("dq", "dk", "dv"), got, exact):
                    row[f"{name}_rel_err"] = ((g - e).norm() / e.norm()).item()
                    row[f"{name}_along_exact"] = ((g - e) * e).sum().item() / e.norm().item() ** 2  # < 0: shrunk
                rows.append(row)
                print(f"logits x{logit_scale:<4} {preset:5} {formula:16} dQ err {row['dq_rel_err']:.4f} "
                      f"dK err {row['dk_rel_err']:.4f} dQ along exact {row['dq_along_exact']:+.4f}")
    args.out.write_text(json.dumps({"shape": [B, H, T, D], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
