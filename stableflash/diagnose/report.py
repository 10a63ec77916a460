"""`stableflash report RUN_DIR...`: one self-contained HTML page of a study's figures and tables.

Everything is drawn from the files the runs and diagnostics wrote: metrics/monitor/events JSONL of each run (the
attention counters among them), and any `delta-trace.json`, `pv-trace.json`, `bias.json`, `decompose.json`,
`spectral.json`, `condition-*.json`, `errors.json` or `isolation.json` found in the given folders (headed by the
folder each sits in). Images are embedded, so the page travels alone.
"""

from __future__ import annotations

import base64
import html
import json
import tempfile
from pathlib import Path

from stableflash.diagnose import figures
from stableflash.diagnose.bias import BiasAttribution
from stableflash.diagnose.condition import ConditionCheck
from stableflash.diagnose.decompose import WqErrorStudy
from stableflash.diagnose.delta import DeltaTrace
from stableflash.diagnose.isolate import IsolationTable
from stableflash.diagnose.pv_trace import PVTrace
from stableflash.diagnose.spectral import SpectralHistory, spectral_history


def _markdown_table(text: str) -> str:
    rows = [line.strip().strip("|").split("|") for line in text.strip().splitlines() if not set(line) <= set("|-: ")]
    head, *body = rows
    cells = "".join(f"<th>{html.escape(c.strip())}</th>" for c in head)
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(c.strip().replace('**', ''))}</td>" for c in r) + "</tr>"
                    for r in body)
    return f"<table><tr>{cells}</tr>{lines}</table>"


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img src="data:image/png;base64,{data}" alt="{path.stem}"><figcaption>{path.stem}</figcaption></figure>'


def _where(path: Path, folder: Path) -> str:
    """A diagnostic file's folder relative to the reported folder: what tells two bias.json apart."""
    return str(Path(folder.name) / path.parent.relative_to(folder))


def build_report(run_dirs: list[str | Path], out: str | Path, title: str = "stableflash report") -> Path:
    run_dirs = [Path(r) for r in run_dirs]
    missing = [str(r) for r in run_dirs if not r.is_dir()]
    if missing:
        raise FileNotFoundError(f"RUN_DIR: not a folder: {missing}")
    runs = {r.name: r for r in run_dirs if (r / "metrics.jsonl").exists()}
    sections: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if runs:
            sections.append("<h2>Loss</h2>" + _img(figures.loss_curves(runs, tmp / "loss.png")))
        for name, run in runs.items():
            try:
                history = spectral_history(run)
            except FileNotFoundError:
                continue
            if history.steps:
                sections.append(f"<h2>{html.escape(name)}: spectral norms and repeated maxima</h2>"
                                + _img(figures.spectral_heatmap(history, tmp / f"{name}-spectral-q.png"))
                                + _img(figures.repeated_max_vs_loss(run, history, tmp / f"{name}-repeated-max.png")))
            counters = figures.attention_counters(run, tmp / f"{name}-counters.png")
            if counters is not None:
                sections.append(f"<h2>{html.escape(name)}: the SFA condition by sign, biasable rows</h2>"
                                + _img(counters))
        for folder in run_dirs:
            for path in sorted(folder.rglob("delta-trace*.json")):
                sections.append("<h2>δ error, cumulative</h2>"
                                + _img(figures.delta_cumsum(DeltaTrace.load(path), tmp / f"{path.stem}.png")))
            for path in sorted(folder.rglob("pv-trace*.json")):
                trace = PVTrace.load(path)
                sections.append("<h2>P̄V trace</h2>" + _img(figures.pv_error(trace, tmp / f"{path.stem}.png"))
                                + f"<pre>{html.escape(trace.explanation_text)}</pre>")
            for path in sorted(folder.rglob("bias*.json")):  # headed by folder: every one is named bias.json
                sections.append(f"<h2>Bias attribution ({html.escape(_where(path, folder))})</h2>"
                                + _markdown_table(BiasAttribution.load(path).to_markdown()))
            for path in sorted(folder.rglob("decompose*.json")):
                sections.append(f"<h2>W_Q gradient error, decomposed ({html.escape(_where(path, folder))})</h2>"
                                + _markdown_table(WqErrorStudy.load(path).to_markdown()))
            for path in sorted(folder.rglob("spectral*.json")):
                history = SpectralHistory.load(path)
                sections.append(f"<h2>Spectral norms ({html.escape(_where(path, folder))})</h2>"
                                + _img(figures.spectral_heatmap(history, tmp / f"{_where(path, folder)}-q.png"
                                                                .replace("/", "_"))))
            for path in sorted(folder.rglob("condition-*.json")):
                sections.append(f"<h2>The seed's condition ({html.escape(_where(path, folder))}, {path.stem})</h2>"
                                + _markdown_table(ConditionCheck.load(path).to_markdown().split("\n", 2)[2]))
            for path in sorted(folder.rglob("errors.json")):
                name = _where(path, folder).replace("/", "_")
                sections.append(f"<h2>Errors over training ({html.escape(_where(path, folder))})</h2>"
                                + _img(figures.error_trace(json.loads(path.read_text()), tmp / f"{name}-errors.png")))
            for path in sorted(folder.rglob("isolation.json")):
                sections.append(f"<h2>Isolation experiments ({html.escape(str(path.parent.name))})</h2>"
                                + _markdown_table(IsolationTable.load(path).to_markdown()))
        if not sections:
            raise ValueError(f"RUN_DIR: nothing to report in {[str(r) for r in run_dirs]} (no metrics.jsonl or "
                             "diagnostic JSON)")
        page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}img{{max-width:100%}}
pre{{font-size:11px;white-space:pre-wrap}}
table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #999;padding:3px 6px}}</style></head><body>
<h1>{html.escape(title)}</h1><p>Runs: {html.escape(', '.join(str(r) for r in run_dirs))}</p>
{''.join(sections)}</body></html>"""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out
