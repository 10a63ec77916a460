"""The training monitor: per-head spectral norms, attention counters, spikes, early warnings.

Every `interval` steps it arms `AttentionStats` on the layers whose backend can
count, then after the step records per layer and head: spectral norms of
W_Q/W_K/W_V/W_O (power iteration with persistent vectors, so a few iterations
per pass suffice), repeated-max rows, P̄ = 1 entries and the max logit. Records go
to `monitor.jsonl`; warnings and stops to `events.jsonl`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from pathlib import Path

import torch

from stableflash.attention.stats import AttentionStats
from stableflash.numerics.formats import Format, get_format

COUNTING_BACKENDS = ("reference", "math", "auto", "triton")
MATRICES = ("q", "k", "v", "o")


def head_matrices(model) -> dict[str, torch.Tensor]:
    """Per-head weight matrices, each (n_layer * n_head, rows, cols), detached fp32."""
    cfg = model.config
    C, H = cfg.n_embd, cfg.n_head
    hd = C // H
    out = {m: [] for m in MATRICES}
    for attn in model.attentions:
        w = attn.c_attn.weight.detach().float()
        for i, m in enumerate(("q", "k", "v")):
            out[m].append(w[i * C:(i + 1) * C].view(H, hd, C))
        out["o"].append(attn.c_proj.weight.detach().float().view(C, H, hd).permute(1, 0, 2))  # (H, C, hd)
    return {m: torch.cat(v) for m, v in out.items()}


class SpectralNorms:
    """Batched power iteration with vectors kept between calls."""

    def __init__(self, iters: int = 4):
        self.iters = iters
        self.vectors: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def __call__(self, model) -> dict[str, torch.Tensor]:
        norms = {}
        for name, w in head_matrices(model).items():
            v = self.vectors.get(name)
            if v is None or v.shape != (w.shape[0], w.shape[2]):
                g = torch.Generator(device="cpu").manual_seed(0)
                v = torch.randn(w.shape[0], w.shape[2], generator=g)
            v = v.to(w.device)
            for _ in range(self.iters):
                u = torch.nn.functional.normalize(torch.einsum("brc,bc->br", w, v), dim=-1)
                v = torch.nn.functional.normalize(torch.einsum("brc,br->bc", w, u), dim=-1)
            self.vectors[name] = v
            norms[name] = torch.einsum("brc,bc->br", w, v).norm(dim=-1)
        return norms

    def state_dict(self) -> dict:
        return {name: v.cpu() for name, v in self.vectors.items()}

    def load_state_dict(self, state: dict) -> None:
        self.vectors = {name: v.clone() for name, v in state.items()}


def _jump(past, value: float, factor: float, *, minimum: float = -math.inf, warm: int = 3,
          floor: float = 1e-12) -> float | None:
    """The running median of `past` if `value` exceeds `factor` times it (and `minimum`), else None;
    None too while `past` holds fewer than `warm` values. `floor` keeps a zero median from flagging noise."""
    if len(past) < warm:
        return None
    median = statistics.median(past)
    return median if value > factor * max(median, floor) and value >= minimum else None


def scores_format(policy) -> Format | None:
    """The coarsest format a policy rounds its attention scores to (the QKᵀ or the S site), or None when
    both keep at least fp32's precision ("input" sites follow the inputs and are not judged here)."""
    formats = [get_format(getattr(policy, site)) for site in ("qk", "scores") if getattr(policy, site) != "input"]
    coarsest = min(formats, key=lambda f: f.fraction_bits, default=None)
    return coarsest if coarsest is not None and coarsest.fraction_bits < 23 else None


class HeadCount:
    """What the Monitor's constructor reads of a model, for rules run on logs or on a model that is not ours."""

    def __init__(self, n_head: int):
        self.config = type("Config", (), {"n_head": n_head})


