"""Atomic checkpoints: write to a temporary file, fsync, then rename over the old one.

A kill at any moment leaves either the previous checkpoint or the new one, never
a torn file. Holds model and optimizer state, RNG states, the step and the data cursor.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

CHECKPOINT = "checkpoint.pt"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    # a checkpoint loaded with map_location="cuda" holds these on the GPU; the setters take CPU byte tensors
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_checkpoint(run_dir: Path, payload: dict, name: str = CHECKPOINT) -> Path:
    """Atomically write `payload` to run_dir/name."""
    path = Path(run_dir) / name
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def load_checkpoint(run_dir: Path, name: str = CHECKPOINT, map_location="cpu") -> dict:
    path = Path(run_dir) / name
    if not path.exists():
        raise FileNotFoundError(f"--resume: no {name} in {run_dir}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as error:  # torch raises several types for a torn or foreign file
        raise ValueError(f"checkpoint: {path} is not a readable checkpoint (empty, truncated or not one: "
                         f"{type(error).__name__}); restore an intact copy or start the run again") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"checkpoint: {path} holds no training state (no step); is it a checkpoint written by "
                         "stableflash train?")
    return state
