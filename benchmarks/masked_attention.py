"""Masked attention: our kernels' masked form against FlexAttention and SDPA doing the same work.

bf16 forward+backward, median of `triton.testing.do_bench`; TFLOP/s counted on the visible (query, key) pairs only
(4·D FLOPs per pair forward, 3.5x that forward+backward), so every implementation is credited the same work. Cases:
a causal sliding window, causal attention over a right-padded batch, and a packed batch of causal sequences
(`flash_attn_varlen_func`'s case; FlexAttention's document mask). FlexAttention is compiled with its block mask;
SDPA gets the dense boolean mask. Prints a table with the ratio to FlexAttention and writes JSON:

    python benchmarks/masked_attention.py --out results/own-model-h200/masked-attention.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from common import run_meta  # benchmarks/common.py: the script's own folder is on sys.path
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from stableflash import SFA, flash_attention, flash_attn_varlen_func

CASES = {  # name: (B, H, T, D, window left, padded fraction of each row's keys, packed sequences in the row)
    "window-1024": (4, 16, 8192, 64, 1024, 0.0, 0),
    "window-256": (8, 16, 4096, 128, 256, 0.0, 0),
    "padding-25%": (8, 16, 4096, 64, -1, 0.25, 0),
    "packed-12": (1, 16, 16384, 64, -1, 0.0, 12),
}


def packed_offsets(T: int, sequences: int) -> list[int]:
    """Offsets of `sequences` causal sequences of uneven lengths (a fixed draw, 64 and up) filling T positions."""
    cuts = torch.randperm(T // 64 - 1, generator=torch.Generator().manual_seed(0))[:sequences - 1] + 1
    return [0, *sorted((cuts * 64).tolist()), T]


def case_masks(B, T, left, padded, device):
    """The key-padding mask (B, T), FlexAttention's mask function and the dense (B, 1, T, T) mask of the case."""
    lengths = torch.full((B,), T, device=device)
    if padded:  # row b keeps 1 - padded * (b + 1) / B of its keys: on average about 1 - padded / 2... 1 - padded
        lengths = (T * (1 - padded * torch.arange(1, B + 1, device=device) / B)).long()
    keep = torch.arange(T, device=device)[None, :] < lengths[:, None]

    def visible(b, h, i, j):
        ok = (j <= i) & (j < lengths[b])
        return ok & (i - j <= left) if left >= 0 else ok

    i = torch.arange(T, device=device)
    dense = (i[None, :] <= i[:, None])[None] & keep[:, None, :]
    if left >= 0:
        dense = dense & (i[:, None] - i[None, :] <= left)[None]
    return (keep if padded else None), visible, dense[:, None]


def packed_masks(T: int, offsets: list[int], device):
    """FlexAttention's document mask function and the dense (1, 1, T, T) mask of a packed row of causal sequences."""
    lengths = torch.tensor(offsets).diff()
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)

    def visible(b, h, i, j):
        return (doc[i] == doc[j]) & (j <= i)

    i = torch.arange(T, device=device)
    return visible, ((doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None]))[None, None]


def measure_case(name: str, flex) -> list[dict]:
    B, H, T, D, left, padded, sequences = CASES[name]
    if sequences:
        offsets = packed_offsets(T, sequences)
        keep, (visible, dense) = None, packed_masks(T, offsets, "cuda")
    else:
        keep, visible, dense = case_masks(B, T, left, padded, "cuda")
    block_mask = create_block_mask(visible, B, None, T, T, device="cuda")
    flops = 3.5 * 4 * D * H * dense.sum().item()
    window = (left, -1) if left >= 0 else None
    impls = {
        "flex": lambda q, k, v: flex(q, k, v, block_mask=block_mask),
        "sdpa-dense-mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        "stableflash": lambda q, k, v: flash_attention(q, k, v, backend="triton", window=window,
                                                       key_padding_mask=keep),
        "stableflash-sfa": lambda q, k, v: flash_attention(q, k, v, backend="triton", window=window,
                                                           key_padding_mask=keep, stabilize=SFA()),
    }
    if sequences:  # the packed row as flash_attn_varlen_func takes it: (total, H, D) views of the same tensors
        cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        longest = max(b - a for a, b in zip(offsets, offsets[1:]))

        def varlen(q, k, v, **kw):
            out = flash_attn_varlen_func(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu, longest, longest,
                                         causal=True, **kw)
            return out.transpose(0, 1)[None]

        impls["stableflash"] = varlen
        impls["stableflash-sfa"] = lambda q, k, v: varlen(q, k, v, stabilize=SFA())
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    measured = {}
    for impl, fn in impls.items():
        def step(fn=fn):
            fn(q, k, v).backward(dout)
        try:
            step()
            measured[impl] = triton.testing.do_bench(step, warmup=25, rep=200, grad_to_none=[q, k, v],
                                                     return_mode="median")
        except (RuntimeError, torch.OutOfMemoryError) as error:
            measured[impl] = None
            print(f"{name:<14}{impl:<18} failed: {str(error).splitlines()[0][:80]}")
        torch.cuda.empty_cache()
    rows = []
    for impl, ms in measured.items():
        row = {"case": name, "shape": [B, H, T, D], "window_left": left, "padded": padded, "impl": impl, "ms": ms,
               "tflops": None if ms is None else flops / (ms * 1e-3) / 1e12,
               "vs_flex": None if ms is None or measured["flex"] is None else measured["flex"] / ms}
        rows.append(row)
        if ms is not None:
            ratio = "-" if row["vs_flex"] is None else f"{row['vs_flex']:.2f}x"
            print(f"{name:<14}{impl:<18}{ms:>9.3f}{row['tflops']:>10.1f}{ratio:>9}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    flex = torch.compile(flex_attention)
    print(f"{'case':<14}{'impl':<18}{'ms':>9}{'TFLOP/s':>10}{'vs flex':>9}")
    meta = run_meta() | {"dtype": "bf16", "timing": "triton.testing.do_bench median, forward+backward",
                         "flops": "3.5 * 4 * D per visible (query, key) pair and head"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows, names = [], args.cases.split(",")
    for index, name in enumerate(names):
        rows += measure_case(name, flex)
        # after every case, so that a run cut short keeps what it measured
        complete = index == len(names) - 1
        args.out.write_text(json.dumps({"meta": meta | {"complete": complete}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
