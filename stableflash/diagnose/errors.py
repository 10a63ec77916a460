"""The seed's signatures over training, per head of one layer, on every micro-batch of consecutive replayed steps.

`error_trace` resumes a run from a checkpoint and, before each step, captures the layer's q, k, v, dO on every
micro-batch and measures against a high-precision policy:
- O's mean signed error and δ's signed error, split into tied rows (a repeated maximum: the SFA condition) and the
  others, and the share of δ's error that ℓ's rounding makes (δ's error with ℓ's sites in fp32, subtracted);
- the cumulative δ error per head (the seed's Figure 5a), summed over every micro-batch of every step;
- W_Q's drift along R: R is the top singular pair (u, v) of the W_Q gradient error the δ errors predict
  (`decompose.wq_error_matrix`), summed over the first `estimate_steps` steps; on the later, held-out steps,
  uᵀ (W_Q(t) - W_Q(t0)) v with t0 the first held-out step. The seed predicts growth along R with the error's sign.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stableflash.attention.precision import Precision, resolve
from stableflash.attention.reference import forward_and_delta
from stableflash.diagnose.decompose import wq_error_matrix
from stableflash.diagnose.delta import resumed_trainer

ELL_SITES = ("tile_sum", "row_sum", "row_sum_saved")
"""ℓ's rounding sites: the running row sum and the buffer the division and the log-sum-exp read."""


def _errors(q, k, v, dout, low: Precision, high: Precision, stabilize):
    """Per row (B, H, T): O's mean signed error, δ's error, δ's error with ℓ in fp32, and the tied rows."""
    flags: dict = {}
    o_low, d_low = forward_and_delta(q, k, v, dout, policy=low, stabilize=stabilize, row_flags=flags)
    o_high, d_high = forward_and_delta(q, k, v, dout, policy=high)
    _, d_ell = forward_and_delta(q, k, v, dout, policy=low.replace(**dict.fromkeys(ELL_SITES, "fp32")),
                                 stabilize=stabilize)
    d_high = d_high.double()
    return ((o_low.double() - o_high.double()).mean(-1), d_low.double() - d_high, d_ell.double() - d_high,
            flags["repeated"])


@dataclass
class ErrorTrace:
    """Per step (and per head): sums over every micro-batch's rows. JSON-ready (`to_dict`)."""

    layer: int
    low: str
    high: str
    estimate_steps: int
    steps: list
    o_error: dict
    """{"tied": [[per head] per step], "untied": ...}: O's mean signed error per row, summed over the rows."""
    delta_error: dict
    """The same for δ's signed error."""
    delta_error_from_ell: list
    """δ's error that ℓ's rounding makes (low minus low with ℓ in fp32), summed over all rows: [[per head] per step]."""
    rows: dict
    """{"tied": [[per head] per step], "untied": ...}: how many rows."""
    cumulative_delta_error: list
    """The running sum over steps of δ's error over every row: [[per head] per step]."""
    wq_drift_along_r: list
    """[[per head] per held-out step]: uᵀ (W_Q(t) - W_Q(t0)) v, (u, v) the top singular pair of the summed error
    E = dW_Q(hp) - dW_Q(lp), so uᵀ E v > 0. The low-precision step descends dW_Q(hp) - E: it moves W_Q along +E, so
    the seed's mechanism shows as a positive drift. Empty without held-out steps."""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def error_trace(cfg, checkpoint, steps: int, *, layer: int, low: str | Precision = "paper",
                high: str | Precision = "fp64", stabilize=None, estimate_steps: int | None = None,
                replay=None, on_step=None) -> ErrorTrace:
    """Replay `steps` steps from `checkpoint`, measuring layer `layer` on every micro-batch before each step (module
    docstring). `estimate_steps` (default half the steps) estimate R; the rest are held out. `on_step(trace)` is
    called after each step with the trace so far (a caller that may be stopped keeps what was measured)."""
    if not 0 <= layer < cfg.model.n_layer:
        raise ValueError(f"layer: expected 0..{cfg.model.n_layer - 1}, got {layer}")
    if steps < 1:
        raise ValueError(f"steps: expected >= 1, got {steps}")
    estimate_steps = steps // 2 if estimate_steps is None else estimate_steps
    if not 0 <= estimate_steps <= steps:
        raise ValueError(f"estimate_steps: expected 0..{steps}, got {estimate_steps}")
    low_p, high_p = resolve(low), resolve(high)
    from stableflash.diagnose.capture import capture_attention

    H = cfg.model.n_head
    D = cfg.model.n_embd // H
    trace = ErrorTrace(layer=layer, low=low_p.name, high=high_p.name, estimate_steps=estimate_steps, steps=[],
                       o_error={"tied": [], "untied": []}, delta_error={"tied": [], "untied": []},
                       delta_error_from_ell=[], rows={"tied": [], "untied": []}, cumulative_delta_error=[],
                       wq_drift_along_r=[])
    wq_error = torch.zeros(H, D, cfg.model.n_embd, dtype=torch.float64)
    directions, w_q0 = None, None
    running = torch.zeros(H, dtype=torch.float64)
    with resumed_trainer(cfg, checkpoint, replay) as trainer:
        for step in range(trainer.step, trainer.step + steps):
            sums = {name: torch.zeros(H, dtype=torch.float64) for name in
                    ("o_tied", "o_untied", "d_tied", "d_untied", "d_ell", "n_tied", "n_untied")}
            w_q = None
            for x, y in trainer.micro_batches(step):
                c = capture_attention(trainer.model, x, y)[layer]
                trainer.model.zero_grad(set_to_none=True)
                w_q = c.w_q.double().cpu().view(H, D, -1)
                o_err, d_err, d_ell, tied = _errors(c.q, c.k, c.v, c.dout, low_p, high_p, stabilize)
                for name, values in (("o", o_err), ("d", d_err)):
                    sums[f"{name}_tied"] += torch.where(tied, values, 0).sum(dim=(0, 2)).cpu()
                    sums[f"{name}_untied"] += torch.where(tied, 0, values).sum(dim=(0, 2)).cpu()
                sums["d_ell"] += (d_err - d_ell).sum(dim=(0, 2)).cpu()
                sums["n_tied"] += tied.sum(dim=(0, 2)).double().cpu()
                sums["n_untied"] += (~tied).sum(dim=(0, 2)).double().cpu()
                if step - trainer.step < estimate_steps:
                    for h in range(H):
                        wq_error[h] += wq_error_matrix(c.x, c.w_q[h * D:(h + 1) * D], c.k[:, h], d_err[:, h],
                                                       scale=D ** -0.5).cpu()
            if step - trainer.step == estimate_steps:  # the first held-out step: R from the steps before
                u, _, vh = torch.linalg.svd(wq_error, full_matrices=False)
                directions, w_q0 = (u[:, :, 0], vh[:, 0, :]), w_q
            if directions is not None:
                drift = torch.einsum("hd,hdc,hc->h", directions[0], w_q - w_q0, directions[1])
                trace.wq_drift_along_r.append(drift.tolist())
            running += sums["d_tied"] + sums["d_untied"]
            trace.steps.append(step)
            for group in ("tied", "untied"):
                trace.o_error[group].append(sums[f"o_{group}"].tolist())
                trace.delta_error[group].append(sums[f"d_{group}"].tolist())
                trace.rows[group].append(sums[f"n_{group}"].tolist())
            trace.delta_error_from_ell.append(sums["d_ell"].tolist())
            trace.cumulative_delta_error.append(running.tolist())
            trainer.train_step(step)
            if on_step is not None:
                on_step(trace)
    return trace
