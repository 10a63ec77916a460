"""The `diagnose`, `isolate` and `report` sub-commands (thin: parse, call, save, print)."""

from __future__ import annotations

import json
from pathlib import Path


def _config(args):
    """The run's config, with --layer (and --head, where the command has one) checked against it before any work."""
    from stableflash.train.config import load_config

    cfg = load_config(args.config, args.overrides)
    layer, head = getattr(args, "layer", None), getattr(args, "head", None)
    if layer is not None and not 0 <= layer < cfg.model.n_layer:
        raise ValueError(f"--layer: expected 0..{cfg.model.n_layer - 1} (the model has {cfg.model.n_layer} layers), "
                         f"got {layer}")
    if head is not None and not 0 <= head < cfg.model.n_head:
        raise ValueError(f"--head: expected 0..{cfg.model.n_head - 1} (the model has {cfg.model.n_head} heads), "
                         f"got {head}")
    return cfg


def _low(args, cfg):
    """`--low` as (policy, stabilizer): a preset without one, or with `config` layer `--layer`'s attention as the
    run trains it."""
    if args.low != "config":
        return args.low, None
    attention = cfg.attention.layer_attention(args.layer)
    return attention.precision, attention.stabilize


def _delta(args) -> int:
    from stableflash.diagnose.delta import delta_trace, model_delta_errors, resumed_trainer

    cfg = _config(args)
    low, stabilize = _low(args, cfg)
    with resumed_trainer(cfg, args.checkpoint, args.replay) as trainer:
        x, y = next(iter(trainer.micro_batches(trainer.step)))
        errors = model_delta_errors(trainer.model, x, y, low, args.high, stabilize=stabilize)
    path = errors.save(args.out / "delta.json")
    for i, layer in enumerate(errors.layers):
        print(f"layer {i}: δ error sum per head " + " ".join(f"{v:+.3e}" for v in layer["sum"]))
    if args.steps > 0:
        trace = delta_trace(cfg, args.checkpoint, args.replay, args.steps, layer=args.layer, low=low, high=args.high,
                            stabilize=stabilize)
        print(f"δ trace over {args.steps} steps, layer {args.layer}: final cumulative sum per head "
              + " ".join(f"{v:+.3e}" for v in trace.cumulative[-1]))
        trace.save(args.out / "delta-trace.json")
    print(f"wrote {path.parent}")
    return 0


def _decompose(args) -> int:
    from stableflash.diagnose.decompose import WqErrorDecomposition, WqErrorStudy, alignment_across_steps, decompose_head
    from stableflash.diagnose.delta import replayed_captures

    results, steps = [], []
    for step, capture in replayed_captures(_config(args), args.checkpoint, args.replay, args.steps, args.layer):
        d = decompose_head(capture, args.head, args.low, args.high)
        results.append(d.to_dict())
        steps.append(step)
        print(f"step {step}: residual {d.relative_residual:.2e}, top-direction share {d.top_singular_share:.3f}, "
              f"token cosine {d.token_cosine_mean:+.3f}, δ error mean {d.delta_error_mean:+.2e}")
    study = WqErrorStudy(layer=args.layer, head=args.head, low=args.low, high=args.high, steps=steps,
                         decompositions=results,
                         alignment=alignment_across_steps([WqErrorDecomposition(**r) for r in results]))
    print(f"alignment of the top direction across steps: {[round(a, 3) for a in study.alignment]}")
    study.save(args.out / "decompose.json")
    return 0


def _bias(args) -> int:
    from stableflash.diagnose.bias import bias_at_head, bias_attribution
    from stableflash.diagnose.mechanism import tied_maxima_inputs

    if args.checkpoint:
        if not args.config:
            raise ValueError("--config: needed with --checkpoint (the run's config)")
        head, result = bias_at_head(_config(args), args.checkpoint, layer=args.layer, head=args.head,
                                    policy=args.policy, replay=args.replay)
        print(f"bias of `{args.policy}` against fp64 at layer {args.layer}, head {head}, on the batch after "
              f"{args.checkpoint}, split by rounding site:")
    else:
        q, k, v, dout = tied_maxima_inputs(args.ties, heads=args.heads, keys=args.keys, seed=args.seed)
        result = bias_attribution(q, k, v, dout, args.policy)
        print(f"bias of `{args.policy}` against fp64 on {args.ties} tied maxima per row, split by rounding site:")
    print(result.to_markdown())
    result.save(args.out / "bias.json")
    return 0


