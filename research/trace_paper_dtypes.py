"""Trace the dtype of every intermediate of the analysed flash attention under CUDA autocast.

The analysed implementation is a tiled FA2 written in plain PyTorch: O, l and m
live in buffers of the input dtype that each tile updates in place; the forward
runs under `torch.autocast("cuda", dtype=torch.bfloat16)` and the backward (an
autograd.Function backward) outside it. This script re-creates that code, records
the dtype each site's value has, checks whether torch.compile changes the
numbers, and writes a JSON file and a Markdown table.

    python research/trace_paper_dtypes.py --out results/paper-dtypes   # needs CUDA
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

import torch

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


class Recorder:
    def __init__(self):
        self.sites: dict[str, str] = {}

    def __call__(self, site: str, value: torch.Tensor) -> torch.Tensor:
        name = DTYPE_NAMES[value.dtype]
        previous = self.sites.setdefault(site, name)
        if previous != name:
            self.sites[site] = f"{previous}/{name}"
        return value


def noop(site, value):
    return value


def forward(q, k, v, scale, block, rec):
    """The analysed forward: FA2 tiling, O/l/m in input-dtype buffers updated in place."""
    B, H, T, D = q.shape
    o = torch.zeros_like(q)
    l = torch.zeros_like(q[..., :1])
    m = torch.full_like(q[..., :1], -math.inf)
    for i in range(0, T, block):
        qi = q[:, :, i:i + block]
        for j in range(0, i + block, block):  # causal: key tiles up to the diagonal
            kj, vj = k[:, :, j:j + block], v[:, :, j:j + block]
            qk = rec("qk", qi @ kj.transpose(-1, -2))
            s = rec("scores", qk * scale)
            rows = torch.arange(i, i + qi.shape[2], device=q.device)[:, None]
            cols = torch.arange(j, j + kj.shape[2], device=q.device)[None, :]
            s = s.masked_fill(cols > rows, -math.inf)
            tile_max = rec("tile_max", torch.max(s, dim=-1, keepdim=True).values)
            m_old = m[:, :, i:i + block]
            m_new = rec("row_max", torch.maximum(tile_max, m_old))
            shifted = rec("shifted", s - m_new)
            pbar = rec("pbar", torch.exp(shifted))
            tile_sum = rec("tile_sum", torch.clamp(torch.sum(pbar, dim=-1, keepdim=True), min=1e-10))
            pv = rec("pv", pbar @ vj)
            rescale = rec("rescale", torch.exp(m_old - m_new))
            l[:, :, i:i + block] = rec("row_sum_expr", rescale * l[:, :, i:i + block] + tile_sum)
            rec("row_sum", l)
            o[:, :, i:i + block] = rec("acc_expr", o[:, :, i:i + block] * rescale + pv)
            rec("acc", o)
            m[:, :, i:i + block] = m_new
    out = rec("out", o / l)
    lse = rec("lse", torch.log(l) + m)
    return out, lse


def backward(q, k, v, out, lse, dout, scale, block, rec):
    """The analysed backward, outside autocast: matmul operands are cast to the input dtype."""
    B, H, T, D = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = rec("delta", torch.sum(dout * out, dim=-1, keepdim=True))
    for j in range(0, T, block):
        kj, vj = k[:, :, j:j + block], v[:, :, j:j + block]
        for i in range(j, T, block):
            qi, doi = q[:, :, i:i + block], dout[:, :, i:i + block]
            s = rec("bwd_scores", (qi @ kj.transpose(-1, -2)) * scale)
            rows = torch.arange(i, i + qi.shape[2], device=q.device)[:, None]
            cols = torch.arange(j, j + kj.shape[2], device=q.device)[None, :]
            s = s.masked_fill(cols > rows, -math.inf)
            p = rec("p", torch.exp(s - lse[:, :, i:i + block]))
            p_op = rec("p_operand", p.to(q.dtype))
            dv[:, :, j:j + block] += p_op.transpose(-1, -2) @ doi
            rec("dv", dv)
            dp = rec("dp", doi @ vj.transpose(-1, -2))
            ds = rec("ds", p * (dp - delta[:, :, i:i + block]))
            ds_op = rec("ds_operand", ds.to(q.dtype))
            dq[:, :, i:i + block] += (ds_op @ kj) * scale
            rec("dq", dq)
            dk[:, :, j:j + block] += (ds_op.transpose(-1, -2) @ qi) * scale
            rec("dk", dk)
    return dq, dk, dv


def run(q, k, v, dout, scale, block, rec):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, lse = forward(q, k, v, scale, block, rec)
    grads = backward(q, k, v, out, lse, dout, scale, block, rec)
    return (out, *grads)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for paper-dtypes.json and .md")
    parser.add_argument("--block", type=int, default=512)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA is required: autocast's CUDA op lists are what is being traced")
    torch.manual_seed(0)
    B, H, T, D = 2, 4, 1024, 64
    # q, k, v as the model hands them over: outputs of a Linear under autocast, so bf16.
    q, k, v, dout = (torch.randn(B, H, T, D, device="cuda").to(torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(D)

    recorder = Recorder()
    eager = run(q, k, v, dout, scale, args.block, recorder)
    compiled_fn = torch.compile(lambda *a: run(*a, noop))
    compiled = compiled_fn(q, k, v, dout, scale, args.block)
    comparison = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, compiled):
        comparison[name] = {
            "dtype_eager": DTYPE_NAMES[a.dtype], "dtype_compiled": DTYPE_NAMES[b.dtype],
            "bit_equal_fraction": (a == b).float().mean().item(),
            "max_abs_diff": (a.float() - b.float()).abs().max().item(),
        }
    result = {
        "command": "python research/trace_paper_dtypes.py --out " + str(args.out),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "shape": [B, H, T, D], "block": args.block, "sites": recorder.sites, "compiled_vs_eager": comparison,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paper-dtypes.json").write_text(json.dumps(result, indent=2))
    lines = ["| site | dtype (eager) |", "|---|---|"] + [f"| {s} | {d} |" for s, d in recorder.sites.items()]
    lines += ["", "| tensor | compiled dtype | bit-equal to eager | max abs diff |", "|---|---|---|---|"]
    lines += [f"| {n} | {c['dtype_compiled']} | {c['bit_equal_fraction']:.4f} | {c['max_abs_diff']:.3g} |"
              for n, c in comparison.items()]
    (args.out / "paper-dtypes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
