"""Redraw the committed GPU figures from their JSON (no GPU needed).

    python research/plot_results.py            # every figure under results/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"paper": "tab:red", "bf16": "tab:orange", "fa2": "tab:purple", "fp32": "tab:blue", "sdpa": "tab:green",
          "paper-sfa": "tab:brown", "paper-pv32": "tab:pink", "ref-paper": "darkred", "ref-fp32": "navy"}


def _save(fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_sweep(path: Path) -> Path:
    """Loss curves of every run, one panel per grid cell, colour by attention setting."""
    runs = [r for r in json.loads(path.read_text())["runs"] if "loss_curve" in r]
    cells = list(dict.fromkeys(" ".join(r["cell"]) or "base" for r in runs))
    fig, axes = plt.subplots(1, len(cells), figsize=(5.5 * len(cells), 4), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        seen = set()
        for r in runs:
            if (" ".join(r["cell"]) or "base") != cell:
                continue
            stride = r["loss_curve"]["stride"]
            values = r["loss_curve"]["values"]
            label = r["setting"] if r["setting"] not in seen else None
            seen.add(r["setting"])
            ax.plot([i * stride for i in range(len(values))], values, color=COLORS.get(r["setting"]), alpha=0.8,
                    lw=1, label=label)
        ax.set_title(f"{path.parent.name}: {cell}")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_ylim(0.8, 4.0)
        ax.legend(fontsize=8)
    out = path.with_suffix(".png")
    return _save(fig, out)


def plot_attention_bench(path: Path) -> Path | None:
    """Forward+backward TFLOP/s per shape and implementation: eagerly, and replayed from a CUDA graph where the run
    measured it (device time only; the small shape's eager figure is bound by host work). None for a file without
    one table (the repeat runs' file holds several runs)."""
    data = json.loads(path.read_text())
    if "rows" not in data:
        return None
    rows = data["rows"]
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(tuple(r["shape"]), r["impl"]): r for r in rows}
    columns = [("fwdbwd_tflops", "eager")]
    if any(r.get("fwdbwd_tflops_cudagraph") for r in rows):
        columns.append(("fwdbwd_tflops_cudagraph", "from a CUDA graph"))
    fig, axes = plt.subplots(len(columns), 1, figsize=(11, 4.5 * len(columns)), squeeze=False)
    width = 0.8 / len(impls)
    for ax, (column, how) in zip(axes[:, 0], columns):
        for i, impl in enumerate(impls):
            values = [by.get((s, impl), {}).get(column) or 0 for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], values, width, label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], [str(list(s)) for s in shapes])
        ax.set_ylabel("forward+backward TFLOP/s (causal, bf16)")
        ax.set_title(f"{path.name}: {data['meta'].get('gpu')}, {how}")
        ax.legend(fontsize=7, ncol=3)
    out = path.with_suffix(".png")
    return _save(fig, out)


