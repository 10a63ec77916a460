"""Attention gradient error of several policies against fp64 on what a trained model's layers see.

Captures every layer's q, k, v and dO on the batch after a checkpoint, then runs the reference
attention forward and backward under each policy and compares dQ, dK, dV with fp64: relative norm
error, and the error's component along the exact gradient (negative: the gradient is shrunk).
Which rounding sites make the gradients wrong, on real activations rather than synthetic rows. Also
each row's sum of the probabilities the backward recomputes (1 in exact arithmetic).

    python research/policy_errors_at_checkpoint.py --config repro-bf16-4l --checkpoint RUN \\
        --set run.device=cpu --out results/repro-bf16-4l/diagnose-bf16-step200-cpu/policy-errors.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from stableflash.attention import flash_attention
from stableflash.attention.precision import PRESETS
from stableflash.attention.reference import backward_row_sums
from stableflash.diagnose.capture import capture_attention
from stableflash.diagnose.delta import resumed_trainer
from stableflash.train.config import load_config

BF16 = PRESETS["bf16"].tiling_off()
POLICIES = {
    "bf16": BF16,
    # S in fp32 but the saved log-sum-exp in bf16: the backward's exp(S - lse) no longer matches (not a fix)
    "bf16, scores in fp32": BF16.with_sites(qk="fp32", scores="fp32", row_max="fp32"),
    "bf16, lse in fp32": BF16.with_sites(lse="fp32"),
    "bf16, scores and lse in fp32": BF16.with_sites(qk="fp32", scores="fp32", row_max="fp32", lse="fp32"),
    "bf16, forward as FA2": BF16.with_pass_of("forward", "fa2"),
    "bf16, backward as FA2": BF16.with_pass_of("backward", "fa2"),
    "bf16, P̄V in fp32": BF16.with_pv_fp32(),
    "paper": PRESETS["paper"].tiling_off(),
    "fa2": PRESETS["fa2"],
}


def gradients(q, k, v, dout, policy):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, causal=True, backend="reference", precision=policy).backward(dout)
    return [t.grad.double() for t in leaves]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    with resumed_trainer(cfg, args.checkpoint) as trainer:
        x, y = next(iter(trainer.micro_batches(trainer.step)))
        captures = capture_attention(trainer.model, x, y)
    rows = []
    for layer, c in enumerate(captures):
        q, k, v, dout = (t.to(torch.bfloat16) for t in (c.q, c.k, c.v, c.dout))
        exact = gradients(*(t.double() for t in (q, k, v, dout)), PRESETS["fp64"])
        max_logit = ((q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5).amax().item()
        for name, policy in POLICIES.items():
            sums = backward_row_sums(q, k, v, policy=policy)
            row = {"layer": layer, "policy": name, "max_logit": max_logit,
                   "rows_p_sum_above_1.5": (sums > 1.5).double().mean().item(), "p_sum_max": sums.max().item()}
            for which, g, e in zip(("dq", "dk", "dv"), gradients(q, k, v, dout, policy), exact):
                row[f"{which}_rel_err"] = ((g - e).norm() / e.norm()).item()
                row[f"{which}_along_exact"] = ((g - e) * e).sum().item() / e.norm().item() ** 2
            rows.append(row)
            print(f"layer {layer} (max logit {max_logit:8.0f}) {name:24} dQ err {row['dq_rel_err']:.3f} "
                  f"({row['dq_along_exact']:+.3f} along)  dK err {row['dk_rel_err']:.3f}  dV err {row['dv_rel_err']:.3f}  "
                  f"rows with ΣP > 1.5: {row['rows_p_sum_above_1.5']:.1%} (max ΣP {row['p_sum_max']:.3g})",
                  flush=True)
    args.out.write_text(json.dumps({"config": args.config, "checkpoint": args.checkpoint, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
