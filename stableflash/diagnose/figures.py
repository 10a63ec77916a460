"""Figures of the diagnostics, each drawn only from the JSON (or JSONL) a diagnostic wrote."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from stableflash.diagnose.delta import DeltaTrace  # noqa: E402
from stableflash.diagnose.pv_trace import PVTrace  # noqa: E402
from stableflash.diagnose.spectral import SpectralHistory  # noqa: E402
from stableflash.train.records import read_jsonl  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def loss_curves(runs: dict[str, Path], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, run in runs.items():
        metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
        ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss of each run")
    ax.legend(fontsize=8)
    return _save(fig, path)


def spectral_heatmap(history: SpectralHistory, path: Path, matrix: str = "q") -> Path:
    """Rows: (layer, head); columns: monitored steps; colour: spectral norm of that head's W block."""
    import numpy as np

    values = np.array(history.norms[matrix], dtype=float)  # (steps, layers, heads)
    steps, layers, heads = values.shape
    fig, ax = plt.subplots(figsize=(8, 0.25 * layers * heads + 1.5))
    image = ax.imshow(values.reshape(steps, layers * heads).T, aspect="auto", interpolation="nearest",
                      extent=(history.steps[0], history.steps[-1], layers * heads - 0.5, -0.5), cmap="magma")
    ax.set_yticks(range(layers * heads), [f"L{i // heads}H{i % heads}" for i in range(layers * heads)], fontsize=6)
    ax.set_xlabel("step")
    ax.set_title(f"W_{matrix.upper()} spectral norm per head: {Path(history.run).name}")
    fig.colorbar(image, ax=ax)
    return _save(fig, path)


def repeated_max_vs_loss(run: Path, history: SpectralHistory, path: Path) -> Path:
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    events = read_jsonl(run / "events.jsonl") if (run / "events.jsonl").exists() else []
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], color="tab:blue", lw=1)
    ax.set_ylabel("training loss", color="tab:blue")
    ax.set_xlabel("step")
    twin = ax.twinx()
    twin.plot(history.steps, history.repeated_max_share, color="tab:red", marker=".", lw=1)
    twin.set_ylabel("rows with repeated maxima", color="tab:red")
    warnings = sorted({e["step"] for e in events if e.get("kind") == "warning"})
    for i, step in enumerate(warnings):
        ax.axvline(step, color="tab:orange", ls="--", lw=0.8, label="early warning" if i == 0 else None)
    if warnings:
        ax.legend(fontsize=8)
    ax.set_title(f"repeated maxima against loss: {run.name}")
    return _save(fig, path)


def delta_cumsum(trace: DeltaTrace, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for head in range(len(trace.cumulative[0]) if trace.cumulative else 0):
        ax.plot(trace.steps, [row[head] for row in trace.cumulative], lw=1, label=f"head {head}")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cumulative Σ (δ_lp - δ_hp)")
    ax.set_title(f"δ error, layer {trace.layer}: {trace.low} - {trace.high}")
    ax.legend(fontsize=7, ncol=4)
    return _save(fig, path)


def pv_error(trace: PVTrace, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(range(len(trace.error)), trace.error, lw=1, label=f"{trace.format} - float64")
    for i, j in enumerate(trace.ones):
        ax.axvline(j, color="tab:red", lw=0.6, alpha=0.6, label="P̄ = 1" if i == 0 else None)
    ax.plot([trace.largest_jump], [trace.error[trace.largest_jump]], "ko", label="largest jump")
    ax.set_xlabel("key index")
    ax.set_ylabel("cumulative P̄V error")
    ax.set_title(f"P̄V trace: row {trace.row}, feature {trace.feature}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def attention_counters(run: Path, path: Path) -> Path | None:
    """The monitor's per-head counters over training: the SFA condition split by the repeated maximum's sign (the
    seed's Figure 13) and the share of biasable rows per (layer, head). None where the monitor recorded none."""
    import numpy as np

    records = [r for r in read_jsonl(run / "monitor.jsonl") if r.get("attention")]
    if not records:
        return None
    steps = [r["step"] for r in records]
    layers = len(records[0]["attention"])
    heads = max(len(a["rows"]) for a in records[0]["attention"] if a)

    def per_head(record, name):
        return [[(a.get(name, [0] * heads)[h] / max(a["rows"][h], 1)) if a else np.nan for h in range(heads)]
                for a in record["attention"]]

    repeated = np.array([per_head(r, "repeated_max_rows") for r in records])  # (steps, layers, heads)
    positive = np.array([per_head(r, "repeated_max_rows_positive") for r in records])
    biasable = np.array([per_head(r, "biasable_rows") for r in records])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.22 * layers * heads + 2.5))
    left.plot(steps, np.nanmean(positive, axis=(1, 2)), label="a positive maximum repeats (SFA: m = βm)")
    left.plot(steps, np.nanmean(repeated - positive, axis=(1, 2)), label="only maxima <= 0 repeat (SFA: m = 0)")
    left.set(xlabel="step", ylabel="share of rows (mean over heads)", title="the SFA condition by the maximum's sign")
    left.legend(fontsize=8)
    image = right.imshow(biasable.reshape(len(steps), layers * heads).T, aspect="auto", interpolation="nearest",
                         extent=(steps[0], steps[-1], layers * heads - 0.5, -0.5), cmap="viridis")
    right.set_yticks(range(layers * heads), [f"L{i // heads}H{i % heads}" for i in range(layers * heads)], fontsize=6)
    right.set(xlabel="step", title="share of biasable rows per head")
    fig.colorbar(image, ax=right)
    fig.suptitle(run.name)
    return _save(fig, path)


def error_trace(trace: dict, path: Path) -> Path:
    """A `diagnose errors` trace: the cumulative δ error per head over the replayed steps, and W_Q's drift along R on
    the held-out steps."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 3.5))
    heads = len(trace["cumulative_delta_error"][0]) if trace["steps"] else 0
    for head in range(heads):
        left.plot(trace["steps"], [row[head] for row in trace["cumulative_delta_error"]], lw=1, label=f"head {head}")
        held = trace["steps"][trace["estimate_steps"]:][:len(trace["wq_drift_along_r"])]
        right.plot(held, [row[head] for row in trace["wq_drift_along_r"]], lw=1, label=f"head {head}")
    for ax in (left, right):
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xlabel("step")
        ax.legend(fontsize=7, ncol=3)
    left.set(ylabel="cumulative Σ (δ_lp - δ_hp)", title=f"δ error, layer {trace['layer']}, every micro-batch: "
             f"{trace['low']} - {trace['high']}")
    right.set(ylabel="uᵀ (W_Q(t) - W_Q(t0)) v", title="W_Q's drift along R (estimated on the steps before)")
    return _save(fig, path)
