"""δ error per layer and head: δ_lp - δ_hp, where δ = rowsum(dO ∘ O) of two precision policies.

A positive, accumulating δ error is step 3 of the seed's causal chain (its Figure 5a).
`model_delta_errors` measures one batch; `delta_trace` follows the sum across
replayed training steps from a checkpoint.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from stableflash.attention.precision import Precision, resolve
from stableflash.attention.reference import forward_and_delta
from stableflash.diagnose.capture import capture_attention
from stableflash.diagnose.record import Record


def delta_error(q, k, v, dout, low: str | Precision, high: str | Precision = "fp64", *, stabilize=None,
                causal: bool = True) -> torch.Tensor:
    """(B, H, T) float64 δ_low - δ_high on the same inputs."""
    _, d_low = forward_and_delta(q, k, v, dout, causal=causal, policy=resolve(low), stabilize=stabilize)
    _, d_high = forward_and_delta(q, k, v, dout, causal=causal, policy=resolve(high))
    return d_low.double() - d_high.double()


def summarize(err: torch.Tensor) -> dict:
    """Per head: sum, mean and fraction positive over batch and tokens, and the first sequence's per-token errors."""
    return {"sum": err.sum(dim=(0, 2)).tolist(), "mean": err.mean(dim=(0, 2)).tolist(),
            "frac_positive": (err > 0).double().mean(dim=(0, 2)).tolist(), "per_token": err[0].tolist()}


@dataclass
class DeltaErrors(Record):
    """δ_low - δ_high for every layer and head of a model on one batch."""

    low: str
    high: str
    layers: list[dict]


def _name(policy: str | Precision, stabilize=None) -> str:
    name = policy if isinstance(policy, str) else policy.name
    return name if stabilize is None else f"{name}+{type(stabilize).__name__}"


def model_delta_errors(model, x, y, low: str | Precision = "paper", high: str = "fp64", *,
                       stabilize=None) -> DeltaErrors:
    """δ errors of every layer on batch (x, y): the model's own forward/backward gives q, k, v and dO; `low` runs
    with `stabilize`."""
    captures = capture_attention(model, x, y)
    model.zero_grad(set_to_none=True)
    return DeltaErrors(low=_name(low, stabilize), high=str(high),
                       layers=[summarize(delta_error(c.q, c.k, c.v, c.dout, low, high, stabilize=stabilize))
                               for c in captures])


@dataclass
class DeltaTrace(Record):
    """Per-step sum of δ_low - δ_high over a layer's tokens, per head, and its running sum (Figure 5a)."""

    low: str
    high: str
    layer: int
    steps: list[int]
    sums: list[list[float]]
    cumulative: list[list[float]]


@contextlib.contextmanager
def resumed_trainer(cfg, checkpoint: str | Path, replay: str | Path | None = None):
    """A Trainer at `checkpoint`'s state (a run folder or checkpoint.pt), in a scratch folder."""
    from stableflash.train.loop import Trainer

    checkpoint = Path(checkpoint)
    checkpoint = checkpoint / "checkpoint.pt" if checkpoint.is_dir() else checkpoint
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint: {checkpoint} does not exist")
    with tempfile.TemporaryDirectory() as work:
        shutil.copy(checkpoint, Path(work) / "checkpoint.pt")
        trainer = Trainer(cfg, work, resume=True, replay=replay)
        trainer.model.train()
        yield trainer


def replayed_captures(cfg, checkpoint: str | Path, replay: str | Path | None, steps: int, layer: int):
    """Resume training from `checkpoint` on `replay`'s batches for `steps` steps; before each step, yield
    (step, that layer's `LayerCapture` on the step's first micro-batch); the step is taken when iteration resumes."""
    if not 0 <= layer < cfg.model.n_layer:
        raise ValueError(f"layer: expected 0..{cfg.model.n_layer - 1}, got {layer}")
    with resumed_trainer(cfg, checkpoint, replay) as trainer:
        for step in range(trainer.step, trainer.step + steps):
            x, y = next(iter(trainer.micro_batches(step)))
            captured = capture_attention(trainer.model, x, y)[layer]
            trainer.model.zero_grad(set_to_none=True)
            yield step, captured
            trainer.train_step(step)


def delta_trace(cfg, checkpoint: str | Path, replay: str | Path | None, steps: int, *, layer: int = 0,
                low: str | Precision = "paper", high: str = "fp64", stabilize=None) -> DeltaTrace:
    """The layer's δ error summed per head on each replayed step's first micro-batch, and its running sum; `low`
    runs with `stabilize`."""
    step_ids, sums = [], []
    for step, c in replayed_captures(cfg, checkpoint, replay, steps, layer):
        sums.append(delta_error(c.q, c.k, c.v, c.dout, low, high, stabilize=stabilize).sum(dim=(0, 2)).tolist())
        step_ids.append(step)
    running = torch.tensor(sums, dtype=torch.float64).cumsum(0).tolist() if sums else []
    return DeltaTrace(low=_name(low, stabilize), high=high, layer=layer, steps=step_ids, sums=sums,
                      cumulative=running)
