"""The early-warning monitor replayed over many finished runs: lead time before each loss blow-up and
each first gradient explosion, and how often it warns on runs that have neither (false positives);
each rule alone at several thresholds.

Every folder under the given roots that holds a metrics.jsonl is one run (unpack the committed
runs.tar.xz archives first). A blow-up is `blowup_step`'s: after the warm-up, a non-finite loss or
one that stays >= the best so far + 1.0 for 10 steps; a healthy run is "calm" if no gradient norm
exceeded 100 either (clipping hides such explosions from the loss). Warnings during the warm-up are counted apart:
the logits and the gradient norm grow fastest there on every run.

    python research/warning_study.py results/repro-bf16-4l/sweep-06/runs results/repro-bf16-4l/sweep-07/runs \\
        results/repro-bf16-4l/isolation-bf16-lr3e-2 \\
        --out results/repro-bf16-4l/warning-study.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections import Counter
from pathlib import Path

from stableflash.diagnose.warnings import first_gradient_explosion, gradient_explosions, replay_warnings, warmup_of
from stableflash.train.config import load_config

# each signal alone, at its default threshold and stricter ones: can any threshold tell the runs apart?
CALIBRATION = [("max_logit", {"logit_warn_factor": f}) for f in (3, 10, 30)] + \
              [("grad_norm", {"grad_warn_factor": f}) for f in (10, 30, 100)] + \
              [("repeated_max", {"warn_factor": f, "warn_min_fraction": m}) for f, m in ((3, 0.05), (3, 0.2), (5, 0.3))] + \
              [("score_resolution", {"score_ulp_warn": f}) for f in (2, 4, 8, 16)]
LEVEL_SIGNALS = {"score_resolution"}


def calibrate(runs: list[Path], rows: list[dict]) -> list[dict]:
    """Per signal and threshold, against two outcomes (the loss blow-up, and the first gradient explosion):
    failing runs it warned at or before the outcome, the other runs it warned at all, and the median lead.
    The jump rules count from the end of the warm-up (they fire on every run during it); the level rule
    (score_resolution, once per head) counts from the start. `rows`: `study`'s, one per run."""
    outcomes = {run: {"blowup": row["blowup_step"], "explosion": first_gradient_explosion(run)} for run, row in zip(runs, rows)}
    warmups = {run: row["warmup"] for run, row in zip(runs, rows)}
    monitors = {run: load_config(run / "config.toml").monitor for run in runs}
    table = []
    for signal, changes in CALIBRATION:
        warned = {}
        for run in runs:
            replay = replay_warnings(run, dataclasses.replace(monitors[run], **changes))
            start = 0 if signal in LEVEL_SIGNALS else warmups[run]
            warned[run] = [w["step"] for w in replay.warnings if w["step"] > start and w["signal"] == signal]
        row = {"signal": signal, **changes}
        for outcome in ("blowup", "explosion"):
            failing = [r for r in runs if outcomes[r][outcome] is not None]
            others = [r for r in runs if outcomes[r][outcome] is None]
            leads = [outcomes[r][outcome] - warned[r][0] for r in failing
                     if warned[r] and warned[r][0] <= outcomes[r][outcome]]
            row[outcome] = {"caught": f"{len(leads)}/{len(failing)}",
                            "false_alarms": f"{sum(bool(warned[r]) for r in others)}/{len(others)}",
                            "lead_steps_median": statistics.median(leads) if leads else None}
        table.append(row)
    return table


def study(roots: list[Path]) -> dict:
    runs = sorted({p.parent for root in roots for p in root.rglob("metrics.jsonl")})
    if not runs:
        raise FileNotFoundError(f"roots: no run folders (with metrics.jsonl) under {[str(r) for r in roots]}")
    rows = []
    for run in runs:
        replay = replay_warnings(run)
        warmup = warmup_of(run)
        after = [w for w in replay.warnings if w["step"] > warmup]
        rows.append({"run": str(run), "warmup": warmup, "blowup_step": replay.blowup_step,
                     "grad_spike_steps": gradient_explosions(run, warmup=warmup)["grad_spike_steps"],
                     "warnings_in_warmup": len(replay.warnings) - len(after), "warnings_after_warmup": len(after),
                     "signals_after_warmup": dict(Counter(w["signal"] for w in after)),
                     "first_warning_after_warmup": after[0]["step"] if after else None,
                     "lead_steps": (replay.blowup_step - after[0]["step"]) if replay.blowup_step is not None and after
                     and after[0]["step"] <= replay.blowup_step else None})
    failing = [r for r in rows if r["blowup_step"] is not None]
    healthy = [r for r in rows if r["blowup_step"] is None]
    calm = [r for r in healthy if r["grad_spike_steps"] == 0]  # not even a gradient explosion that clipping hid
    leads = [r["lead_steps"] for r in failing if r["lead_steps"] is not None]
    return {"runs": len(rows), "blowups": len(failing), "warned_before_blowup": len(leads),
            "lead_steps_median": statistics.median(leads) if leads else None,
            "lead_steps_range": [min(leads), max(leads)] if leads else None,
            "healthy": len(healthy), "healthy_warned_after_warmup": sum(r["warnings_after_warmup"] > 0 for r in healthy),
            "healthy_signals": dict(sum((Counter(r["signals_after_warmup"]) for r in healthy), Counter())),
            "calm": len(calm), "calm_warned_after_warmup": sum(r["warnings_after_warmup"] > 0 for r in calm),
            "calibration": calibrate(runs, rows), "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = study(args.roots)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{result['runs']} runs; {result['blowups']} blow-ups, {result['warned_before_blowup']} warned before "
          f"(after the warm-up); lead steps median {result['lead_steps_median']}, range {result['lead_steps_range']}")
    print(f"{result['healthy']} healthy runs; {result['healthy_warned_after_warmup']} warned after the warm-up "
          f"(false positives); their signals: {result['healthy_signals']}")
    print(f"{result['calm']} of them calm (no gradient norm above 100 either); {result['calm_warned_after_warmup']} "
          "of those warned after the warm-up")
    for row in result["calibration"]:
        print(f"  {row}")


if __name__ == "__main__":
    main()
