"""Bias attribution: how much of the mean signed error of O and δ each rounding site causes.

The total bias of a policy against fp64 is split by turning one site at a time to a high
precision: site s's contribution is e(policy) - e(policy with s in high precision), measured
per row on the same inputs (paired), and the remainder e(policy) - Σ contributions is what the
sites do only together. Contributions plus remainder equal the total exactly; every term has a
99% interval over rows. This answers the seed's Limitation 2: how much of the bias comes from
the P̄ = 1 path (the `pbar_operand`, `pv` and `acc` sites) rather than from elsewhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from stableflash.attention.precision import SITES, Precision, resolve
from stableflash.attention.reference import forward_and_delta
from stableflash.diagnose.mechanism import Estimate
from stableflash.diagnose.record import Record

# sites that reach O or δ (the backward's other sites only touch dQ, dK, dV)
# the P̄ = 1 path of the seed (P̄ into P̄V, its product and the accumulator and O it lands in),
# and the row statistics (max, tile sum, rescale, running sum)
GROUPS = {"P̄V path": ("pbar_operand", "pv", "acc_scaled", "acc", "out"),
          "row statistics": ("row_max", "tile_sum", "rescale", "row_sum", "row_sum_saved")}
FORWARD_AND_DELTA_SITES = ("qk", "scores", "row_max", "pbar", "pbar_operand", "tile_sum", "pv", "rescale", "row_sum",
                           "acc_scaled", "acc", "out", "row_sum_saved", "lse", "delta_terms", "delta")


def _row_errors(q, k, v, dout, policy, stabilize, causal, exact):
    out, delta = forward_and_delta(q, k, v, dout, policy=policy, stabilize=stabilize, causal=causal)
    # per row: the mean error of O over features, and δ's error
    return (out.double() - exact[0]).mean(-1).flatten(), (delta.double() - exact[1]).flatten()


@dataclass
class BiasAttribution(Record):
    policy: str
    high: str
    total: dict
    """{"o": Estimate, "delta": Estimate} of the policy against fp64."""
    sites: list[dict]
    """[{"site", "o", "delta"}]: each site's contribution."""
    remainder: dict
    groups: list
    """[{"group", "sites", "o", "delta"}]: several sites turned high together (not part of the sum above)."""

    def to_markdown(self) -> str:
        lines = ["| site | O bias contribution [99% CI] | δ bias contribution [99% CI] |", "|---|---|---|"]
        for row in self.sites:
            lines.append(f"| {row['site']} | {Estimate(**row['o'])} | {Estimate(**row['delta'])} |")
        lines.append(f"| (interactions) | {Estimate(**self.remainder['o'])} | {Estimate(**self.remainder['delta'])} |")
        lines.append(f"| **total** | {Estimate(**self.total['o'])} | {Estimate(**self.total['delta'])} |")
        for g in self.groups:
            lines.append(f"| group: {g['group']} ({', '.join(g['sites'])}) | {Estimate(**g['o'])} | {Estimate(**g['delta'])} |")
        return "\n".join(lines)


def bias_attribution(q, k, v, dout, policy: str | Precision = "paper", *, high: str = "fp32", stabilize=None,
                     causal: bool = False, sites=None, groups: dict | None = None) -> BiasAttribution:
    """Split the O and δ bias of `policy` (against fp64) by rounding site."""
    policy = resolve(policy)
    high_dtype = resolve("fp32").dtype("qk", q.dtype) if high == "fp32" else None
    if sites is None:  # the sites this policy rounds below `high`
        sites = [s for s in FORWARD_AND_DELTA_SITES if policy.dtype(s, q.dtype) != (high_dtype or policy.dtype(s, q.dtype))]
    unknown = [s for s in sites if s not in SITES]
    if unknown:
        raise ValueError(f"sites: unknown {unknown}; expected names from {list(SITES)}")
    exact_out, exact_delta = forward_and_delta(q, k, v, dout, policy=resolve("fp64"), causal=causal)
    exact = (exact_out.double(), exact_delta.double())
    e_o, e_d = _row_errors(q, k, v, dout, policy, stabilize, causal, exact)
    rows, rem_o, rem_d = [], e_o.clone(), e_d.clone()
    for site in sites:
        s_o, s_d = _row_errors(q, k, v, dout, policy.replace(**{site: high}), stabilize, causal, exact)
        c_o, c_d = e_o - s_o, e_d - s_d
        rem_o -= c_o
        rem_d -= c_d
        rows.append({"site": site, "o": asdict(Estimate.of(c_o)), "delta": asdict(Estimate.of(c_d))})
    group_rows = []
    for name, members in (GROUPS if groups is None else groups).items():
        g_o, g_d = _row_errors(q, k, v, dout, policy.replace(**{s: high for s in members}), stabilize, causal, exact)
        group_rows.append({"group": name, "sites": list(members), "o": asdict(Estimate.of(e_o - g_o)),
                           "delta": asdict(Estimate.of(e_d - g_d))})
    return BiasAttribution(policy=policy.name, high=high, total={"o": asdict(Estimate.of(e_o)),
                                                                 "delta": asdict(Estimate.of(e_d))},
                           sites=rows, remainder={"o": asdict(Estimate.of(rem_o)), "delta": asdict(Estimate.of(rem_d))},
                           groups=group_rows)


def bias_at_head(cfg, checkpoint, *, layer: int, head: int | None = None, policy: str | Precision = "paper",
                 high: str = "fp32", replay=None) -> tuple[int, BiasAttribution]:
    """`bias_attribution` on what one head of a trained model sees: the q, k, v and dO of layer `layer`
    on the batch after `checkpoint` (causal, as in training). `head` None: the layer's head with the
    largest W_Q spectral norm. Returns (head, attribution)."""
    import torch

    from stableflash.diagnose.capture import capture_attention
    from stableflash.diagnose.delta import resumed_trainer

    if not 0 <= layer < cfg.model.n_layer:
        raise ValueError(f"layer: expected 0..{cfg.model.n_layer - 1}, got {layer}")
    with resumed_trainer(cfg, checkpoint, replay) as trainer:
        x, y = next(iter(trainer.micro_batches(trainer.step)))
        c = capture_attention(trainer.model, x, y)[layer]
    H = c.q.shape[1]
    if head is None:
        w_q = c.w_q.double().view(H, -1, c.w_q.shape[-1])
        head = int(torch.linalg.matrix_norm(w_q, ord=2).argmax())
    if not 0 <= head < H:
        raise ValueError(f"head: expected 0..{H - 1}, got {head}")
    one = [t[:, head:head + 1].to(torch.bfloat16) for t in (c.q, c.k, c.v, c.dout)]
    return head, bias_attribution(*one, policy, high=high, causal=True)