def _errors(args) -> int:
    from stableflash.diagnose.errors import error_trace

    cfg = _config(args)
    low, stabilize = _low(args, cfg)
    path = args.out / "errors.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(trace):  # after every step: a call stopped early keeps what it measured
        path.write_text(json.dumps(trace.to_dict()))

    trace = error_trace(cfg, args.checkpoint, args.steps, layer=args.layer, low=low, high=args.high,
                        stabilize=stabilize, estimate_steps=args.estimate_steps, replay=args.replay, on_step=save)
    final = trace.cumulative_delta_error[-1]
    print(f"layer {args.layer}, {len(trace.steps)} steps, every micro-batch: cumulative δ error per head "
          + " ".join(f"{v:+.3e}" for v in final))
    tied = [sum(col) for col in zip(*trace.delta_error["tied"])]
    ell = [sum(col) for col in zip(*trace.delta_error_from_ell)]
    print("  of it on tied rows " + " ".join(f"{v:+.3e}" for v in tied) + "; from ℓ's rounding "
          + " ".join(f"{v:+.3e}" for v in ell))
    if trace.wq_drift_along_r:
        print(f"W_Q drift along R over {len(trace.wq_drift_along_r)} held-out steps per head "
              + " ".join(f"{v:+.3e}" for v in trace.wq_drift_along_r[-1]))
    print(f"wrote {path}")
    return 0


def _condition(args) -> int:
    from stableflash.diagnose.condition import PASS_RULE, captured_rows, condition_check, tied_rows, verdict

    arms = args.arms.split(",")
    check = condition_check(tied_rows(heads=args.heads, seed=args.seed), arms, causal=False,
                            source="synthetic tied rows (condition.tied_rows)", seed=args.seed)
    print(check.to_markdown())
    check.save(args.out / "condition-synthetic.json")
    outcome = verdict(check)
    print(f"\nmanipulation check: {'PASSED' if outcome['passed'] else 'FAILED'}")
    for reason in outcome["reasons"]:
        print(f"- {reason}")
    if args.checkpoint:
        if not args.config:
            raise ValueError("--config: needed with --checkpoint (the run's config)")
        cfg = _config(args)
        layers = None if args.layer is None else [args.layer]
        captured = condition_check(captured_rows(cfg, args.checkpoint, batches=args.batches, layers=layers), arms,
                                   causal=True, source=f"the rows of {args.checkpoint}"
                                   + ("" if args.layer is None else f", layer {args.layer}"), seed=args.seed,
                                   by_head=args.layer is not None)
        print("\n" + captured.to_markdown())
        captured.save(args.out / "condition-checkpoint.json")
    (args.out / "verdict.json").write_text(json.dumps({**outcome, "rule": PASS_RULE}, indent=1))
    return 0 if outcome["passed"] else 1


def _pv_trace(args) -> int:
    from stableflash.diagnose.mechanism import tied_maxima_inputs
    from stableflash.diagnose.pv_trace import pv_trace_from_attention

    q, k, v, _ = tied_maxima_inputs(args.ties, heads=1, keys=args.keys, seed=args.seed)
    trace = pv_trace_from_attention(q, k, v, row=args.row, feature=args.feature, causal=False)
    print(f"P̄V trace of row {trace.row}, feature {trace.feature}: final error {trace.error[-1]:+.3e}, "
          f"{len(trace.ones)} keys with P̄ = 1; the largest jump, at key {trace.largest_jump}:")
    print(trace.explanation_text)
    trace.save(args.out / "pv-trace.json")
    return 0


def _spectral(args) -> int:
    from stableflash.diagnose.spectral import spectral_history

    history = spectral_history(args.run)
    print(f"{len(history.steps)} monitored steps; peak W_Q spectral norm {history.peak('q'):.2f}")
    history.save(args.out / "spectral.json")
    return 0


def _isolate(args) -> int:
    from stableflash.diagnose.isolate import run_isolation

    table = run_isolation(args.config, args.out, experiments=args.experiments, replay=args.replay,
                          checkpoint=args.from_checkpoint, layer=args.layer, overrides=args.overrides,
                          jobs=args.jobs)
    print(table.to_markdown())
    return 0


def _report(args) -> int:
    from stableflash.diagnose.report import build_report

    print(f"wrote {build_report(args.runs, args.out)}")
    return 0


