"""A failure-search sweep: a grid of (overrides x attention setting x seed) runs of one base config.

Each run trains on the embedded corpus and is summarised (loss curve, best and final
loss, whether it failed by the reproduction rule: final >= best + 1.0 or non-finite,
repeated-max share, peak W_Q spectral norm) into one JSON file, written after every
run so a time-out keeps what finished. `--budget-s` stops starting new runs.

    python research/sweep.py --out results/failure-search/sweep-01 --grid "optim.lr=1e-2;optim.lr=3e-2" \\
        --settings paper,fp32,sdpa --seeds 0,1,2 --set model.n_layer=4 ...
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from pathlib import Path

from stableflash.diagnose.pool import run_all
from stableflash.diagnose.spectral import spectral_history
from stableflash.diagnose.warnings import gradient_explosions
from stableflash.train.config import load_config
from stableflash.train.data import ensure_embedded
from stableflash.train.loop import train
from stableflash.train.records import read_jsonl

# The analysed attention and its controls run in the fused kernels' emulation (`triton`); `fp32` runs on
# the reference in one tile, as sweeps 01-07 ran it (the kernels' fp32-operand path was verified on a GPU only
# later; one tile keeps the reference fast, and fp32 has no rounding for tiling to change); `ref-paper` is the
# PyTorch reference of `paper`, as sweep 01 ran it.
SETTINGS = {
    "paper": ["attention.backend=triton", "attention.precision=paper", "attention.tiling=false"],
    "bf16": ["attention.backend=triton", "attention.precision=bf16", "attention.tiling=false"],
    "fa2": ["attention.backend=triton", "attention.precision=fa2"],
    "fp32": ["attention.backend=reference", "attention.precision=fp32", "attention.tiling=false"],
    "sdpa": ["attention.backend=sdpa", "attention.precision=fa2", "attention.tiling=true"],
    "paper-sfa": ["attention.backend=triton", "attention.precision=paper", "attention.tiling=false",
                  "attention.stabilize=sfa"],
    "paper-pv32": ["attention.backend=triton", "attention.precision=paper", "attention.tiling=false",
                   "attention.pv_fp32=true"],
    "ref-paper": ["attention.backend=reference", "attention.precision=paper", "attention.tiling=false"],
    "bf16-fwd-fa2": ["attention.backend=triton", "attention.precision=bf16", "attention.tiling=false",
                     "attention.forward_precision=fa2"],
}


def summarise(run_dir: Path) -> dict:
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    losses = [m["loss"] for m in metrics]
    finite = [x for x in losses if math.isfinite(x)]
    best = min(finite) if finite else math.nan
    final = losses[-1] if losses else math.nan
    history = spectral_history(run_dir)
    stride = max(1, len(losses) // 200)
    return {
        "steps": len(losses), "best_loss": best, "final_loss": final,
        "failed": (not math.isfinite(final)) or final >= best + 1.0,
        "loss_curve": {"stride": stride, "values": losses[::stride]},
        "repeated_max_share": {"steps": history.steps, "values": history.repeated_max_share},
        "peak_wq_spectral_norm": history.peak("q"), **gradient_explosions(run_dir),
        "events": [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "stop"],
    }


def run_one(task: dict) -> dict:
    """Train one (cell, setting, seed) and summarise it; an error or the spent budget becomes the row."""
    row = {"cell": task["cell"], "setting": task["setting"], "seed": task["seed"]}
    if time.time() > task["deadline"]:
        return {**row, "skipped": "budget reached before it started"}
    run_dir = Path(task["run_dir"])
    t0 = time.time()
    try:
        train(load_config(task["config"], task["overrides"]), run_dir)
        row.update(wall_s=time.time() - t0, **summarise(run_dir))
    except Exception as error:  # one broken setting must not lose the rest of the sweep
        row.update(error=f"{type(error).__name__}: {str(error)[:300]}", wall_s=time.time() - t0)
    if not task["keep"]:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:  # the logs are small; a checkpoint per run is not
        (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    return row


def describe(row: dict) -> str:
    head = f"{' '.join(row['cell']):<30} {row['setting']:<11} seed {row['seed']}:"
    if "skipped" in row or "error" in row:
        return f"{head} {'SKIPPED ' + row['skipped'] if 'skipped' in row else 'ERROR ' + row['error']}"
    return (f"{head} best {row['best_loss']:.3f} final {row['final_loss']:.3f} failed={row['failed']} "
            f"peakWq={row['peak_wq_spectral_norm']:.2f} grad>100 in {row['grad_spike_steps']} steps "
            f"(peak {row['peak_grad_norm']:.3g}) ({row['wall_s']:.0f}s)")


def verdicts(runs: list[dict], analysed: str, control: str) -> list[str]:
    """Per cell: how often each setting failed, and whether the cell meets the reproduction rule
    (the analysed setting fails in >= 2 of 3 seeds or more, the control in none)."""
    lines = []
    for cell in dict.fromkeys(tuple(r["cell"]) for r in runs):
        rows = [r for r in runs if tuple(r["cell"]) == cell and "failed" in r]
        counts, finals, spikes = {}, {}, {}
        for r in rows:
            failed, total = counts.get(r["setting"], (0, 0))
            counts[r["setting"]] = (failed + r["failed"], total + 1)
            finals.setdefault(r["setting"], []).append(r["final_loss"])
            spikes.setdefault(r["setting"], []).append(r.get("grad_spike_steps"))
        parts = [f"{setting} {failed}/{total} (mean final {sum(finals[setting]) / total:.2f}, "
                 f"steps with grad norm > 100: {spikes[setting]})" for setting, (failed, total) in counts.items()]
        lines.append(f"{' '.join(cell) or '(base)'}: failed " + ", ".join(parts))
        if analysed in counts and control in counts:
            (a_failed, a_total), (c_failed, c_total) = counts[analysed], counts[control]
            if min(a_total, c_total) < 3:
                verdict = "not decided (fewer than 3 seeds)"
            else:
                verdict = "MET" if 3 * a_failed >= 2 * a_total and c_failed == 0 else "not met"
            lines.append(f"  reproduction rule ({analysed} fails in >= 2/3, {control} in 0/3): {verdict}")
    return lines


def resummarise(out: Path) -> None:
    """Rows of OUT/sweep.json recomputed from the runs kept (--keep-runs) under OUT/runs, in place."""
    path = out / "sweep.json"
    results = json.loads(path.read_text())
    for i, row in enumerate(results["runs"]):
        run_dir = out / "runs" / f"{i:03d}-{row['setting']}-seed{row['seed']}"
        if (run_dir / "metrics.jsonl").exists():
            row.update(summarise(run_dir))
    path.write_text(json.dumps(results, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", default="quick-gpu")
    parser.add_argument("--grid", default="", help="cells separated by ';', overrides in a cell by ','")
    parser.add_argument("--settings", default="paper,fp32")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--budget-s", type=float, default=480, help="no run starts after this many seconds")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process")
    parser.add_argument("--keep-runs", action="store_true", help="keep each run's logs (not its checkpoint)")
    parser.add_argument("--verdict", default="paper:fp32", help="ANALYSED:CONTROL settings of the reproduction rule")
    parser.add_argument("--resummarise", action="store_true",
                        help="train nothing: summarise OUT's kept runs again (after the summary changed) and print the verdict")
    args = parser.parse_args()
    if args.resummarise:
        resummarise(args.out)
        print("\n".join(verdicts(json.loads((args.out / "sweep.json").read_text())["runs"], *args.verdict.split(":"))))
        return
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; expected names from {list(SETTINGS)}")
    data_dir = args.out / "data"
    ensure_embedded(data_dir)
    cells = [c.split(",") if c else [] for c in args.grid.split(";")]
    deadline = time.time() + args.budget_s
    results = {"command": "python research/sweep.py " + shlex.join(sys.argv[1:]), "runs": []}
    # seeds outermost within a cell: a budget cut then leaves every setting with the same seeds
    plan = [(cell, setting, int(seed)) for cell in cells for seed in args.seeds.split(",")
            for setting in args.settings.split(",")]
    tasks = [{"cell": cell, "setting": setting, "seed": seed, "config": args.config, "deadline": deadline,
              "keep": args.keep_runs, "run_dir": str(args.out / "runs" / f"{i:03d}-{setting}-seed{seed}"),
              "overrides": [*args.overrides, *cell, *SETTINGS[setting], f"run.seed={seed}", f"data.data_dir={data_dir}",
                            "run.progress=false", "run.checkpoint_interval=0"]}
             for i, (cell, setting, seed) in enumerate(plan)]
    finished = {}
    for index, row in run_all(run_one, tasks, args.jobs):
        finished[index] = row
        print(describe(row), flush=True)
        results["runs"] = [finished[i] for i in sorted(finished)]  # in plan order, whatever finished first
        (args.out / "sweep.json").write_text(json.dumps(results, indent=1))
    if any("skipped" in r for r in results["runs"]):
        results["stopped_early"] = f"budget of {args.budget_s} s reached"
        (args.out / "sweep.json").write_text(json.dumps(results, indent=1))
    print("\n".join(verdicts(results["runs"], *args.verdict.split(":"))))


if __name__ == "__main__":
    main()
