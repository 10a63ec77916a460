"""The seed's causal chain on one attention head, on the CPU (`stableflash reproduce micro`).

One head, frozen inputs X that share a common direction, frozen keys with several identical sink keys (so that
rows hold exact tied maxima) among random distractors, frozen V positive in a few dims, and a readout loss
½‖O - Y‖² whose targets Y the head cannot reach, so dO stays non-zero where the high-precision gradient of W_Q
vanishes. Only W_Q trains, with AdamW, from the same initialisation on the same data in every arm; the arms differ
only in the attention's numerics. Each step also runs the fp64 attention on the arm's own bf16 q, k, v, so that the
gradient error dW_Q(arm) - dW_Q(fp64) and the δ error are the attention's alone.

The seed predicts: with nearest rounding (`paper`) the errors share a sign along one direction R and W_Q grows along
it; the official SFA, P̄V in fp32 and stochastic rounding on the P̄V path do not; rounding toward zero there
reverses the sign. R is the top singular pair (u, v) of the `paper` arm's accumulated error; every arm's errors and
W_Q drift are projected on that same R, so their signs compare.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from stableflash.attention import PRESETS, SFA, AttentionStats, flash_attention
from stableflash.attention.precision import PV_PATH, Precision
from stableflash.attention.reference import forward_and_delta


@dataclass(frozen=True)
class MicroSetup:
    """The one-head problem; the defaults run all arms in a few minutes on 2 cores."""

    batch: int = 8
    seq_len: int = 64
    width: int = 32
    head_dim: int = 16
    sinks: int = 4
    """Identical keys at the first positions: every row past them holds `sinks` exact maxima."""
    positive_dims: int = 4
    """V's first dims are positive everywhere (one sign, as the seed needs)."""
    near_tie: float = 0.0
    """> 0: the sink keys differ by this much along their own direction (scores within ε, not equal)."""
    steps: int = 3000
    lr: float = 1e-3
    seed: int = 0


def _arm_policies() -> dict[str, tuple[Precision, SFA | None, float]]:
    """name -> (policy, stabilizer, near-tie offset)."""
    paper = PRESETS["paper"]
    return {
        "fp64": (PRESETS["fp64"], None, 0.0),
        "paper": (paper, None, 0.0),
        "paper-eager": (PRESETS["paper-eager"], None, 0.0),
        "paper+sfa": (paper, SFA.official(), 0.0),
        "paper+pv32": (paper.with_pv_fp32(), None, 0.0),
        "paper+stochastic": (paper.with_rounding("stochastic", PV_PATH), None, 0.0),
        "paper+toward_zero": (paper.with_rounding("toward_zero", PV_PATH), None, 0.0),
        "paper+near_ties": (paper, None, 2.0 ** -7),
        # added after the first recorded run, to locate the error that every arm above kept
        "paper+l32": (paper.with_sites(row_sum_saved="fp32"), None, 0.0),
        "paper+fwd32": (paper.with_pass_of("forward", "fp32"), None, 0.0),
        "paper+bwd32": (paper.with_pass_of("backward", "fp32"), None, 0.0),
    }


ARMS = tuple(_arm_policies())
PREREGISTERED = ARMS[:ARMS.index("paper+l32")]
"""The arms whose predictions docs/micro.md wrote before the first run (the default)."""


