"""The gradient error of W_Q as a sum of rank-1 terms (the seed's section 3.4.3), and how alike they are.

With only δ differing between two backward passes,
    dW_Q(hp) - dW_Q(lp) = α Σ_T (δ_lp - δ_hp)[T] · (PK)[T]ᵀ X[T],
since dQ = α (P ∘ (dP - δ)) K and dW_Q = dQᵀ X. `decompose_wq_error` checks that identity
(the residual is float rounding unless another error source is present) and measures the
structure the seed argues drives the spectral-norm growth: the terms' cosine similarity
across tokens and in chosen columns, the share of the sum on its top singular direction,
and (with `alignment_across_steps`) whether that direction stays put from step to step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stableflash.attention.precision import resolve
from stableflash.attention.reference import forward_and_delta
from stableflash.diagnose.record import Record


def _attention_probs(q, k, scale, causal):
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(s, dim=-1)


def wq_gradient(x, w_q, k, v, dout, delta, *, scale: float, causal: bool = True, dp=None) -> torch.Tensor:
    """dW_Q (D, C) of one head in float64 from the backward formula with a given δ (and optionally dP).

    x: (B, T, C) input of c_attn; w_q: (D, C) the head's rows of W_Q; k, v, dout: (B, T, D); delta: (B, T).
    """
    x, w_q, k, v, dout, delta = (t.double() for t in (x, w_q, k, v, dout, delta))
    q = x @ w_q.T
    p = _attention_probs(q, k, scale, causal)
    dp = dout @ v.transpose(-1, -2) if dp is None else dp.double()
    dq = scale * (p * (dp - delta[..., None])) @ k
    return torch.einsum("btd,btc->dc", dq, x)


def wq_error_matrix(x, w_q, k, delta_error, *, scale: float, causal: bool = True) -> torch.Tensor:
    """The (D, C) float64 W_Q gradient error dW_Q(hp) - dW_Q(lp) that a δ error δ_lp - δ_hp (B, T) predicts for one
    head: α Σ_T (δ_lp - δ_hp)[T] · (PK)[T]ᵀ X[T] (x (B, T, C), w_q (D, C), k (B, T, D))."""
    p = _attention_probs(x.double() @ w_q.double().T, k.double(), scale, causal)
    pk = (p @ k.double()).reshape(-1, k.shape[-1])  # (B*T, D): a_T
    return torch.einsum("n,nd,nc->dc", scale * delta_error.double().reshape(-1), pk, x.double().reshape(-1, x.shape[-1]))


@dataclass
class WqErrorDecomposition(Record):
    measured_norm: float
    predicted_norm: float
    relative_residual: float
    """‖measured - predicted‖ / ‖measured‖: float rounding when only δ differs."""
    delta_error_mean: float
    delta_error_frac_positive: float
    token_cosine_mean: float
    """Mean cosine similarity of the rank-1 terms over token pairs (off-diagonal)."""
    token_cosine_frac_positive: float
    column_cosine_mean: dict
    """Per chosen column of W_Q's gradient: mean pairwise cosine of the terms' column over tokens."""
    top_singular_share: float
    """σ₁² / Σσ² of the predicted error matrix."""
    top_left: list
    top_right: list
    """Top singular vectors (D and C long): compare them across steps with `alignment_across_steps`."""

    def check(self, tolerance: float = 1e-6) -> WqErrorDecomposition:
        """Raise if the identity does not hold: some error source other than δ is present."""
        if not self.relative_residual <= tolerance:
            raise ValueError(f"the δ-only decomposition leaves a relative residual of {self.relative_residual:.3e} "
                             f"(> {tolerance:.0e}): the two gradients differ by more than δ")
        return self


def _pairwise_cosine_mean(signs: torch.Tensor, *factors: torch.Tensor) -> tuple[float, float]:
    """Mean and positive share, over token pairs i != j, of sign_i sign_j Π cos(f_i, f_j)."""
    cos = torch.outer(signs, signs)
    for f in factors:
        unit = f / f.norm(dim=-1, keepdim=True).clamp_min(1e-300)
        cos = cos * (unit @ unit.T)
    n = cos.shape[0]
    off = cos[~torch.eye(n, dtype=torch.bool, device=cos.device)]
    return off.mean().item(), (off > 0).double().mean().item()


def decompose_wq_error(x, w_q, k, v, dout, delta_hp, delta_lp, *, scale: float, causal: bool = True,
                       measured: torch.Tensor | None = None, columns: int = 3) -> WqErrorDecomposition:
    """Compare the measured dW_Q(hp) - dW_Q(lp) with the δ-only prediction and describe its rank-1 terms.

    `measured` defaults to the difference of `wq_gradient` under the two δ (so only δ differs);
    pass a gradient difference from two real backward passes to see how much δ explains.
    """
    x64, w64, k64 = x.double(), w_q.double(), k.double()
    if measured is None:
        measured = (wq_gradient(x, w_q, k, v, dout, delta_hp, scale=scale, causal=causal)
                    - wq_gradient(x, w_q, k, v, dout, delta_lp, scale=scale, causal=causal))
    measured = measured.double()
    p = _attention_probs(x64 @ w64.T, k64, scale, causal)
    pk = (p @ k64).reshape(-1, k.shape[-1])  # (B*T, D): a_T
    xs = x64.reshape(-1, x.shape[-1])  # (B*T, C): b_T
    err = (delta_lp.double() - delta_hp.double()).reshape(-1)  # Δδ_T
    weights = scale * err
    predicted = wq_error_matrix(x, w_q, k, delta_lp.double() - delta_hp.double(), scale=scale, causal=causal)
    residual = ((measured - predicted).norm() / measured.norm().clamp_min(1e-300)).item()
    signs = torch.sign(weights)
    live = signs != 0
    token_mean, token_pos = _pairwise_cosine_mean(signs[live], pk[live], xs[live]) if live.sum() > 1 else (0.0, 0.0)
    chosen = predicted.norm(dim=0).topk(min(columns, predicted.shape[1])).indices.tolist()
    column_cos = {}
    for c in chosen:
        col_signs = signs * torch.sign(xs[:, c])
        keep = col_signs != 0
        column_cos[str(c)] = _pairwise_cosine_mean(col_signs[keep], pk[keep])[0] if keep.sum() > 1 else 0.0
    u, s, vh = torch.linalg.svd(predicted, full_matrices=False)
    share = (s[0] ** 2 / (s**2).sum().clamp_min(1e-300)).item()
    return WqErrorDecomposition(
        measured_norm=measured.norm().item(), predicted_norm=predicted.norm().item(), relative_residual=residual,
        delta_error_mean=err.mean().item(), delta_error_frac_positive=(err > 0).double().mean().item(),
        token_cosine_mean=token_mean, token_cosine_frac_positive=token_pos, column_cosine_mean=column_cos,
        top_singular_share=share, top_left=u[:, 0].tolist(), top_right=vh[0].tolist())


def decompose_head(capture, head: int, low: str = "paper", high: str = "fp64") -> WqErrorDecomposition:
    """`decompose_wq_error` for one head of a layer's `LayerCapture`, with δ from the two policies."""
    D = capture.q.shape[-1]
    q, k, v, dout = (t[:, head:head + 1] for t in (capture.q, capture.k, capture.v, capture.dout))
    delta_hp, delta_lp = (forward_and_delta(q, k, v, dout, policy=resolve(p))[1][:, 0] for p in (high, low))
    return decompose_wq_error(capture.x, capture.w_q[head * D:(head + 1) * D], k[:, 0], v[:, 0], dout[:, 0],
                              delta_hp, delta_lp, scale=D ** -0.5)


