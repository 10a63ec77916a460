"""The seed's condition, measured: is the P̄V rounding of an arm biased, or only noisy, on the rows where the seed puts
the bias?

The seed's bias needs a row whose tile holds at least two P̄ = 1 (tied maxima) with the rest of the tile's P̄ mass below
half an ulp of the format P̄V is rounded to, V of one sign, and V and P̄V in the same coarse format: then the sum of the
tied V rows rounds at a tie that the tail breaks one way (`AttentionStats.biasable_rows`). An arm is a policy; the
check measures, per row, the mean signed error of O against fp64 in ulps of the arm's format at |O|, with a 99%
interval, on the biasable rows and on the others, and its RMS.

The arms of the bias-against-noise study (docs/bias-vs-noise.md), for N fraction bits:
- `B{N}`: `paper` with V as P̄V reads it and P̄V in e8mN, rounded to nearest (the seed's condition, made coarser);
- `C{N}`: the same, P̄V rounded stochastically (the same error size, no bias);
- `D{N}`: `paper` with P̄V alone in e8mN, nearest (what the dose-response study coarsened: V stays bf16).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from stableflash.attention.precision import PRESETS, Precision
from stableflash.attention.reference import forward
from stableflash.diagnose.mechanism import Estimate
from stableflash.diagnose.record import Record
from stableflash.numerics.formats import get_format


def arm_policy(arm: str) -> Precision:
    """The policy of an arm named `B4`, `C3`, `D4` ... (N from 3 to 7; 7 is bf16, so `B7` is `paper`)."""
    kind, bits = arm[:1], arm[1:]
    if kind not in "BCD" or not bits.isdigit() or not 3 <= int(bits) <= 7:
        raise ValueError(f"arm: expected B, C or D and a fraction-bit count 3..7 (e.g. 'B4'), got {arm!r}")
    fmt = "bf16" if bits == "7" else f"e8m{bits}"
    paper = PRESETS["paper"]
    if kind == "D":
        return paper.with_sites(pv=fmt)
    policy = paper.with_sites(v_operand=fmt, pv=fmt)
    return policy.with_rounding("stochastic", ("pv",)) if kind == "C" else policy


def arm_format(arm: str):
    """The format an arm's errors are counted in ulps of: its P̄V format."""
    return arm_policy(arm).format("pv", torch.bfloat16)


def ulps(values: torch.Tensor, fmt) -> torch.Tensor:
    """The ulp of `fmt` at each |value| (float64): 2^(exponent - fraction bits), the smallest normal's below it."""
    magnitude = values.abs().double().clamp(min=fmt.min_normal)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - fmt.fraction_bits)


def unmanipulated(arm: str) -> Precision:
    """The arm's policy with the sites it changes (V as P̄V reads it, P̄V) in fp32: what its manipulation adds to
    is measured against this, on the same inputs."""
    return arm_policy(arm).replace(v_operand="fp32", pv="fp32", rounding="nearest", rounding_sites=())


def row_errors(q, k, v, arm: str, *, causal: bool, against: str = "fp64", exact: torch.Tensor | None = None):
    """(errors, biasable): per row (B, H, T), O's mean signed error in ulps of the arm's format at the exact |O|, and
    whether the row is biasable under the arm's numerics. `against`: "fp64" (the whole error), or "arm" (against
    `unmanipulated(arm)`: the error the arm's own sites add)."""
    policy, fmt = arm_policy(arm), arm_format(arm)
    scale = q.shape[-1] ** -0.5
    if exact is None:
        exact = forward(*(t.double() for t in (q, k, v)), scale=scale, causal=causal, policy=PRESETS["fp64"])[0]
    flags: dict = {}
    out = forward(q, k, v, scale=scale, causal=causal, policy=policy, row_flags=flags)[0]
    if against == "arm":
        baseline = forward(q, k, v, scale=scale, causal=causal, policy=unmanipulated(arm))[0].double()
    elif against == "fp64":
        baseline = exact
    else:
        raise ValueError(f"against: expected 'fp64' or 'arm', got {against!r}")
    errors = (out.double() - baseline) / ulps(exact, fmt)
    return errors.mean(-1), flags["biasable"]


