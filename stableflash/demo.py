"""`stableflash demo`: the main job on the embedded default data, on CPU.

1. the seed's bit-level addition example;
2. the synthetic mechanism table (bias of O and δ on rows with tied maxima), and
   that bias split by rounding site;
3. (with the training layer) a small GPT trained with two attention settings
   on the same replayed data, and a report with figures.
"""

from __future__ import annotations

import time
from pathlib import Path

from stableflash.train.records import read_jsonl

SEED_EXAMPLE = (-2.4071154594421387, -2.296875)


def run_demo(out: Path, train: bool = True) -> None:
    from stableflash.diagnose.mechanism import mechanism_table
    from stableflash.numerics import explain_add

    out.mkdir(parents=True, exist_ok=True)
    print("== 1. The seed's BF16 addition (section 3.4.4) ==")
    print(explain_add(*SEED_EXAMPLE))

    print("\n== 2. Bias on rows with k tied maxima: mean signed error vs fp64, 99% CI over rows ==")
    print("(V and dO of one sign; 'paper' = the analysed bf16 implementation, one tile)")
    table = mechanism_table()
    (out / "mechanism.json").write_text(table.to_json())
    (out / "mechanism.md").write_text(table.to_markdown() + "\n")
    print(table.to_markdown())
    print(f"\nwritten: {out / 'mechanism.json'}")

    from stableflash.diagnose.bias import bias_attribution
    from stableflash.diagnose.mechanism import tied_maxima_inputs
    print("\n== 2b. Where the bias comes from: the 'paper' policy's bias split by rounding site (4 tied maxima) ==")
    print("(each site turned to fp32 alone; a site's share is the bias it removes; 99% CI over rows)")
    attribution = bias_attribution(*tied_maxima_inputs(4), "paper")
    attribution.save(out / "bias.json")
    print(attribution.to_markdown())

    if train:
        print("\n== 3. Training: two attention settings on the same replayed data ==")
        train_demo(out)


SETTINGS = {
    "paper": ["attention.precision=paper"],
    "paper+SFA": ["attention.precision=paper", "attention.stabilize=sfa"],
}


