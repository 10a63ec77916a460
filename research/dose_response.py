"""The dose-response study (docs/dose-response.md): every arm and seed trains at once, within a time budget, and
resumes from its checkpoint in the next call; `summarise` turns the runs into one JSON per arm, figures and the
verdict by the rule written before the run.

    python research/dose_response.py run --out OUT --budget-s 540 --steps 3000   # call again to continue every run
    python research/dose_response.py finish OUT --budget-s 240           # δ per arm, the first failure's isolation
    python research/dose_response.py summarise OUT                       # OUT/arms/*.json, figures, OUT/verdict.json
    python research/dose_response.py pack OUT dose.tgz                   # all of it but checkpoints and caches
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from study_runs import checkpoint_before, collect, dispatch, growth_layer, run_arms, run_commands, study_parser

PV_PATH = "pbar_operand,pv,acc_scaled,acc"


def _pv(fmt: str) -> list[str]:
    return [f"attention.sites.{site}={fmt}" for site in PV_PATH.split(",")]


ARMS = {
    "fp32": ["attention.precision=fp32"],
    "paper": ["attention.precision=paper"],
    "e8m4": ["attention.precision=paper", *_pv("e8m4")],
    "e8m3": ["attention.precision=paper", *_pv("e8m3")],
    "e8m4-sr": ["attention.precision=paper", *_pv("e8m4"), "attention.rounding=stochastic",
                f"attention.rounding_sites={PV_PATH}"],
    "e8m4-tz": ["attention.precision=paper", *_pv("e8m4"), "attention.rounding=toward_zero",
                f"attention.rounding_sites={PV_PATH}"],
    "e8m4-sfa": ["attention.precision=paper", *_pv("e8m4"), "attention.stabilize=sfa"],
    "e8m4-pv32": ["attention.precision=paper", "attention.pv_fp32=true", "attention.sites.pbar_operand=e8m4"],
}
FRACTION_BITS = {"e8m3": 3, "e8m4": 4, "paper": 7}
SHORTEST_HOLD = 500
"""A run that the budget stopped before this step, without diverging, counts as neither holding nor diverging."""
DELTA_STEPS = 10
"""Replayed steps over which `diagnose delta` sums δ's signed error, per arm and for the first failing run."""
ISOLATION = "baseline,pv-fp32,delta-dp-p,o-fp32,heads-fp32,sfa"
"""The seed's isolation from the first failing run's checkpoint (docs/dose-response.md says why these)."""
ISOLATION_MARGIN = 100
"""Steps each isolation experiment trains past the step at which its run diverged."""