@dataclass
class ConditionCheck(Record):
    """Per arm and row group ("biasable", "other"): the mean signed O error in ulps of the arm's format (99% CI), its
    RMS, the same mean in ulps of bf16 (the bias's absolute size), and how many rows; against fp64 or against the
    unmanipulated arm (`row_errors`)."""

    source: str
    against: str
    rows: list[dict]

    def to_markdown(self) -> str:
        base = "fp64" if self.against == "fp64" else "the arm with V and P̄V in fp32 (what its sites add)"
        lines = [f"O error against {base} on {self.source}, per row (mean over features), in ulps of the arm's P̄V "
                 "format",
                 "", "| arm | head | rows | n (share) | mean error [99% CI] (ulps) | RMS (ulps) | mean (bf16 ulps) |",
                 "|---|---|---|---|---|---|---|"]
        for r in self.rows:
            e, head = Estimate(**r["mean"]), "all" if r["head"] is None else r["head"]
            lines.append(f"| {r['arm']} | {head} | {r['group']} | {r['n']} ({r['share']:.2%}) | {e.mean:+.3f} "
                         f"[{e.low:+.3f}, {e.high:+.3f}] | {r['rms']:.3f} | {r['mean_bf16_ulps']:+.4f} |")
        return "\n".join(lines)


def condition_check(inputs, arms, *, causal: bool, source: str, against: str = "fp64", seed: int = 0,
                    by_head: bool = False) -> ConditionCheck:
    """The check on a list of (q, k, v) batches (bf16, (B, H, T, D), one number of heads); stochastic arms draw from
    torch's generator, seeded with `seed` before each batch. With `by_head`, a row per arm, group and head (the
    rows' `head`), and each group's share of its head's rows (`share`)."""
    rows = []
    per_arm: dict[str, tuple[list, list, list]] = {arm: ([], [], []) for arm in arms}
    for q, k, v in inputs:
        exact = forward(*(t.double() for t in (q, k, v)), scale=q.shape[-1] ** -0.5, causal=causal,
                        policy=PRESETS["fp64"])[0]
        heads = torch.arange(q.shape[1])[None, :, None].expand(q.shape[:3])
        for arm in arms:
            torch.manual_seed(seed)
            errors, biasable = row_errors(q, k, v, arm, causal=causal, against=against, exact=exact)
            for store, values in zip(per_arm[arm], (errors, biasable, heads)):
                store.append(values.flatten().cpu())
    for arm in arms:
        errors, biasable, heads = (torch.cat(parts) for parts in per_arm[arm])
        to_bf16 = 2.0 ** (arm_format(arm).fraction_bits - get_format("bf16").fraction_bits)
        for head in (sorted(set(heads.tolist())) if by_head else [None]):
            in_head = torch.ones_like(biasable) if head is None else heads == head
            for group, chosen in (("biasable", biasable & in_head), ("other", ~biasable & in_head)):
                sample = errors[chosen]
                if sample.numel() == 0:
                    continue
                estimate = (Estimate.of(sample) if sample.numel() > 1
                            else Estimate(sample.item(), -math.inf, math.inf, 1))
                rows.append({"arm": arm, "group": group, "head": head, "n": int(sample.numel()),
                             "share": sample.numel() / int(in_head.sum()), "mean": asdict(estimate),
                             "rms": sample.square().mean().sqrt().item(), "mean_bf16_ulps": estimate.mean / to_bf16})
    return ConditionCheck(source=source, against=against, rows=rows)


def tied_rows(*, heads: int = 8, keys: int = 512, head_dim: int = 64, ties=(1, 2, 3, 4), scores=(12.0, 24.0),
              seed: int = 0):
    """Synthetic bf16 batches, one per tie count n, each one 512-key tile (non-causal). The keys come in blocks of n
    copies of one random vector, and query i is a positive multiple of block i mod (keys / n)'s vector: every row
    has n keys tied at its maximum, rows of different blocks sum different V rows (V of one sign, random), and the
    tied keys' scaled score is drawn from `scores` against the other keys' ~N(0, score / 8). The default, 12 to 24,
    makes sharp rows: the other keys' P̄ mass mostly ~1e-3 to 1e-6, below half an ulp of bf16 and above fp32's, so
    most rows with n >= 2 are biasable (at 512 keys, 70-90%); lower scores make soft rows, whose tail shifts the sum
    rather than breaking a tie, and higher ones rows whose tail is lost in fp32."""
    batches = []
    for n in ties:
        g = torch.Generator().manual_seed(seed + n)
        blocks = keys // n
        w = torch.randn(heads, blocks, head_dim, generator=g)
        w = w / w.norm(dim=-1, keepdim=True) * head_dim**0.5
        k = torch.randn(heads, keys, head_dim, generator=g)
        k[:, :blocks * n] = w.repeat_interleave(n, dim=1)
        score = scores[0] + (scores[1] - scores[0]) * torch.rand(heads, keys, 1, generator=g)  # the tied keys'
        q = w[:, torch.arange(keys) % blocks] * score / head_dim**0.5
        v = -(torch.rand(heads, keys, head_dim, generator=g) * 4 + 0.5)
        batches.append(tuple(t.unsqueeze(0).bfloat16() for t in (q, k, v)))
    return batches


