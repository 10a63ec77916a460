"""One isolation table over several seeds: `stableflash isolate` run once per seed into ROOT/seed*/.

Re-summarises every experiment from its logs, so a change of the divergence rule applies to old
runs (unpack the committed runs.tar.xz into ROOT first). Writes ROOT/isolation-seeds.json (rows
plus each run's loss curve, repeated-max share and per-head W_Q spectral norms: what
`research/plot_results.py` draws) and ROOT/isolation-seeds.md (the table RESULTS.md quotes).

    python research/isolation_table.py results/repro-bf16-4l/isolation-bf16-lr3e-2 --layer 1
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from stableflash.diagnose.isolate import EXPERIMENTS, summarise
from stableflash.diagnose.spectral import spectral_history
from stableflash.train.records import read_jsonl


def _rounded(nested):
    return [_rounded(x) for x in nested] if isinstance(nested, list) else round(nested, 3)


def combine(root: Path, layer: int) -> dict:
    seeds = sorted(root.glob("seed*"), key=lambda p: int(p.name[4:]))
    if not seeds:
        raise FileNotFoundError(f"ROOT: no seed*/ folders in {root}")
    rows = []
    for name in EXPERIMENTS:
        runs = [(int(s.name[4:]), s / name) for s in seeds if (s / name / "metrics.jsonl").exists()]
        if not runs:
            continue
        per_seed = []
        for seed, run in runs:
            metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
            losses, grads = [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]
            stride = max(1, len(losses) // 150)
            history = spectral_history(run)
            per_seed.append({"seed": seed, **summarise(name, run), "loss_curve": {"stride": stride, "values": losses[::stride]},
                             # the largest in each window: a spike must not fall between the samples
                             "grad_norm_max": {"stride": stride, "values": [max(grads[i:i + stride])
                                                                            for i in range(0, len(grads), stride)]},
                             "monitor": {"steps": history.steps, "repeated_max_share": history.repeated_max_share,
                                         "wq_spectral_norm": _rounded(history.norms["q"])}})
        rows.append({"experiment": name, "what": EXPERIMENTS[name][0], "runs": per_seed})
    return {"root": str(root), "seeds": [int(s.name[4:]) for s in seeds], "layer": layer, "rows": rows}


def to_markdown(table: dict) -> str:
    fp32 = next((r for r in table["rows"] if r["experiment"] == "fp32"), None)
    fp32_mean = statistics.fmean(run["final_loss"] for run in fp32["runs"]) if fp32 else None
    lines = ["| experiment | what changes | diverged | final loss per seed | mean − fp32 | steps with gradient norm > 100 "
             "per seed | peak W_Q σ₁ (median) | repeated-max rows (median of peaks) |", "|---|---|---|---|---|---|---|---|"]
    for row in table["rows"]:
        runs = row["runs"]
        diverged = [f"s{r['seed']}@{r['divergence_step']}" for r in runs if r["diverged"]]
        finals = " / ".join(f"{r['final_loss']:.2f}" for r in runs)
        gap = "-" if fp32_mean is None else f"{statistics.fmean(r['final_loss'] for r in runs) - fp32_mean:+.2f}"
        spikes = " / ".join(str(r["grad_spike_steps"]) for r in runs)
        lines.append(f"| {row['experiment']} | {row['what']} | {len(diverged)}/{len(runs)} {' '.join(diverged)} | "
                     f"{finals} | {gap} | {spikes} | {statistics.median(r['peak_wq_spectral_norm'] for r in runs):.0f} | "
                     f"{statistics.median(r['peak_repeated_max_share'] for r in runs):.0%} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--layer", type=int, required=True, help="the layer L the isolation ran with (`isolate --layer`)")
    args = parser.parse_args()
    table = combine(args.root, args.layer)
    (args.root / "isolation-seeds.json").write_text(json.dumps(table))
    markdown = to_markdown(table)
    (args.root / "isolation-seeds.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
