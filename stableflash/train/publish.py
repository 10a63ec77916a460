"""The monitor's signals as scalars, for TensorBoard and Weights & Biases: what `monitor.jsonl` holds per layer and
head, summed up per layer so that a dashboard shows it at a glance (the JSON keeps every head)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def monitor_scalars(record: dict) -> dict[str, float]:
    """One monitor record (`Monitor.record`'s) as {name: value}: per layer, the shares of rows with a repeated
    maximum (and with a positive one), of biasable rows, P̄ = 1 entries per row and the largest score over its
    heads; with spectral norms, each layer's largest per matrix."""
    scalars = {}
    for layer, stats in enumerate(record.get("attention") or []):
        if not stats:
            continue
        rows = max(1, sum(stats["rows"]))
        prefix = f"attention/layer{layer}"
        scalars[f"{prefix}/repeated_max_rows"] = sum(stats["repeated_max_rows"]) / rows
        for name in ("repeated_max_rows_positive", "biasable_rows"):
            if name in stats:
                scalars[f"{prefix}/{name}"] = sum(stats[name]) / rows
        scalars[f"{prefix}/pbar_ones_per_row"] = sum(stats["pbar_ones"]) / rows
        scalars[f"{prefix}/max_score"] = max(stats["max_score"])
    for matrix, layers in (record.get("spectral") or {}).items():
        for layer, heads in enumerate(layers):
            scalars[f"spectral/{matrix}/layer{layer}"] = max(heads)
    return scalars


class Publisher:
    """Scalars to TensorBoard (a `SummaryWriter` under `log_dir / "tb"`, with `tensorboard`) and to the W&B run in
    progress (with `wandb`: `wandb.init` is the caller's; without a run nothing is sent)."""

    def __init__(self, log_dir: Path | None, *, tensorboard: bool = False, wandb: bool = False):
        self.writer = None
        if tensorboard:
            if log_dir is None:
                raise ValueError("tensorboard: needs a log_dir to write into")
            if importlib.util.find_spec("tensorboard") is None:
                raise ImportError("tensorboard: the `tensorboard` package is missing; pip install 'stableflash[logging]'")
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(Path(log_dir) / "tb"))
        self.wandb = None
        if wandb:
            if importlib.util.find_spec("wandb") is None:
                raise ImportError("wandb: the `wandb` package is missing; pip install wandb")
            import wandb as module
            self.wandb = module

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb is not None and self.wandb.run is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