def run(args) -> None:
    """Start or resume every (arm, seed) run not yet finished; stop them all with a checkpoint at the budget."""
    unknown = sorted(set(args.arms.split(",")) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; arms: {list(ARMS)}")
    runs = {f"{arm}-s{seed}": [*ARMS[arm], f"run.seed={seed}"] for arm in args.arms.split(",")
            for seed in args.seeds.split(",")}
    run_arms(args.out, runs, config=args.config, steps=args.steps, budget_s=args.budget_s, extra=args.set)


def verdict(arms: dict[str, list[dict]]) -> dict:
    """The training parts of docs/dose-response.md's rule (the signatures: `signatures`)."""
    def diverged(arm):
        return [r["first_divergence"] is not None for r in arms.get(arm, [])]

    def median_step(arm):
        steps = sorted(r["first_divergence"] for r in arms.get(arm, []) if r["first_divergence"] is not None)
        return steps[len(steps) // 2] if steps else None

    short = {arm: [r["steps"] for r in runs if r["first_divergence"] is None and r["steps"] < SHORTEST_HOLD]
             for arm, runs in arms.items()}
    parts = {
        "e8m4 diverges in >= 2 of 3": sum(diverged("e8m4")) >= 2,
        "e8m3 diverges in >= 2 of 3": sum(diverged("e8m3")) >= 2,
        "e8m3 before e8m4": (median_step("e8m3") is not None and median_step("e8m4") is not None
                             and median_step("e8m3") < median_step("e8m4")),
        **{f"{arm} holds in 3 of 3": len(diverged(arm)) == 3 and not any(diverged(arm)) and not short.get(arm)
           for arm in ("fp32", "e8m4-sr", "e8m4-sfa")},
    }
    return {"parts": parts, "training_parts_met": all(parts.values()),
            "median_first_divergence": {arm: median_step(arm) for arm in arms},
            "runs_stopped_short_without_divergence": {arm: s for arm, s in short.items() if s}}


COMMON_WINDOW = 20
"""Steps before the common step over which `at_common_step` reads each run's loss and gradient norm."""


def at_common_step(arms: dict[str, list[dict]]) -> dict:
    """Every run read at one step (added after the run, docs/dose-response.md says why): the last step that every
    run which trained at least SHORTEST_HOLD steps reached, since the runs trained unevenly far. Per run: diverged by
    then, the mean loss and the largest gradient norm over the COMMON_WINDOW steps before it, and the largest W_Q
    spectral norm of any head at the last monitor record up to it; None for a run that stopped before it."""
    reached = [r["steps"] for runs in arms.values() for r in runs if r["steps"] >= SHORTEST_HOLD]
    if not reached:
        return {}
    step = min(reached)
    window = slice(step - COMMON_WINDOW, step)

    def read(r: dict) -> dict | None:
        if r["steps"] < step:
            return None
        wq = [max(max(heads) for heads in s) for at, s in zip(r["monitor_steps"], r["wq_spectral"]) if at <= step]
        return {"run": r["run"], "diverged": r["first_divergence"] is not None and r["first_divergence"] <= step,
                "loss": sum(r["losses"][window]) / COMMON_WINDOW, "grad_norm_max": max(r["grad_norms"][window]),
                "wq_max": wq[-1] if wq else None}

    return {"step": step, "arms": {arm: [read(r) for r in runs] for arm, runs in arms.items()}}


def first_failure(arms: dict[str, list[dict]]) -> dict | None:
    """The nearest-rounding arms' run that diverged first, or None."""
    failing = [r for arm in ("e8m3", "e8m4", "paper") for r in arms.get(arm, []) if r["first_divergence"] is not None]
    return min(failing, key=lambda r: r["first_divergence"]) if failing else None


def _first_seed(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: r["run"])


def diagnosis_commands(out: Path, arms: dict[str, list[dict]]) -> list[str]:
    """For the first run to diverge (of the nearest-rounding arms): the signed cumulative δ error at the layer whose
    W_Q head grew most, and the seed's isolation, both from the checkpoint before its divergence."""
    first = first_failure(arms)
    if first is None:
        return []
    run = out / "runs" / first["run"]
    before = checkpoint_before(run, first["first_divergence"])
    layer = growth_layer(first)
    until = first["first_divergence"] + ISOLATION_MARGIN
    # no --replay: the isolation trains past the run's last recorded batch, and the batches are a pure function of
    # seed and step. Without a checkpoint before the divergence, the isolation trains from the same initialisation.
    isolate = (f"stableflash isolate --config {run / 'config.toml'} "
               + (f"--from-checkpoint {before} " if before else "")
               + f"--experiments {ISOLATION} --layer {layer} --jobs {len(ISOLATION.split(','))} "
               f"--set run.max_steps={until} --out {out / 'isolate'}")
    return [_delta_command(run, before, layer, out / "diagnose-delta"), isolate] if before else [isolate]


def _delta_command(run: Path, checkpoint: Path, layer: int, out: Path) -> str:
    """The signed cumulative δ error over DELTA_STEPS steps from `checkpoint`, under the run's own numerics."""
    return (f"stableflash diagnose delta --config {run / 'config.toml'} --checkpoint {checkpoint} --low config "
            f"--steps {DELTA_STEPS} --layer {layer} --out {out}")


def delta_commands(out: Path, arms: dict[str, list[dict]]) -> list[str]:
    """Per arm, for its first seed's run: the signed cumulative δ error at the layer whose W_Q head grew most (the
    sign of predictions 3 and 5), under the arm's own numerics, from its latest checkpoint, or from the last one
    before its divergence (none: the arm is left out)."""
    commands = []
    for arm, runs in arms.items():
        first = _first_seed(runs)
        run = out / "runs" / first["run"]
        diverged = first["first_divergence"] is not None
        # no --replay: after the last checkpoint the run recorded no batches; the trainer draws them as the run
        # would have (a pure function of seed and step)
        source = checkpoint_before(run, first["first_divergence"]) if diverged else run / "checkpoint.pt"
        if source is None:
            continue
        commands.append(_delta_command(run, source, growth_layer(first), out / "delta" / arm))
    return commands


def delta_at_growth_head(trace_path: Path, run: dict) -> dict | None:
    """A `diagnose delta` trace read at the run's fastest-growing W_Q head: its signed cumulative δ error, and
    which head of that layer has the largest one."""
    if not trace_path.exists() or run["wq_growth"] is None:
        return None
    trace = json.loads(trace_path.read_text())
    if not trace["cumulative"]:
        return None
    final = trace["cumulative"][-1]
    head = run["wq_growth"]["head"]
    return {"run": run["run"], "low": trace["low"], "layer": trace["layer"], "head": head, "steps": len(trace["steps"]),
            "cumulative": final[head], "largest_head": max(range(len(final)), key=final.__getitem__)}


def signatures(out: Path, arms: dict[str, list[dict]]) -> dict:
    """Prediction 5 on the first failing run (its δ trace from `finish`): a positive cumulative δ error at the head
    whose W_Q grew most, that head the one with the largest δ error, and rows with a repeated maximum in that head
    before the divergence (the monitor's count: more than one score within eps of a tile's maximum, where P̄ = 1
    repeats)."""
    first = first_failure(arms)
    if first is None:
        return {"status": "no failing run"}
    delta = delta_at_growth_head(out / "diagnose-delta" / "delta-trace.json", first)
    if delta is None:
        return {"status": "open: no δ trace of the first failing run", "run": first["run"]}
    layer, head = delta["layer"], delta["head"]
    before = [a for step, a in zip(first["monitor_steps"], first["attention"]) if step < first["first_divergence"]]
    repeated = sum(a[layer]["repeated_max_rows"][head] for a in before if a and a[layer])
    parts = {"positive cumulative δ error at the failing head": delta["cumulative"] > 0,
             "that head's W_Q grows most and has the largest δ error": delta["largest_head"] == head,
             "rows with a repeated maximum in that head": repeated > 0}
    return {"status": "measured", "run": first["run"], "delta": delta, "repeated_max_rows_before": repeated,
            "parts": parts, "met": all(parts.values())}


def summarise(args) -> None:
    arms = collect(args.out)
    (args.out / "arms").mkdir(exist_ok=True)
    for arm, runs in arms.items():
        (args.out / "arms" / f"{arm}.json").write_text(json.dumps(runs))
    measured = {arm: delta_at_growth_head(args.out / "delta" / arm / "delta-trace.json", _first_seed(runs))
                for arm, runs in arms.items()}
    isolation = args.out / "isolate" / "isolation.json"
    result = verdict(arms) | {"at_common_step": at_common_step(arms),
                              "signatures": signatures(args.out, arms), "delta_per_arm": measured,
                              "isolation": json.loads(isolation.read_text()) if isolation.exists() else None,
                              "diagnosis": diagnosis_commands(args.out, arms),
                              "delta_commands": delta_commands(args.out, arms)}
    result["reproduced"] = result["training_parts_met"] and result["signatures"].get("met", False)
    (args.out / "verdict.json").write_text(json.dumps(result, indent=2))
    print(f"{'arm':<12}{'seeds':>6}{'steps':>16}{'diverged at':>24}{'best loss':>22}")
    for arm, runs in arms.items():
        print(f"{arm:<12}{len(runs):>6}{str([r['steps'] for r in runs]):>16}"
              f"{str([r['first_divergence'] for r in runs]):>24}{str([round(r['best_loss'], 3) for r in runs]):>22}")
    print(json.dumps({"training": result["parts"], "signatures": result["signatures"].get("parts"),
                      "reproduced": result["reproduced"]}, indent=2))
    common = result["at_common_step"]
    if common:
        print(f"at step {common['step']} (post hoc): diverged / loss / largest gradient norm / largest W_Q norm, "
              f"over the {COMMON_WINDOW} steps before it")
        for arm, reads in common["arms"].items():
            cells = ["stopped before" if c is None else
                     f"{'D' if c['diverged'] else '-'} {c['loss']:.2f} {c['grad_norm_max']:5.1f} {c['wq_max'] or math.nan:5.2f}"
                     for c in reads]
            print(f"  {arm:<12}" + " | ".join(cells))
    for arm, delta in measured.items():
        if delta is not None:
            print(f"{arm:<12} cumulative δ error at layer {delta['layer']} head {delta['head']} over {delta['steps']} "
                  f"steps: {delta['cumulative']:+.3e} (largest at head {delta['largest_head']})")
    draw_figures(args.out, arms)


def finish(args) -> None:
    """After the last training call: every arm's δ trace, the first failing run's δ trace and isolation, all at once
    (one process each; the isolation trains its experiments side by side), stopped at the budget (a δ trace stopped
    early is lost; the isolation keeps what finished)."""
    arms = collect(args.out)
    run_commands([*delta_commands(args.out, arms), *diagnosis_commands(args.out, arms)], args.out / "finish-logs",
                 args.budget_s)


def draw_figures(out: Path, arms: dict[str, list[dict]]) -> Path:
    """OUT/dose-response.png: the loss, the first diverging step against fraction bits, and the W_Q norm of each
    run's fastest-growing head."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for arm, runs in arms.items():
        for i, r in enumerate(runs):
            axes[0].plot(range(1, len(r["losses"]) + 1), r["losses"], label=arm if i == 0 else None,
                         color=f"C{list(arms).index(arm)}", lw=0.8)
    axes[0].set(title="loss", xlabel="step", ylabel="loss")
    axes[0].legend(fontsize=7)
    for arm, bits in FRACTION_BITS.items():
        steps = [r["first_divergence"] for r in arms.get(arm, [])]
        axes[1].scatter([bits] * len(steps), [s if s is not None else math.nan for s in steps], label=arm)
        held = [r["steps"] for r, s in zip(arms.get(arm, []), steps) if s is None]
        axes[1].scatter([bits] * len(held), held, marker="^", facecolors="none", edgecolors="gray")
    axes[1].set(title="first diverging step (▲: held until)", xlabel="fraction bits of the P̄V path", ylabel="step")
    for arm, runs in arms.items():
        for i, r in enumerate(runs):
            if r["wq_growth"] is None:
                continue
            layer, head = r["wq_growth"]["layer"], r["wq_growth"]["head"]
            axes[2].plot(r["monitor_steps"], [s[layer][head] for s in r["wq_spectral"]], lw=0.8,
                         color=f"C{list(arms).index(arm)}", label=arm if i == 0 else None)
    axes[2].set(title="W_Q spectral norm of each run's fastest-growing head", xlabel="step")
    fig.tight_layout()
    fig.savefig(out / "dose-response.png", dpi=120)
    plt.close(fig)
    return out / "dose-response.png"


def main():
    parser, r, _ = study_parser(__doc__.splitlines()[0], finish_budget_s=240.0)
    r.add_argument("--arms", default=",".join(ARMS))
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--steps", type=int, default=3000, help="train every run to this step (a later call may raise it)")
    dispatch(parser.parse_args(), run=run, finish=finish, summarise=summarise)


if __name__ == "__main__":
    main()