def make_problem(setup: MicroSetup, near_tie: float = 0.0) -> dict[str, torch.Tensor]:
    """X, K, V, Y, the initial W_Q (float64) and the fixed sink direction."""
    g = torch.Generator().manual_seed(setup.seed)
    B, T, C, D = setup.batch, setup.seq_len, setup.width, setup.head_dim
    common = torch.nn.functional.normalize(torch.randn(C, generator=g, dtype=torch.float64), dim=0)
    x = 0.5 * torch.randn(B, T, C, generator=g, dtype=torch.float64) + common
    sink = torch.nn.functional.normalize(torch.randn(D, generator=g, dtype=torch.float64), dim=0) * math.sqrt(D)
    k = 0.5 * torch.randn(B, T, D, generator=g, dtype=torch.float64)
    k[:, :setup.sinks] = sink
    if near_tie:  # each sink a little longer than the last: near ties, none exact
        k[:, :setup.sinks] *= 1 + near_tie * torch.arange(setup.sinks, dtype=torch.float64)[:, None]
    v = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    v[..., :setup.positive_dims] = v[..., :setup.positive_dims].abs() + 0.5
    y = 0.5 * torch.randn(B, T, D, generator=g, dtype=torch.float64)
    # W_Q starts aligned with the sinks, so that they win the rows: q . sink ~ 6 after the 1/sqrt(D) scale
    w_q = 0.1 * torch.randn(D, C, generator=g, dtype=torch.float64) / math.sqrt(C)
    w_q += 6.0 * torch.outer(sink / math.sqrt(D), common)
    return {"x": x, "k": k, "v": v, "y": y, "w_q": w_q}


def _attention_grad(q, k, v, y, policy, stabilize, stats=None):
    """(loss, dq, dout) of ½ mean ‖O - Y‖² through the reference attention under `policy`."""
    q = q.detach().requires_grad_()
    out = flash_attention(q, k, v, causal=True, precision=policy, stabilize=stabilize, backend="reference", stats=stats)
    loss = 0.5 * (out.double() - y).square().sum(-1).mean()
    dout = torch.autograd.grad(loss, out, retain_graph=True)[0]
    (dq,) = torch.autograd.grad(out, q, dout)
    return loss.item(), dq.double(), dout


def run_arm(setup: MicroSetup, name: str) -> dict:
    """Train W_Q under one arm; per step the W_Q spectral norm, the gradient error matrix and the δ error sum."""
    policy, stabilize, near_tie = _arm_policies()[name]
    problem = make_problem(setup, near_tie)
    x, y = problem["x"], problem["y"][:, None]
    low = policy.compute != "fp64"
    dtype = torch.bfloat16 if low else torch.float64
    k, v = (problem[n][:, None].to(dtype) for n in ("k", "v"))  # (B, 1, T, D): one head
    w_q = problem["w_q"].clone().requires_grad_()
    opt = torch.optim.AdamW([w_q], lr=setup.lr, betas=(0.9, 0.95), weight_decay=0.0)
    torch.manual_seed(setup.seed)  # the stochastic arm's rounding draws
    stats = AttentionStats(num_heads=1)
    norms, losses, errors, delta_errors = [], [], [], []
    fp64 = PRESETS["fp64"]
    for _ in range(setup.steps):
        q = (x @ w_q.detach().T)[:, None].to(dtype)  # the head's q as autocast hands it over
        loss, dq, dout = _attention_grad(q, k, v, y, policy, stabilize, stats)
        grad = torch.einsum("btd,btc->dc", dq[:, 0], x)
        if low:
            hp = [t.double() for t in (q, k, v)]
            _, dq_hp, _ = _attention_grad(hp[0], hp[1], hp[2], y, fp64, None)
            errors.append(grad - torch.einsum("btd,btc->dc", dq_hp[:, 0], x))
            _, delta_lp = forward_and_delta(q, k, v, dout, policy=policy, stabilize=stabilize)
            _, delta_hp = forward_and_delta(*hp, dout.double(), policy=fp64)
            delta_errors.append((delta_lp.double() - delta_hp).sum().item())
        else:
            errors.append(torch.zeros_like(grad))
            delta_errors.append(0.0)
        norms.append(torch.linalg.matrix_norm(w_q.detach(), ord=2).item())
        losses.append(loss)
        w_q.grad = grad
        opt.step()
    return {"w_q_first": problem["w_q"], "w_q_last": w_q.detach(), "norms": norms, "losses": losses,
            "errors": torch.stack(errors), "delta_errors": delta_errors,
            "pbar_ones": int(stats.pbar_ones[0]), "repeated_rows": int(stats.repeated_max_rows[0]),
            "rows": int(stats.rows[0])}