class Monitor:
    """The early-warning rules and their memory; `observe` runs them on our GPT after a monitored step, `record` on
    per-layer statistics from any model (`stableflash.watch`)."""

    def __init__(self, cfg, model, run_dir: Path, enabled: bool = True):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.enabled = enabled and cfg.interval > 0
        self.spectral = SpectralNorms(cfg.power_iters)
        self.losses: deque[float] = deque(maxlen=50)
        self.grad_norms: deque[float] = deque(maxlen=50)
        self.history: dict[tuple[int, int], deque[float]] = {}
        self.logit_history: dict[tuple[int, int], deque[float]] = {}
        self.coarse_scores: set[tuple[int, int]] = set()  # heads already warned by the resolution rule
        self.n_head = model.config.n_head
        self.armed = False

    def state_dict(self) -> dict:
        """Everything the rules remember (running medians, warned heads, power-iteration vectors): a resumed run
        raises the warnings and stops an uninterrupted one would."""
        def table(history):
            return [[layer, head, list(values)] for (layer, head), values in history.items()]
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "history": table(self.history),
                "logit_history": table(self.logit_history), "coarse_scores": sorted(self.coarse_scores),
                "spectral": self.spectral.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.losses.extend(state["losses"])
        self.grad_norms.extend(state["grad_norms"])
        for name, maxlen in (("history", 20), ("logit_history", 20)):
            getattr(self, name).update({(layer, head): deque(values, maxlen=maxlen)
                                        for layer, head, values in state[name]})
        self.coarse_scores = {tuple(pair) for pair in state["coarse_scores"]}
        self.spectral.load_state_dict(state["spectral"])

    def step_due(self, step: int) -> bool:
        """Whether `step` is a monitored step (the same on every rank)."""
        return self.cfg.interval > 0 and step % self.cfg.interval == 0

    def due(self, step: int) -> bool:
        """Whether this process observes `step` (rank 0 only)."""
        return self.enabled and self.step_due(step)

    def arm(self, model) -> None:
        """Attach fresh stats to every layer whose backend can count."""
        for attn in model.attentions:
            if attn.attention.backend in COUNTING_BACKENDS:
                attn.stats = AttentionStats(self.n_head)
        self.armed = True

    def _disarm(self, model) -> list[dict | None]:
        stats = []
        for attn in model.attentions:
            stats.append(attn.stats.to_dict() if attn.stats is not None else None)
            attn.stats = None
        self.armed = False
        return stats

    def check_loss(self, step: int, loss: float, warmup_steps: int) -> str | None:
        """A reason to stop (NaN/inf loss, or a spike), or None."""
        if not math.isfinite(loss):
            return f"loss is {loss} at step {step}"
        reason = None
        if step > warmup_steps and len(self.losses) >= 10:
            median = statistics.median(self.losses)
            if loss > self.cfg.spike_factor * median:
                reason = f"loss spike at step {step}: {loss:.4g} > {self.cfg.spike_factor} x running median {median:.4g}"
        self.losses.append(loss)
        return reason

    def check_grad(self, step: int, grad_norm: float) -> dict | None:
        """A warning when the gradient norm is not finite or jumps above its running median."""
        event = None
        if not math.isfinite(grad_norm):
            event = {"step": step, "kind": "warning", "signal": "grad_norm", "grad_norm": grad_norm}
        elif (median := _jump(self.grad_norms, grad_norm, self.cfg.grad_warn_factor, warm=10, floor=0.0)) is not None:
            event = {"step": step, "kind": "warning", "signal": "grad_norm", "grad_norm": grad_norm,
                     "running_median": median}
        if math.isfinite(grad_norm):
            self.grad_norms.append(grad_norm)
        return event

    def logit_events(self, step: int, layer: int, max_scores: list[float]) -> list[dict]:
        """Warnings for heads whose largest attention logit jumps above its running median (logit growth)."""
        events = []
        for head, score in enumerate(max_scores):
            past = self.logit_history.setdefault((layer, head), deque(maxlen=20))
            median = _jump(past, score, self.cfg.logit_warn_factor, minimum=self.cfg.logit_warn_min)
            if median is not None:
                events.append({"step": step, "kind": "warning", "signal": "max_logit", "layer": layer,
                               "head": head, "max_logit": score, "running_median": median})
            if math.isfinite(score):
                past.append(score)
        return events

    def resolution_events(self, step: int, layer: int, max_scores: list[float], fmt: Format | None) -> list[dict]:
        """Warnings, once per head, when its largest score sits where `fmt` (the layer's scores format) spaces
        values `score_ulp_warn` or more apart."""
        if fmt is None or self.cfg.score_ulp_warn <= 0:
            return []
        events = []
        for head, score in enumerate(max_scores):
            spacing = fmt.ulp(score)
            if spacing >= self.cfg.score_ulp_warn and (layer, head) not in self.coarse_scores:
                self.coarse_scores.add((layer, head))
                events.append({"step": step, "kind": "warning", "signal": "score_resolution", "layer": layer,
                               "head": head, "max_logit": score, "format": fmt.name, "spacing": spacing})
        return events

    def repeated_max_events(self, step: int, layer: int, stats: dict, wq_norms=None) -> list[dict]:
        """Warnings for heads whose share of repeated-max rows jumps above its running median."""
        events = []
        for head, rows in enumerate(stats["rows"]):
            fraction = stats["repeated_max_rows"][head] / max(1, rows)
            past = self.history.setdefault((layer, head), deque(maxlen=20))
            median = _jump(past, fraction, self.cfg.warn_factor, minimum=self.cfg.warn_min_fraction)
            if median is not None:
                event = {"step": step, "kind": "warning", "signal": "repeated_max", "layer": layer, "head": head,
                         "repeated_max_fraction": fraction, "running_median": median}
                if wq_norms is not None:
                    event["wq_spectral_norm"] = wq_norms[head]
                events.append(event)
            past.append(fraction)
        return events

    def observe(self, step: int, model, loss: float) -> tuple[dict, list[dict]]:
        """After a monitored step of our GPT: one record (with W_Q/K/V/O spectral norms) and its events."""
        norms = self.spectral(model)
        stats = self._disarm(model)
        L, H = model.config.n_layer, self.n_head
        spectral = {m: norms[m].view(L, H).tolist() for m in MATRICES}
        formats = [scores_format(a.attention.precision) for a in model.attentions]
        return self.record(step, loss, stats, formats, spectral)

    def record(self, step: int, loss: float | None, stats: list[dict | None], formats: list[Format | None],
               spectral: dict | None = None) -> tuple[dict, list[dict]]:
        """The rules on one monitored step's per-layer statistics (`AttentionStats.to_dict()`, None where a layer
        did not count) and scores formats: the record to log and the early-warning events it raised."""
        record = {"step": step, "loss": loss, **({"spectral": spectral} if spectral is not None else {}),
                  "attention": stats}
        events = []
        for layer, s in enumerate(stats):
            if s is None:
                continue
            events += self.logit_events(step, layer, s["max_score"])
            events += self.resolution_events(step, layer, s["max_score"], formats[layer])
            events += self.repeated_max_events(step, layer, s,
                                               wq_norms=spectral["q"][layer] if spectral is not None else None)
        return record, events
