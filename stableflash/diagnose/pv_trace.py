"""The P̄V cumulative-error trace of one output element (the seed's Figure 6).

Along the key axis, accumulate P̄[j]·V[j, i] in a low-precision format (each product and each
partial sum rounded, as a running bf16 accumulator does) and in float64; the gap between them
is the cumulative error. Keys where P̄ = 1 are marked: there the full V value enters the sum,
and with V of one sign the roundings lean one way. The largest single jump is explained bit by
bit with `explain_add`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stableflash.diagnose.record import Record
from stableflash.numerics.explain import explain_add
from stableflash.numerics.formats import get_format


@dataclass
class PVTrace(Record):
    format: str
    row: int
    feature: int
    pbar: list
    values: list
    low: list
    """Running sum in `format` after each key."""
    high: list
    """Running sum in float64."""
    error: list
    ones: list
    """Keys where P̄ = 1."""
    largest_jump: int
    explanation: dict
    explanation_text: str


def pv_trace(pbar: torch.Tensor, values: torch.Tensor, fmt: str = "bf16", *, row: int = 0, feature: int = 0) -> PVTrace:
    """Trace Σ_j P̄[j]·V[j] along j; `pbar` and `values` are 1-D and already in their storage formats."""
    if pbar.dim() != 1 or pbar.shape != values.shape:
        raise ValueError(f"pbar, values: expected two 1-D tensors of one length, got {tuple(pbar.shape)} and "
                         f"{tuple(values.shape)}")
    dtype = get_format(fmt).torch_dtype
    acc = torch.zeros((), dtype=dtype)
    exact = 0.0
    low, high, jumps, operands = [], [], [], []
    for p, x in zip(pbar.tolist(), values.tolist()):
        product = torch.tensor(p * x, dtype=torch.float64).to(dtype)
        before_error = acc.double().item() - exact
        operands.append((acc.float().item(), product.float().item()))
        acc = (acc.double() + product.double()).to(dtype)
        exact += p * x
        low.append(acc.double().item())
        high.append(exact)
        jumps.append(abs((low[-1] - exact) - before_error))
    error = [a - b for a, b in zip(low, high)]
    j = max(range(len(jumps)), key=jumps.__getitem__) if jumps else 0
    explanation = explain_add(*operands[j], fmt) if operands else None
    return PVTrace(format=fmt, row=row, feature=feature, pbar=pbar.double().tolist(), values=values.double().tolist(),
                   low=low, high=high, error=error, ones=[i for i, p in enumerate(pbar.tolist()) if p == 1.0],
                   largest_jump=j, explanation=explanation.to_dict() if explanation else {},
                   explanation_text=str(explanation) if explanation else "")


def pv_trace_from_attention(q, k, v, *, batch: int = 0, head: int = 0, row: int = -1, feature: int = 0,
                            causal: bool = True, fmt: str = "bf16") -> PVTrace:
    """P̄ of one query row (m = row max, P̄ rounded to the inputs' dtype, as FA2 feeds P̄V) and one V column."""
    T, D = q.shape[-2], q.shape[-1]
    row = row % T
    s = (q[batch, head, row].double() @ k[batch, head].double().T) / math.sqrt(D)
    if causal:
        s[row + 1:] = -math.inf
    pbar = torch.exp(s - s.max()).to(q.dtype)
    keys = slice(0, row + 1) if causal else slice(None)
    return pv_trace(pbar[keys], v[batch, head, keys, feature], fmt, row=row, feature=feature)