def summarize(runs: dict[str, dict], reference_arm: str = "paper") -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
    """Per arm the JSON fields the issue names, with every error projected on the reference arm's R = (u, v)."""
    u, _, vh = torch.linalg.svd(runs[reference_arm]["errors"].sum(0))
    u1, v1 = u[:, 0], vh[0]
    if u1 @ runs[reference_arm]["errors"].sum(0) @ v1 < 0:  # orient R so the reference arm's sum is positive
        u1 = -u1
    table = {}
    for name, run in runs.items():
        signed = torch.einsum("d,sdc,c->s", u1, run["errors"], v1)
        drift = (u1 @ (run["w_q_last"] - run["w_q_first"]) @ v1).item()
        table[name] = {
            "wq_norm_first": run["norms"][0], "wq_norm_last": run["norms"][-1],
            "signed_error_sum": signed.sum().item(), "signed_error_positive_steps": (signed > 0).double().mean().item(),
            "cum_delta_error": sum(run["delta_errors"]), "wq_drift_along_R": drift,
            "pbar_ones": run["pbar_ones"], "repeated_max_rows": run["repeated_rows"], "rows": run["rows"],
            "loss_last": run["losses"][-1],
        }
    return table, (u1, v1)


def _figure(runs: dict, table: dict, R, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    u1, v1 = R
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, run in runs.items():
        axes[0].plot(run["norms"], label=name)
        axes[1].plot(torch.einsum("d,sdc,c->s", u1, run["errors"], v1).cumsum(0).numpy(), label=name)
        axes[2].plot(torch.tensor(run["delta_errors"]).cumsum(0).numpy(), label=name)
    axes[0].set(title="W_Q spectral norm", xlabel="step")
    axes[1].set(title="Σ dW_Q error projected on R (signed)", xlabel="step")
    axes[2].set(title="Σ (δ_lp − δ_hp)", xlabel="step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(table: dict) -> str:
    head = f"{'arm':<20} {'|W_Q| first':>11} {'last':>9} {'signed err':>11} {'+ steps':>8} {'Σ Δδ':>11} " \
           f"{'drift R':>9} {'P̄=1':>8}"
    lines = [head]
    for name, row in table.items():
        lines.append(f"{name:<20} {row['wq_norm_first']:11.4f} {row['wq_norm_last']:9.4f} "
                     f"{row['signed_error_sum']:11.3e} {row['signed_error_positive_steps']:8.2f} "
                     f"{row['cum_delta_error']:11.3e} {row['wq_drift_along_R']:9.2e} {row['pbar_ones']:8d}")
    return "\n".join(lines)


def reproduce_micro(out: Path, setup: MicroSetup = MicroSetup(), arms=ARMS, progress=print) -> dict:
    """Run the arms, write `micro.json` and `micro.png` into `out`, return the table."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"arms: unknown {unknown}; expected names from {list(ARMS)}")
    if "paper" not in arms:
        raise ValueError("arms: the 'paper' arm defines the direction R; include it")
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest and makes the run the same on any machine
    runs = {}
    for name in arms:
        start = time.perf_counter()
        runs[name] = run_arm(setup, name)
        progress(f"micro: {name:<20} {setup.steps} steps in {time.perf_counter() - start:5.1f} s")
    table, R = summarize(runs)
    record = {"setup": asdict(setup), "arms": table, "R": {"u": R[0].tolist(), "v": R[1].tolist()},
              "curves": {n: {"wq_norm": r["norms"], "loss": r["losses"]} for n, r in runs.items()}}
    (out / "micro.json").write_text(json.dumps(record, indent=1))
    _figure(runs, table, R, out / "micro.png")
    return table
