"""The synthetic mechanism table: bias of O and δ on rows with k tied maxima.

Every query row has exactly k keys tied at the row maximum (copies of one key
vector), V has one sign (as the seed's V[:, 20]) and so has dO. For each
attention variant we measure the mean signed error of O and of δ against the
fp64 policy on the same bf16 inputs, with a 99% confidence interval over rows.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import torch

from stableflash.attention.precision import PRESETS, Precision
from stableflash.attention.reference import forward_and_delta
from stableflash.attention.stabilize import SFA, ClampPbar
from stableflash.attention.stats import AttentionStats

Z99 = 2.5758293035489004  # two-sided 99% normal quantile


def tied_maxima_inputs(num_ties: int, *, heads: int = 16, keys: int = 256, head_dim: int = 64,
                       score_scale: float = 6.0, seed: int = 0):
    """bf16 (1, heads, keys, head_dim) q, k, v, dO with `num_ties` tied maxima in every row.

    The tied keys are copies of one vector w at random positions; each query is a
    positive multiple of w, so those keys score identically and above the others."""
    if num_ties < 1 or num_ties > keys:
        raise ValueError(f"num_ties: expected 1..{keys}, got {num_ties}")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(heads, 1, head_dim, generator=g)
    w = w / w.norm(dim=-1, keepdim=True) * head_dim**0.5
    k = torch.randn(heads, keys, head_dim, generator=g) * 0.3
    for h in range(heads):
        positions = torch.randperm(keys, generator=g)[:num_ties]
        k[h, positions] = w[h]
    q = w * (torch.rand(heads, keys, 1, generator=g) + 1) * score_scale / head_dim**0.5
    v = -(torch.rand(heads, keys, head_dim, generator=g) * 4 + 0.5)
    dout = -torch.rand(heads, keys, head_dim, generator=g)
    return tuple(t.unsqueeze(0).bfloat16() for t in (q, k, v, dout))


@dataclass(frozen=True)
class Estimate:
    """Mean with a 99% normal confidence interval."""

    mean: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, samples: torch.Tensor) -> Estimate:
        samples = samples.double().flatten()
        n = samples.numel()
        mean = samples.mean().item()
        half = Z99 * samples.std().item() / math.sqrt(n) if n > 1 else math.inf
        return cls(mean, mean - half, mean + half, n)

    def __str__(self) -> str:
        return f"{self.mean:+.3e} [{self.low:+.2e}, {self.high:+.2e}]"


def default_variants() -> dict[str, tuple[Precision, object]]:
    paper = PRESETS["paper"].tiling_off()
    return {
        "paper": (paper, None),
        "fa2": (PRESETS["fa2"], None),
        "paper+SFA": (paper, SFA()),
        "paper+ClampPbar": (paper, ClampPbar()),
        "paper+PV-fp32": (paper.with_pv_fp32(), None),
    }


@dataclass
class MechanismTable:
    """Rows of (ties, variant, O error, δ error) estimates."""

    rows: list[dict] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"rows": self.rows}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> MechanismTable:
        return cls(rows=json.loads(text)["rows"])

    def to_markdown(self) -> str:
        lines = ["| ties | variant | mean O error [99% CI] | mean δ error [99% CI] | P̄=1 share |",
                 "|---|---|---|---|---|"]
        for r in self.rows:
            o, d = Estimate(**r["o_error"]), Estimate(**r["delta_error"])
            lines.append(f"| {r['ties']} | {r['variant']} | {o} | {d} | {r['pbar_one_share']:.4f} |")
        return "\n".join(lines)


def mechanism_table(ties=(1, 2, 3, 4), variants: dict | None = None, *, seed: int = 0, **input_kwargs) -> MechanismTable:
    """Measure O and δ bias against fp64 for each tie count and attention variant."""
    variants = default_variants() if variants is None else variants
    table = MechanismTable()
    for num_ties in ties:
        q, k, v, dout = tied_maxima_inputs(num_ties, seed=seed + num_ties, **input_kwargs)
        exact_o, exact_delta = forward_and_delta(*(t.double() for t in (q, k, v, dout)), causal=False,
                                                 policy=PRESETS["fp64"])
        for name, (policy, stabilize) in variants.items():
            stats = AttentionStats(q.shape[1])
            o, delta = forward_and_delta(q, k, v, dout, causal=False, policy=policy, stabilize=stabilize, stats=stats)
            o_err = (o.double() - exact_o).mean(-1)  # per row
            table.rows.append({
                "ties": num_ties, "variant": name,
                "o_error": asdict(Estimate.of(o_err)),
                "delta_error": asdict(Estimate.of(delta.double() - exact_delta)),
                "pbar_one_share": stats.pbar_ones.sum().item() / stats.rows.sum().item() / q.shape[2],
            })
    return table