def _reproduce_micro(args) -> int:
    from stableflash.diagnose.micro import PREREGISTERED, MicroSetup, format_table, reproduce_micro

    if args.steps < 2:
        raise ValueError(f"--steps: expected an integer >= 2, got {args.steps}")
    arms = args.arms.split(",") if args.arms else list(PREREGISTERED)
    table = reproduce_micro(args.out, MicroSetup(steps=args.steps, seed=args.seed), arms)
    print(format_table(table))
    print(f"wrote {args.out / 'micro.json'} and {args.out / 'micro.png'}")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("reproduce", help="the seed's causal chain, reproduced")
    which = p.add_subparsers(dest="study", required=True)
    q = which.add_parser("micro", help="one attention head on the CPU: W_Q trained under each arm's numerics")
    q.add_argument("--out", type=Path, required=True, help="folder for micro.json and micro.png")
    q.add_argument("--steps", type=int, default=3000, help="AdamW steps per arm (default 3000)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--arms", default="", help="comma-separated arm names (default: the pre-registered ones; 'paper' is required; "
                   "also paper+l32, paper+fwd32, paper+bwd32)")
    q.set_defaults(func=_reproduce_micro)

    p = sub.add_parser("diagnose", help="the seed's analyses: delta, decompose, bias, pv-trace, spectral")
    which = p.add_subparsers(dest="diagnostic", required=True)

    def common(q, checkpoint=True):
        q.add_argument("--out", type=Path, required=True, help="folder for the JSON")
        if checkpoint:
            q.add_argument("--config", required=True)
            q.add_argument("--checkpoint", required=True, help="run folder or checkpoint.pt")
            q.add_argument("--replay", default=None, help="run folder whose batches.jsonl to replay")
            q.add_argument("--set", dest="overrides", action="append", default=[])
            q.add_argument("--low", default="paper", help="a preset (default paper); for delta also 'config': "
                           "layer --layer's attention as the config trains it, its stabilizer included")
            q.add_argument("--high", default="fp64")
            q.add_argument("--layer", type=int, default=0)

    q = which.add_parser("delta", help="δ_lp - δ_hp per layer and head; with --steps, its running sum over steps")
    common(q)
    q.add_argument("--steps", type=int, default=0)
    q.set_defaults(func=_delta)
    q = which.add_parser("errors", help="over replayed steps, every micro-batch: O and δ errors on tied and untied "
                         "rows, ℓ's share, the cumulative δ error, W_Q's drift along R estimated on held-out steps")
    common(q)
    q.add_argument("--steps", type=int, default=100)
    q.add_argument("--estimate-steps", type=int, default=None, help="steps that estimate R (default: half)")
    q.set_defaults(func=_errors)
    q = which.add_parser("decompose", help="W_Q gradient error as rank-1 terms, their similarity and alignment")
    common(q)
    q.add_argument("--head", type=int, default=0)
    q.add_argument("--steps", type=int, default=3)
    q.set_defaults(func=_decompose)
    for name, func, help_ in (("bias", _bias, "bias of O and δ split by rounding site (tied-maxima inputs)"),
                              ("pv-trace", _pv_trace, "cumulative P̄V error along the keys (tied-maxima inputs)")):
        q = which.add_parser(name, help=help_)
        common(q, checkpoint=False)
        q.add_argument("--ties", type=int, default=4)
        q.add_argument("--keys", type=int, default=256)
        q.add_argument("--seed", type=int, default=0)
        if name == "bias":
            q.add_argument("--policy", default="paper")
            q.add_argument("--heads", type=int, default=16)
            # or on a trained model's head instead of the synthetic tied rows
            q.add_argument("--config", default=None)
            q.add_argument("--checkpoint", default=None, help="run folder or checkpoint.pt: attribute on its head")
            q.add_argument("--replay", default=None)
            q.add_argument("--set", dest="overrides", action="append", default=[])
            q.add_argument("--layer", type=int, default=0)
            q.add_argument("--head", type=int, default=None, help="default: the layer's largest-W_Q-norm head")
        else:
            q.add_argument("--row", type=int, default=0)
            q.add_argument("--feature", type=int, default=0)
        q.set_defaults(func=func)
    q = which.add_parser("condition", help="the seed's condition: each arm's O bias against its noise on biasable "
                         "rows (synthetic, and a checkpoint's); exit 1 when the manipulation check fails")
    common(q, checkpoint=False)
    q.add_argument("--arms", default="B7,B6,B5,B4,B3,C4,C3,D4,D3", help="arms (docs/bias-vs-noise.md)")
    q.add_argument("--heads", type=int, default=8, help="heads of each synthetic batch")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--config", default=None)
    q.add_argument("--checkpoint", default=None, help="run folder or checkpoint.pt: its layers' rows too")
    q.add_argument("--set", dest="overrides", action="append", default=[])
    q.add_argument("--layer", type=int, default=None, help="one layer, split by head (default: every layer)")
    q.add_argument("--batches", type=int, default=1, help="steps whose first micro-batch to capture")
    q.set_defaults(func=_condition)
    q = which.add_parser("spectral", help="W_Q/K/V/O spectral norms per head from a run's monitor log")
    q.add_argument("run", type=Path)
    common(q, checkpoint=False)
    q.set_defaults(func=_spectral)

    p = sub.add_parser("isolate", help="the isolation experiments on one config, data and starting state")
    p.add_argument("--config", required=True)
    p.add_argument("--replay", default=None, help="run folder whose batches to replay")
    p.add_argument("--from-checkpoint", default=None)
    p.add_argument("--experiments", default="all")
    p.add_argument("--layer", type=int, default=0, help="the layer L of the per-layer and per-head experiments")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--jobs", type=int, default=1, help="experiments trained at once, each in its own process")
    p.set_defaults(func=_isolate)

    p = sub.add_parser("report", help="one HTML page of the figures and tables of run folders")
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("report.html"))
    p.set_defaults(func=_report)

