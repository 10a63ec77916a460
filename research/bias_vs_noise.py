"""The bias-against-noise study (docs/bias-vs-noise.md): the seed's condition built on purpose (V and P̄V in e8mN,
rounded to nearest: arm B) against the same rounding without bias (stochastic: arm C), every run training at once
to one step target, resumed call after call; then the failing B run's condition and errors from its checkpoint, and
the verdict by the rule written before the run.

    python research/bias_vs_noise.py run --out OUT --budget-s 540        # call again to continue every run
    python research/bias_vs_noise.py finish OUT --budget-s 200            # the failing run's condition and errors
    python research/bias_vs_noise.py summarise OUT                        # OUT/arms/*.json, figures, OUT/verdict.json
    python research/bias_vs_noise.py pack OUT study.tgz                   # all of it but checkpoints and caches
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from study_runs import checkpoint_before, collect, dispatch, growth_layer, run_arms, run_commands, study_parser


def _narrow(bits: int) -> list[str]:
    fmt = f"e8m{bits}"
    return ["attention.precision=paper", f"attention.sites.v_operand={fmt}", f"attention.sites.pv={fmt}"]


STOCHASTIC = ["attention.rounding=stochastic", "attention.rounding_sites=pv"]
ARMS = {  # name -> (seeds, overrides)
    "B4": ((0,), _narrow(4)),
    "C4": ((0,), [*_narrow(4), *STOCHASTIC]),
    "B3": ((0, 1, 2), _narrow(3)),
    "C3": ((0, 1, 2), [*_narrow(3), *STOCHASTIC]),
    "B3-sfa": ((0,), [*_narrow(3), "attention.stabilize=sfa-official"]),
    "B3-dpp": ((0,), [*_narrow(3), "attention.delta=dp_p"]),
    "paper": ((0,), ["attention.precision=paper"]),
    "fp32": ((0,), ["attention.precision=fp32"]),
}
STEPS = 400
"""The step target of every run (docs/bias-vs-noise.md)."""
ERROR_STEPS = 100
"""Consecutive replayed steps of `diagnose errors` (every micro-batch); a finish stopped by its budget keeps fewer."""
BIASABLE_SHARE = 1e-3
BIAS_ULPS = -0.1


def run(args) -> None:
    chosen = args.arms.split(",")
    unknown = sorted(set(chosen) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; arms: {list(ARMS)}")
    only = None if args.seeds is None else {int(s) for s in args.seeds.split(",")}
    runs = {f"{arm}-s{seed}": [*ARMS[arm][1], f"run.seed={seed}"] for arm in chosen for seed in ARMS[arm][0]
            if only is None or seed in only}
    run_arms(args.out, runs, config=args.config, steps=args.steps, budget_s=args.budget_s, extra=args.set)


def failing_b_run(arms: dict[str, list[dict]]) -> dict | None:
    """The B run that diverged first; else B3's first seed (the rule's signature is then read where B did not fail)."""
    failing = [r for arm in ("B3", "B4") for r in arms.get(arm, []) if r["first_divergence"] is not None]
    if failing:
        return min(failing, key=lambda r: r["first_divergence"])
    return min(arms.get("B3", []), key=lambda r: r["run"], default=None)


def _checkpoint(out: Path, run: dict) -> Path | None:
    folder = out / "runs" / run["run"]
    if run["first_divergence"] is not None:
        return checkpoint_before(folder, run["first_divergence"])
    return folder / "checkpoint.pt" if (folder / "checkpoint.pt").exists() else None


def finish_commands(out: Path, arms: dict[str, list[dict]]) -> list[str]:
    """From the failing B run's checkpoint before its divergence (or its last): the condition check at the layer of
    its fastest-growing W_Q head, by head, and `diagnose errors` there; the same errors for C3's first seed."""
    target = failing_b_run(arms)
    if target is None:
        return []
    commands, layer = [], growth_layer(target)
    arm = target["run"].rsplit("-s", 1)[0]
    bits = arm[1]
    eager = "--set run.compile=false"
    source = _checkpoint(out, target)
    if source is not None:
        config = out / "runs" / target["run"] / "config.toml"
        commands.append(f"stableflash diagnose condition --arms B{bits},C{bits} --heads 4 --config {config} "
                        f"--checkpoint {source} --layer {layer} {eager} --out {out / 'condition'}")
        commands.append(f"stableflash diagnose errors --config {config} --checkpoint {source} --layer {layer} "
                        f"--low config --steps {ERROR_STEPS} {eager} --out {out / 'errors' / target['run']}")
    contrast = min(arms.get(f"C{bits}", []), key=lambda r: r["run"], default=None)
    if contrast is not None and (contrast_source := _checkpoint(out, contrast)) is not None:
        config = out / "runs" / contrast["run"] / "config.toml"
        commands.append(f"stableflash diagnose errors --config {config} --checkpoint {contrast_source} "
                        f"--layer {layer} --low config --steps {ERROR_STEPS} {eager} "
                        f"--out {out / 'errors' / contrast['run']}")
    return commands