def alignment_across_steps(decompositions: list[WqErrorDecomposition]) -> list[float]:
    """(u₁·u₁')(v₁·v₁') between consecutive steps' top singular pairs, with its sign: +1 when the two steps'
    errors are the same rank-1 matrix (they accumulate), -1 when opposite (they cancel). The product does not
    depend on the SVD's sign choice, since flipping u and v together leaves u vᵀ unchanged."""
    out = []
    for a, b in zip(decompositions, decompositions[1:]):
        ua, ub = torch.tensor(a.top_left), torch.tensor(b.top_left)
        va, vb = torch.tensor(a.top_right), torch.tensor(b.top_right)
        out.append((ua @ ub).item() * (va @ vb).item())
    return out


@dataclass
class WqErrorStudy(Record):
    """Decompositions of one head's W_Q error over consecutive steps, and their top directions' alignment."""

    layer: int
    head: int
    low: str
    high: str
    steps: list
    decompositions: list
    alignment: list

    def to_markdown(self) -> str:
        lines = [f"layer {self.layer}, head {self.head}, `{self.low}` against `{self.high}`", "",
                 "| step | Σ Δδ (mean) | rows Δδ > 0 | top direction's share | signed alignment with the next step |",
                 "|---|---|---|---|---|"]
        for i, (step, d) in enumerate(zip(self.steps, self.decompositions)):
            align = f"{self.alignment[i]:+.3f}" if i < len(self.alignment) else ""
            lines.append(f"| {step} | {d['delta_error_mean']:+.3e} | {d['delta_error_frac_positive']:.2f} | "
                         f"{d['top_singular_share']:.3f} | {align} |")
        return "\n".join(lines)
