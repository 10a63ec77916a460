"""What a benchmark script records about its run, and how it reads `--shapes`: shared by the scripts in this folder."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from pathlib import Path

import torch


def parse_shapes(text: str | None, default) -> list[tuple[int, ...]]:
    """`"B,H,T,D;B,H,T,D"` as tuples of ints; `default` when none are given."""
    if not text:
        return list(default)
    return [tuple(int(x) for x in shape.split(",")) for shape in text.split(";")]


def commit() -> str | None:
    """`STABLEFLASH_COMMIT` (the GPU machine gets a copy of the working tree, not the repository), else the HEAD of
    the checkout these scripts run from, else None."""
    if os.environ.get("STABLEFLASH_COMMIT"):
        return os.environ["STABLEFLASH_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def package_source() -> str | None:
    """Where the `stableflash` this run imports lives: relative to the checkout these scripts run from
    (`stableflash`, or another tree's `git archive` that PYTHONPATH put first), else absolute; None if not found."""
    spec = importlib.util.find_spec("stableflash")
    if spec is None or not spec.origin:
        return None
    folder, checkout = Path(spec.origin).resolve().parent, Path(__file__).resolve().parents[1]
    return str(folder.relative_to(checkout)) if folder.is_relative_to(checkout) else str(folder)


def run_meta() -> dict:
    """The GPU, torch, Triton, date and commit of this run, and where its `stableflash` came from (`commit` names the
    checkout, which is not the package's tree where PYTHONPATH put another first); a script adds its own fields with
    `|`."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
            "triton": triton_version, "date": time.strftime("%Y-%m-%d"), "commit": commit(),
            "package": package_source()}