def finish(args) -> None:
    run_commands(finish_commands(args.out, collect(args.out)), args.out / "finish-logs", args.budget_s)


def _median(values):
    return statistics.median(values) if values else None


def signature(out: Path, run: dict | None) -> dict:
    """Prediction 4 at the failing B run's fastest-growing W_Q head: its biasable share in the monitor's records
    before the divergence (or all of them), and the measured bias on its biasable rows (`finish`'s condition)."""
    if run is None or run["wq_growth"] is None:
        return {"status": "no B run with spectral records"}
    layer, head = run["wq_growth"]["layer"], run["wq_growth"]["head"]
    end = run["first_divergence"] or math.inf
    records = [a[layer] for step, a in zip(run["monitor_steps"], run["attention"]) if step < end and a and a[layer]]
    rows = sum(r["rows"][head] for r in records)
    biasable = sum(r.get("biasable_rows", [0] * (head + 1))[head] for r in records)
    share = biasable / rows if rows else 0.0
    measured = None
    check = out / "condition" / "condition-checkpoint.json"
    arm = run["run"][:2]
    if check.exists():
        found = [r for r in json.loads(check.read_text())["rows"]
                 if r["arm"] == arm and r["group"] == "biasable" and r["head"] == head]
        measured = found[0] if found else {"n": 0}
    bias = measured["mean"]["mean"] if measured and measured.get("n") else None
    parts = {f"biasable share >= {BIASABLE_SHARE:.1%}": share >= BIASABLE_SHARE,
             f"measured bias <= {BIAS_ULPS} ulp": bias is not None and bias <= BIAS_ULPS}
    return {"status": "measured" if check.exists() else "open: no condition check of the failing run",
            "run": run["run"], "layer": layer, "head": head, "biasable_share_monitor": share,
            "measured": measured, "parts": parts, "met": all(parts.values())}


def verdict(out: Path, arms: dict[str, list[dict]], steps: int) -> dict:
    """docs/bias-vs-noise.md's rule."""
    def diverged(arm):
        return [r["first_divergence"] for r in arms.get(arm, []) if r["first_divergence"] is not None]

    def holds(arm):
        runs = arms.get(arm, [])
        return bool(runs) and all(r["first_divergence"] is None and r["steps"] >= steps for r in runs)

    b3, c3 = diverged("B3"), diverged("C3")
    b3_median, c3_median = _median(b3), _median(c3)
    earlier = b3_median is not None and (c3_median is None or b3_median <= 0.7 * c3_median)
    sig = signature(out, failing_b_run(arms))
    manipulation = out / "condition" / "verdict.json"
    check_passed = json.loads(manipulation.read_text())["passed"] if manipulation.exists() else None
    supported_parts = {
        "B3 diverges in >= 2 of 3": len(b3) >= 2,
        "C3 diverges in <= 1 of 3, or B3's median diverging step <= 0.7x C3's": len(c3) <= 1 or earlier,
        "B3 + SFA (official) holds to the target": holds("B3-sfa"),
        "B3 + δ = rowsum(dP ∘ P) holds to the target": holds("B3-dpp"),
        "the failing head's signature": sig.get("met", False),
    }
    refuted = (len(c3) >= max(len(b3), 1) and b3_median is not None and c3_median is not None
               and c3_median <= 1.1 * b3_median and check_passed is True)
    outcome = "supported" if all(supported_parts.values()) else "refuted" if refuted else "inconclusive"
    short = {r["run"]: r["steps"] for runs in arms.values() for r in runs
             if r["first_divergence"] is None and r["steps"] < steps}
    return {"outcome": outcome, "supported_parts": supported_parts, "refuted": refuted,
            "manipulation_check_on_the_gpu": check_passed, "signature": sig,
            "first_divergence": {arm: [r["first_divergence"] for r in runs] for arm, runs in arms.items()},
            "median_first_divergence": {"B3": b3_median, "C3": c3_median},
            "runs_stopped_short_without_divergence": short}