def plot_probe_run(run: Path) -> Path:
    """Loss, gradient norm and the largest attention logit per layer of one training run folder."""
    import math

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = [m for m in metrics if "loss" in m]
    monitor = [json.loads(line) for line in (run / "monitor.jsonl").read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    axes[0].plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1)
    axes[0].set_title("training loss")
    axes[1].semilogy([m["step"] for m in metrics], [m["grad_norm"] if math.isfinite(m["grad_norm"]) else 1e38
                                                    for m in metrics], lw=1)
    axes[1].set_title("gradient norm before clipping (inf drawn at 1e38)")
    for layer in range(len(monitor[0]["attention"])):
        axes[2].semilogy([m["step"] for m in monitor], [max(m["attention"][layer]["max_score"]) for m in monitor],
                         marker="o", label=f"layer {layer}")
    axes[2].set_title("largest attention logit (scaled score)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("step")
    fig.suptitle(run.name)
    out = run.parent / f"{run.name}.png"
    return _save(fig, out)


def plot_multi_gpu(folder: Path) -> Path:
    """DDP on several GPUs: 1-vs-N loss curves, tokens/s per GPU, NCCL all-reduce bandwidth."""
    runs = [json.loads(path.read_text()) for path in sorted(folder.glob("multi-gpu-*.json"))]
    match = next(r["match"] for r in runs if "loss_1gpu" in r.get("match", {}))
    scaling = [(r["meta"]["commit"], row) for r in runs if "rows" in r.get("scaling", {}) for row in r["scaling"]["rows"]]
    allreduce = json.loads((folder / "allreduce-54930dd.json").read_text())["allreduce"]["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    n = next(k for k in match if k.startswith("loss_") and k != "loss_1gpu")
    axes[0].plot(match["loss_1gpu"], lw=2, color="tab:blue", label="1 GPU (grad accumulation)")
    axes[0].plot(match[n], lw=1, ls="--", color="tab:red", label=f"{n[5:]} (DDP, replayed batches)")
    axes[0].set_title(f"same global batch: {match['bit_identical_steps']}/{match['steps']} steps bit-identical")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend(fontsize=8)
    labels, values, colors = [], [], []
    for commit, row in scaling:
        kind = "1 GPU" if row["gpus"] == 1 else ("independent" if row.get("independent_runs") else "DDP")
        labels.append(f"{row['shape']}\n{kind} {row['gpus']}x ({commit})")
        values.append(row["tokens_per_s_per_gpu"] / 1e3)
        colors.append({"1 GPU": "tab:blue", "DDP": "tab:red", "independent": "tab:gray"}[kind])
    buckets = json.loads((folder / "ddp-overheads.json").read_text())["gpt2s_compiled_bucket_size"]
    for row in buckets["rows"]:
        labels.append(f"gpt2s-compiled\nDDP 2x, buckets of {row['run'][1:]} MB ({buckets['commit']})")
        values.append(row["median_tokens_per_s"] / 2 / 1e3)
        colors.append("tab:orange")
    axes[1].barh(range(len(values)), values, color=colors)
    axes[1].set_yticks(range(len(values)), labels, fontsize=6)
    axes[1].invert_yaxis()
    axes[1].set_xlabel("thousand tokens/s per GPU")
    axes[1].set_title("weak scaling (per-GPU batch fixed)")
    axes[2].semilogx([r["mib"] for r in allreduce], [r["busbw_gb_s"] for r in allreduce], marker="o")
    axes[2].set_xlabel("all-reduce size (MiB, fp32)")
    axes[2].set_ylabel("NCCL bus bandwidth (GB/s)")
    axes[2].set_title("all-reduce between the two H200s (P2P/CUMEM)")
    fig.suptitle(f"{folder.name}: {runs[0]['meta']['gpus']}", fontsize=9)
    return _save(fig, folder / "multi-gpu.png")


ISOLATION_CURVES = {"baseline": "tab:orange", "fp32": "tab:blue", "forward-fa2": "tab:green",
                    "backward-fa2": "tab:purple", "sfa": "tab:brown", "qk-clip": "tab:gray"}


def plot_isolation(path: Path) -> list[Path]:
    """The isolation table over seeds: final loss per experiment (a dot per seed); loss curves, repeated-max
    share and layer L's per-head W_Q spectral norms of the experiments that tell the story."""
    table = json.loads(path.read_text())
    rows = table["rows"]
    fp32 = [r["final_loss"] for row in rows if row["experiment"] == "fp32" for r in row["runs"]]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, row in enumerate(rows):
        finals = [min(r["final_loss"], 6.0) for r in row["runs"]]
        ax.scatter([i] * len(finals), finals, s=18, color=["tab:red" if r["diverged"] else "k" for r in row["runs"]])
    if fp32:
        ax.axhspan(min(fp32), max(fp32), color="tab:blue", alpha=0.2, label="fp32 attention (all seeds)")
    ax.set_xticks(range(len(rows)), [row["experiment"] for row in rows], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("final training loss (capped at 6)")
    ax.set_title(f"{path.parent.name}: one dot per seed, red: diverged by the rule")
    ax.legend(fontsize=8)
    outs = [_save(fig, path.with_suffix(".png"))]

    by_name = {row["experiment"]: row for row in rows}
    shown = [name for name in ISOLATION_CURVES if name in by_name]
    layer = table["layer"]
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.2))
    for name in shown:
        for k, run in enumerate(by_name[name]["runs"]):
            curve, stride = run["loss_curve"]["values"], run["loss_curve"]["stride"]
            label = name if k == 0 else None
            axes[0].plot([i * stride for i in range(len(curve))], curve, color=ISOLATION_CURVES[name], lw=0.8,
                         alpha=0.7, label=label)
            grads, gstride = run["grad_norm_max"]["values"], run["grad_norm_max"]["stride"]
            axes[3].semilogy([i * gstride for i in range(len(grads))], grads, color=ISOLATION_CURVES[name], lw=0.8,
                             alpha=0.7, label=label)
            m = run["monitor"]
            axes[1].plot(m["steps"], m["repeated_max_share"], color=ISOLATION_CURVES[name], lw=0.8, alpha=0.7,
                         label=label)
            if run["seed"] == 0:
                heads = list(zip(*(step[layer] for step in m["wq_spectral_norm"])))
                for h, norms in enumerate(heads):
                    axes[2].plot(m["steps"], norms, color=ISOLATION_CURVES[name], lw=0.8,
                                 label=name if h == 0 else None)
    axes[0].set_ylim(2.0, 5.0)
    axes[0].set_ylabel("training loss")
    axes[1].set_ylabel("share of query rows with a repeated maximum")
    axes[2].set_ylabel(f"W_Q spectral norm per head, layer {layer} (seed 0)")
    axes[3].set_ylabel("gradient norm before clipping (max per window)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    outs.append(_save(fig, path.with_name(path.stem + "-curves.png")))
    return outs


def plot_dose_response(folder: Path) -> Path:
    """The dose-response study's figure from its arms' JSON, as `research/dose_response.py summarise` draws it (the
    arms in the order of their runs' folders, as there)."""
    from dose_response import draw_figures

    arms = {p.stem: json.loads(p.read_text()) for p in (folder / "arms").glob("*.json")}
    return draw_figures(folder, dict(sorted(arms.items(), key=lambda arm: min(r["run"] for r in arm[1]))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    for path in sorted(args.results.glob("**/sweep-*/sweep.json")):
        print(plot_sweep(path))
    for path in sorted([*args.results.glob("attention-bench/*.json"), *args.results.glob("kernel-library/attention-*.json")]):
        if (figure := plot_attention_bench(path)) is not None:
            print(figure)
    for folder in sorted(p.parent for p in args.results.glob("**/multi-gpu-*/allreduce-*.json")):
        print(plot_multi_gpu(folder))
    for path in sorted(args.results.glob("**/isolation-*/isolation-seeds.json")):
        print(*plot_isolation(path), sep="\n")
    for run in sorted(p.parent for p in args.results.glob("**/probe-*/*/metrics.jsonl")):
        print(plot_probe_run(run))
    for folder in sorted(p.parent for p in args.results.glob("dose-response*/verdict.json")):
        print(plot_dose_response(folder))


if __name__ == "__main__":
    main()