def plot_runs(runs: dict[str, Path], out: Path) -> list[Path]:
    """Loss curves, W_Q spectral norms per head over steps, repeated-max rows against loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figures = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        metrics = read_jsonl(run / "metrics.jsonl")
        train_rows = [m for m in metrics if "loss" in m]
        ax.plot([m["step"] for m in train_rows], [m["loss"] for m in train_rows], label=f"{name} train", alpha=0.8)
        val = [m for m in metrics if "val_loss" in m]
        ax.plot([m["step"] for m in val], [m["val_loss"] for m in val], "o--", label=f"{name} val")
    ax.set(xlabel="step", ylabel="loss", title="Loss, same replayed batches")
    ax.legend()
    figures.append(out / "loss.png")
    fig.tight_layout()
    fig.savefig(figures[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 3.8), squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items()):
        monitor = read_jsonl(run / "monitor.jsonl")
        grid = np.array([np.array(m["spectral"]["q"]).ravel() for m in monitor]).T  # (L*H, passes)
        L, H = np.array(monitor[0]["spectral"]["q"]).shape
        im = ax.imshow(grid, aspect="auto", cmap="viridis",
                       extent=[monitor[0]["step"], monitor[-1]["step"], L * H - 0.5, -0.5])
        ax.set_yticks(range(L * H), [f"L{i // H}H{i % H}" for i in range(L * H)])
        ax.set(xlabel="step", title=f"{name}: W_Q spectral norm per head")
        fig.colorbar(im, ax=ax)
    figures.append(out / "spectral_norms.png")
    fig.tight_layout()
    fig.savefig(figures[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax2 = ax.twinx()
    for name, run in runs.items():
        monitor = read_jsonl(run / "monitor.jsonl")
        steps = [m["step"] for m in monitor]
        share = [sum(sum(s["repeated_max_rows"]) for s in m["attention"] if s) /
                 max(1, sum(sum(s["rows"]) for s in m["attention"] if s)) for m in monitor]
        line, = ax.plot(steps, share, label=f"{name} repeated-max rows")
        ax2.plot(steps, [m["loss"] for m in monitor], ":", color=line.get_color(), label=f"{name} loss")
        for event in read_jsonl(run / "events.jsonl"):
            if event.get("kind") == "warning":
                ax.axvline(event["step"], color=line.get_color(), alpha=0.3)
    ax.set(xlabel="step", ylabel="share of rows with repeated maxima", title="Repeated maxima (lines: warnings)")
    ax2.set_ylabel("loss")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    figures.append(out / "repeated_maxima.png")
    fig.tight_layout()
    fig.savefig(figures[-1], dpi=110)
    plt.close(fig)
    return figures


def write_report(runs: dict[str, Path], figures: list[Path], out: Path, notes: list[str]) -> Path:
    rows = []
    for name, run in runs.items():
        metrics = read_jsonl(run / "metrics.jsonl")
        losses = [m["loss"] for m in metrics if "loss" in m]
        val = [m["val_loss"] for m in metrics if "val_loss" in m]
        events = read_jsonl(run / "events.jsonl")
        rows.append(f"<tr><td>{name}</td><td>{len(losses)}</td><td>{losses[0]:.4f}</td><td>{losses[-1]:.4f}</td>"
                    f"<td>{val[-1] if val else float('nan'):.4f}</td>"
                    f"<td>{sum(e.get('kind') == 'warning' for e in events)}</td></tr>")
    images = "".join(f'<figure><img src="{f.name}" alt="{f.stem}"><figcaption>{f.stem}</figcaption></figure>'
                     for f in figures)
    html = f"""<!doctype html><html><head><meta charset="utf-8"><title>stableflash demo</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}img{{max-width:100%}}
table{{border-collapse:collapse}}td,th{{border:1px solid #999;padding:4px 8px}}</style></head><body>
<h1>stableflash demo</h1>
<p>{' '.join(notes)}</p>
<table><tr><th>setting</th><th>steps</th><th>first loss</th><th>last loss</th><th>last val loss</th><th>warnings</th></tr>
{''.join(rows)}</table>{images}</body></html>"""
    path = out / "report.html"
    path.write_text(html)
    return path


def train_demo(out: Path, steps: int = 600) -> Path:
    """Two small GPTs (bf16 `paper` attention, without and with SFA) on the same replayed batches, and the report
    page with its figures."""
    from stableflash.train.config import load_config
    from stableflash.train.data import ensure_embedded
    from stableflash.train.loop import train

    data_dir = out / "data"
    ensure_embedded(data_dir)
    runs = {}
    first = None
    started = time.time()
    for name, overrides in SETTINGS.items():
        cfg = load_config("tiny-cpu", [f"data.data_dir={data_dir}", f"run.max_steps={steps}", "run.progress=true",
                                       "model.n_embd=96", "model.n_head=2", "model.block_size=128",
                                       "optim.lr=1e-2", *overrides])
        run_dir = out / "runs" / name
        summary = train(cfg, run_dir, replay=first, overwrite=True)  # the demo's own folder: a rerun starts over
        first = first or run_dir
        runs[name] = run_dir
        losses = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
        print(f"{name:>10}: {summary['step']} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} ({summary['stop_reason']})")
    figures = plot_runs(runs, out)
    notes = [f"Two byte-level GPTs (2 layers, 2 heads of 48) on the embedded Shakespeare corpus, {steps} steps, "
             "lr 1e-2, the second replaying the first's batches; attention: the analysed bf16 implementation "
             "('paper' preset) without and with SFA.", f"Wall time {time.time() - started:.0f} s on CPU."]
    report = write_report(runs, figures, out, notes)
    print(f"report: {report} ({len(figures)} figures)")
    return report