def summarise(args) -> None:
    arms = collect(args.out)
    (args.out / "arms").mkdir(exist_ok=True)
    for arm, runs in arms.items():
        (args.out / "arms" / f"{arm}.json").write_text(json.dumps(runs))
    result = verdict(args.out, arms, args.steps)
    result["errors"] = {p.parent.name: _errors_summary(json.loads(p.read_text()))
                        for p in sorted((args.out / "errors").glob("*/errors.json"))}
    (args.out / "verdict.json").write_text(json.dumps(result, indent=2))
    print(f"{'arm':<8}{'steps':>18}{'diverged at':>24}{'best loss':>26}")
    for arm, runs in arms.items():
        print(f"{arm:<8}{str([r['steps'] for r in runs]):>18}{str([r['first_divergence'] for r in runs]):>24}"
              f"{str([round(r['best_loss'], 3) for r in runs]):>26}")
    print(json.dumps({k: result[k] for k in ("outcome", "supported_parts", "refuted")}, indent=2))
    draw_figures(args.out, arms)


def _errors_summary(trace: dict) -> dict:
    """A `diagnose errors` trace in brief: steps measured, and per head the final cumulative δ error, its share on
    tied rows, its share from ℓ's rounding, and the last held-out W_Q drift along R."""
    if not trace["steps"]:
        return {"steps": 0}
    total = trace["cumulative_delta_error"][-1]
    tied = [sum(col) for col in zip(*trace["delta_error"]["tied"])]
    ell = [sum(col) for col in zip(*trace["delta_error_from_ell"])]
    return {"steps": len(trace["steps"]), "layer": trace["layer"], "cumulative_delta_error": total,
            "on_tied_rows": tied, "from_ell": ell,
            "wq_drift_along_r": trace["wq_drift_along_r"][-1] if trace["wq_drift_along_r"] else None}


def draw_figures(out: Path, arms: dict[str, list[dict]]) -> Path:
    """OUT/bias-vs-noise.png: loss per run, each run's fastest-growing W_Q head, and per run the largest share of
    biasable rows of any head at each monitored step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for index, (arm, runs) in enumerate(arms.items()):
        for i, r in enumerate(runs):
            style = dict(color=f"C{index}", lw=0.8, label=arm if i == 0 else None)
            axes[0].plot(range(1, len(r["losses"]) + 1), r["losses"], **style)
            if r["wq_growth"] is not None:
                layer, head = r["wq_growth"]["layer"], r["wq_growth"]["head"]
                axes[1].plot(r["monitor_steps"], [s[layer][head] for s in r["wq_spectral"]], **style)
            share = [max(b / max(n, 1) for layer in a if layer for b, n in
                         zip(layer.get("biasable_rows", []), layer["rows"])) if a else math.nan
                     for a in r["attention"]]
            axes[2].plot(r["monitor_steps"][:len(share)], share, **style)
    axes[0].set(title="loss", xlabel="step", ylabel="loss", ylim=(None, 8))
    axes[0].legend(fontsize=7)
    axes[1].set(title="W_Q spectral norm of each run's fastest-growing head", xlabel="step")
    axes[2].set(title="largest share of biasable rows in any head", xlabel="step", yscale="log")
    fig.tight_layout()
    fig.savefig(out / "bias-vs-noise.png", dpi=120)
    plt.close(fig)
    return out / "bias-vs-noise.png"


def main():
    parser, r, s = study_parser(__doc__.splitlines()[0], finish_budget_s=200.0)
    r.add_argument("--steps", type=int, default=STEPS)
    r.add_argument("--arms", default=",".join(ARMS))
    r.add_argument("--seeds", default=None, help="only these seeds of each arm's (default: each arm's own)")
    s.add_argument("--steps", type=int, default=STEPS)
    dispatch(parser.parse_args(), run=run, finish=finish, summarise=summarise)


if __name__ == "__main__":
    main()