def captured_rows(cfg, checkpoint, *, batches: int = 1, layers=None):
    """(q, k, v) of the model's layers (`layers`: indices, None: all) on the first micro-batch of each of the
    `batches` steps after `checkpoint` (causal, as in training), in bf16: what its attention saw."""
    from stableflash.diagnose.capture import capture_attention
    from stableflash.diagnose.delta import resumed_trainer

    out = []
    with resumed_trainer(cfg, checkpoint) as trainer:
        for step in range(trainer.step, trainer.step + batches):
            x, y = next(iter(trainer.micro_batches(step)))
            captures = capture_attention(trainer.model, x, y)
            for layer in range(len(captures)) if layers is None else layers:
                out.append(tuple(t.to(torch.bfloat16) for t in (captures[layer].q, captures[layer].k,
                                                               captures[layer].v)))
            trainer.model.zero_grad(set_to_none=True)
    return out


PASS_RULE = """The check passes when, on the biasable rows of the synthetic batches, with O's error against fp64:
- every B arm's mean error is <= -0.1 ulps of its format with its 99% CI below 0, and its size in bf16 ulps grows as N
  falls: each step of N by 1 multiplies it by 1.4 to 2.8 (the bias doubles with the ulp);
- every C arm's bias is indistinguishable from 0 at the manipulation's scale: its 99% CI contains 0, or its mean is at
  most a tenth of the B arm's at the same N; and its RMS is within 0.5x-2x of the B arm's noise (the B arm's RMS with
  its mean removed): the same error size, without the bias."""


def verdict(check: ConditionCheck) -> dict:
    """PASS_RULE applied to a check's biasable rows: {"passed": bool, "reasons": [...]} naming each failed part."""
    found = {r["arm"]: r for r in check.rows if r["group"] == "biasable" and r["head"] is None}
    reasons = []
    b_arms = sorted((a for a in found if a[0] == "B"), key=lambda a: -int(a[1:]))
    for arm in b_arms:
        e = found[arm]["mean"]
        if not (e["mean"] <= -0.1 and e["high"] < 0):
            reasons.append(f"{arm}: mean {e['mean']:+.3f} ulps [{e['low']:+.3f}, {e['high']:+.3f}] is not <= -0.1 "
                           "with its CI below 0")
    for wider, narrower in zip(b_arms, b_arms[1:]):
        ratio = found[narrower]["mean_bf16_ulps"] / found[wider]["mean_bf16_ulps"]
        steps = int(wider[1:]) - int(narrower[1:])
        if not 1.4**steps <= ratio <= 2.8**steps:
            reasons.append(f"{narrower} against {wider}: the bias in bf16 ulps grows {ratio:.2f}x over {steps} bit(s), "
                           f"not 1.4-2.8x per bit")
    for arm in (a for a in found if a[0] == "C"):
        e, partner = found[arm]["mean"], found.get("B" + arm[1:])
        small = partner is not None and abs(e["mean"]) <= 0.1 * abs(partner["mean"]["mean"])
        if not (e["low"] <= 0 <= e["high"] or small):
            reasons.append(f"{arm}: mean {e['mean']:+.3f} ulps [{e['low']:+.3f}, {e['high']:+.3f}] excludes 0 and is "
                           "above a tenth of the B arm's")
        if partner is not None:
            noise = math.sqrt(max(partner["rms"] ** 2 - partner["mean"]["mean"] ** 2, 0.0))
            if not 0.5 <= found[arm]["rms"] / noise <= 2:
                reasons.append(f"{arm}: RMS {found[arm]['rms']:.3f} against B{arm[1:]}'s noise {noise:.3f}")
    if not b_arms:
        reasons.append("no B arm had biasable rows")
    return {"passed": not reasons, "reasons": reasons}
