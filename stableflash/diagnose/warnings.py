"""Replay the monitor's early-warning rules over a finished run's logs: when would it have warned,
when did the loss blow up, and how many steps of warning did that give (the lead time)?

Uses the run's metrics.jsonl (loss, gradient norm every step) and monitor.jsonl (per-head
statistics every `monitor.interval` steps), so rules and thresholds can be changed after the fact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from stableflash.diagnose.record import Record
from stableflash.train.config import MonitorConfig, load_config
from stableflash.train.monitor import HeadCount, Monitor
from stableflash.train.records import read_jsonl


@dataclass
class WarningReplay(Record):
    run: str
    warnings: list
    """[{"step", "signal", ...}] as the monitor would have logged them."""
    blowup_step: int | None
    """First step after the warm-up whose loss is non-finite or stays >= the best loss so far + `blowup_margin`."""
    blowup_margin: float
    first_warning_step: int | None
    lead_steps: int | None
    """blowup_step - first warning at or before it (None without both)."""


def blowup_step(losses: list[tuple[int, float]], margin: float = 1.0, *, after: int = 0, window: int = 10) -> int | None:
    """The first step after `after` whose loss is non-finite, or from which `window` losses in a row
    (fewer at the end of the run) all stay >= the best loss before it + `margin` (None: no blow-up).

    The window and `after` (the warm-up) keep the one-step spikes of early training, which recover
    at the next step, from counting as the failure the reproduction looks for."""
    best = math.inf
    for i, (step, loss) in enumerate(losses):
        if step > after:
            if not math.isfinite(loss):
                return step
            ahead = [x for _, x in losses[i:i + window]]
            if all(not math.isfinite(x) or x >= best + margin for x in ahead):
                return step
        best = min(best, loss)
    return None


def _layer_scores_formats(cfg) -> list:
    """Each layer's scores format as the run's config sets it (a monitor action that switched a layer
    mid-run is not followed)."""
    from stableflash.train.monitor import scores_format

    return [scores_format(cfg.attention.layer_attention(i).precision) for i in range(cfg.model.n_layer)]


def _run_config(run_dir: Path):
    """The run's TrainConfig, or None for a folder without its config.toml."""
    config = run_dir / "config.toml"
    return load_config(config) if config.exists() else None


def _warmup_steps(cfg) -> int:
    return cfg.optim.warmup_steps if cfg is not None else 0


def warmup_of(run_dir: Path) -> int:
    """The run's warm-up steps (0 for a folder without its config.toml)."""
    return _warmup_steps(_run_config(run_dir))


GRAD_SPIKE = 100.0
"""A gradient norm above this is an explosion: 100x the clip threshold of 1.0 our configs use. In the lr 3e-2
regime fp32 attention passed it on 1 step of 9 runs, bf16 attention reaches 1e4-1e10 (RESULTS.md)."""


def _grad_norms_after_warmup(run_dir: Path, warmup: int | None) -> list[tuple[int, float]]:
    warmup = warmup_of(run_dir) if warmup is None else warmup
    return [(m["step"], m["grad_norm"]) for m in read_jsonl(run_dir / "metrics.jsonl")
            if "grad_norm" in m and m["step"] > warmup]


def _explodes(norm: float, threshold: float) -> bool:
    return not math.isfinite(norm) or norm > threshold


def gradient_explosions(run_dir: str | Path, threshold: float = GRAD_SPIKE, *, warmup: int | None = None) -> dict:
    """After the warm-up (the run's own unless given): the largest gradient norm (before clipping) and how
    many steps exceeded `threshold`.

    Gradient clipping hides these from the loss: a run can explode hundreds of times and still train."""
    norms = [g for _, g in _grad_norms_after_warmup(Path(run_dir), warmup)]
    return {"peak_grad_norm": max(norms, default=math.nan),
            "grad_spike_steps": sum(_explodes(g, threshold) for g in norms),
            "steps_after_warmup": len(norms)}


def first_gradient_explosion(run_dir: str | Path, threshold: float = GRAD_SPIKE) -> int | None:
    """The first step after the warm-up whose gradient norm exceeds `threshold` (or is not finite)."""
    return next((step for step, g in _grad_norms_after_warmup(Path(run_dir), None) if _explodes(g, threshold)), None)


def replay_warnings(run_dir: str | Path, cfg: MonitorConfig | None = None, *, blowup_margin: float = 1.0) -> WarningReplay:
    """The monitor's rules (`cfg`, else the run's own monitor config, else the defaults) replayed over the logs."""
    run_dir = Path(run_dir)
    run_cfg = _run_config(run_dir)
    if cfg is None:
        cfg = run_cfg.monitor if run_cfg is not None else MonitorConfig()
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    monitor_log = read_jsonl(run_dir / "monitor.jsonl") if (run_dir / "monitor.jsonl").exists() else []
    monitor = Monitor(cfg, HeadCount(1), run_dir, enabled=False)
    warnings = []
    for m in metrics:
        event = monitor.check_grad(m["step"], m["grad_norm"])
        if event is not None:
            warnings.append(event)
    formats = _layer_scores_formats(run_cfg) if run_cfg is not None else None
    for record in monitor_log:
        for layer, stats in enumerate(record["attention"]):
            if stats is None:
                continue
            warnings += monitor.logit_events(record["step"], layer, stats["max_score"])
            if formats is not None:
                warnings += monitor.resolution_events(record["step"], layer, stats["max_score"], formats[layer])
            warnings += monitor.repeated_max_events(record["step"], layer, stats)
    warnings.sort(key=lambda e: e["step"])
    blowup = blowup_step([(m["step"], m["loss"]) for m in metrics], blowup_margin, after=_warmup_steps(run_cfg))
    before = [w["step"] for w in warnings if blowup is None or w["step"] <= blowup]
    first = before[0] if before else None
    return WarningReplay(run=str(run_dir), warnings=warnings, blowup_step=blowup, blowup_margin=blowup_margin,
                         first_warning_step=first,
                         lead_steps=(blowup - first) if blowup is not None and first is not None else None)
