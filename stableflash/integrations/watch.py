"""The trainer's monitor on any model: `stableflash.watch(model)`.

    with stableflash.watch(model, log_dir="runs/w", action="sfa") as w:
        for batch in data:
            loss = model(**batch).loss
            loss.backward(); opt.step(); opt.zero_grad()
            w.step(loss.item())          # the rules run on monitored steps; warnings come back

Every `interval` steps the watch arms per-layer `AttentionStats` (repeated-maximum rows, P̄ = 1 entries, largest
score) for the stableflash attention calls of the next forward (through `stableflash.integrations.transformers`,
or any code that asks `attention_for(layer)`), then runs the trainer's own rules (`Monitor.record`, the same code
as `stableflash train`'s) and logs `monitor.jsonl`, `events.jsonl` and, if asked, TensorBoard. With `action`
"sfa" or "fp32" a warned layer's attention switches to SFA (the bounded rule) or fp32 from the next step on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from stableflash.attention import SFA, AttentionStats, resolve
from stableflash.train.config import MonitorConfig
from stableflash.train.monitor import HeadCount, Monitor, scores_format
from stableflash.train.publish import Publisher, monitor_scalars

_ACTIVE: list[Watch] = []


def active_watch() -> Watch | None:
    """The innermost watch in use, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def _head_count(model) -> int:
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "n_head"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise ValueError("num_heads: the model's config names no head count (num_attention_heads or n_head); pass it")


class Watch:
    def __init__(self, model, *, log_dir: str | Path | None = None, interval: int = 10, action: str = "none",
                 num_heads: int | None = None, precision="fa2", tensorboard: bool = False, wandb: bool = False,
                 config: MonitorConfig | None = None):
        if action not in ("none", "sfa", "fp32"):
            raise ValueError(f"action: expected 'none', 'sfa' or 'fp32', got {action!r}")
        self.config = config or MonitorConfig(interval=interval, action=action)
        if self.config.interval < 1:
            raise ValueError(f"interval: expected >= 1, got {self.config.interval}")
        self.num_heads = num_heads or _head_count(model)
        self.monitor = Monitor(self.config, HeadCount(self.num_heads), Path(log_dir or "."), enabled=True)
        self.precision = resolve(precision)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.step_count = 0
        self.stats: dict[int, AttentionStats] = {}
        self.overrides: dict[int, tuple] = {}
        self.events: list[dict] = []
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            for name in ("monitor.jsonl", "events.jsonl"):
                (self.log_dir / name).write_text("")
        self.publisher = Publisher(self.log_dir, tensorboard=tensorboard, wandb=wandb)

    @property
    def armed(self) -> bool:
        return self.monitor.step_due(self.step_count)

    def attention_for(self, layer: int) -> tuple[object, object, AttentionStats | None]:
        """(precision, stabilize, stats) for one attention call of layer `layer` in the current step."""
        precision, stabilize = self.overrides.get(layer, (self.precision, None))
        stats = None
        if self.armed:
            stats = self.stats.setdefault(layer, AttentionStats(self.num_heads))
        return precision, stabilize, stats

    def step(self, loss: float | None = None, grad_norm: float | None = None) -> list[dict]:
        """After an optimizer step: on a monitored step the rules run on what the attention calls counted. Returns
        this step's warnings (and actions taken)."""
        events = []
        if grad_norm is not None:
            event = self.monitor.check_grad(self.step_count, grad_norm)
            events += [event] if event is not None else []
        if loss is not None and not math.isfinite(loss):
            events.append({"step": self.step_count, "kind": "warning", "signal": "loss", "loss": loss})
        if self.armed and self.stats:
            layers = max(self.stats) + 1
            stats = [self.stats[i].to_dict() if i in self.stats else None for i in range(layers)]
            formats = [scores_format(self.overrides.get(i, (self.precision,))[0]) for i in range(layers)]
            record, warned = self.monitor.record(self.step_count, loss, stats, formats)
            self._log("monitor.jsonl", record)
            events += warned
            for event in warned:
                events += self._act(event)
            self.publisher.scalars(monitor_scalars(record), self.step_count)
        if loss is not None or grad_norm is not None:
            self.publisher.scalars({f"train/{name}": value for name, value in (("loss", loss), ("grad_norm", grad_norm))
                                    if value is not None}, self.step_count)
        for event in events:
            self._log("events.jsonl", event)
        self.events += events
        self.stats = {}
        self.step_count += 1
        return events

    def _act(self, event: dict) -> list[dict]:
        layer, action = event.get("layer"), self.config.action
        if action == "none" or layer is None or layer in self.overrides:
            return []
        self.overrides[layer] = (self.precision, SFA()) if action == "sfa" else (resolve("fp32"), None)
        return [{"step": self.step_count, "kind": "action", "action": action, "layer": layer}]

    def _log(self, name: str, record: dict) -> None:
        if self.log_dir is not None:
            with (self.log_dir / name).open("a") as f:
                f.write(json.dumps(record) + "\n")

    def __enter__(self) -> Watch:
        if self not in _ACTIVE:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self.publisher.close()


def watch(model: torch.nn.Module, **kwargs) -> Watch:
    """Start watching `model`'s stableflash attention calls (see the module docstring); use it as a context
    manager, or call `close()`."""
    w = Watch(model, **kwargs)
    _ACTIVE.append(w)
    return w


def trainer_callback(w: Watch):
    """A `transformers.TrainerCallback` that steps `w` once per optimizer step with that step's loss and gradient norm,
    as the Trainer logs them: with `logging_steps=1` every step's; on a step it does not log, `w` steps without them.
    (The Trainer computes both after `on_step_end` and hands them to callbacks only through `on_log`.)"""
    from transformers import TrainerCallback

    class StableflashCallback(TrainerCallback):
        pending = False

        def _flush(self) -> None:
            if self.pending:
                w.step(None)
                self.pending = False

        def on_step_end(self, args, state, control, **kwargs):
            self._flush()  # the previous step, if no log carried its loss
            self.pending = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.pending and logs and "loss" in logs:
                w.step(float(logs["loss"]), float(logs["grad_norm"]) if logs.get("grad_norm") is not None else None)
                self.pending = False

        def on_train_end(self, args, state, control, **kwargs):
            self._flush()

    return StableflashCallback()
