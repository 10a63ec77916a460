"""Spectral norms of W_Q/W_K/W_V/W_O per layer and head over a run (the seed's Figures 3 and 11).

Read from the training monitor's `monitor.jsonl`; nothing is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stableflash.diagnose.record import Record
from stableflash.train.records import read_jsonl


@dataclass
class SpectralHistory(Record):
    run: str
    steps: list
    norms: dict
    """{"q"|"k"|"v"|"o": [step][layer][head]}."""
    repeated_max_share: list
    """Share of query rows with repeated maxima at each monitored step (all layers)."""

    def peak(self, matrix: str = "q") -> float:
        return max((max(max(row) for row in step) for step in self.norms.get(matrix, [])), default=float("nan"))


def spectral_history(run_dir: str | Path) -> SpectralHistory:
    run_dir = Path(run_dir)
    path = run_dir / "monitor.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"run_dir: {run_dir} has no monitor.jsonl (train with monitor.interval > 0)")
    records = [r for r in read_jsonl(path) if "spectral" in r]
    norms = {name: [r["spectral"][name] for r in records] for name in ("q", "k", "v", "o") if records and
             name in records[0]["spectral"]}
    share = []
    for r in records:
        stats = [s for s in r.get("attention", []) if s]
        rows = sum(sum(s["rows"]) for s in stats)
        share.append(sum(sum(s["repeated_max_rows"]) for s in stats) / rows if rows else 0.0)
    return SpectralHistory(run=str(run_dir), steps=[r["step"] for r in records], norms=norms, repeated_max_share=share)
