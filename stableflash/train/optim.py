"""Optimizers: AdamW (fused where available) and Muon; the learning-rate schedule."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Linear warm-up to `lr`, cosine decay to `min_lr` by `decay_steps`, then flat.

    A function of the step alone: stopping early and resuming never changes it."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise a 2-D matrix (Muon's quintic Newton-Schulz iteration).

    Returns U V^T of g's SVD up to singular values pushed into roughly [0.7, 1.2]."""
    a, b, c = 3.4445, -4.7750, 2.0315  # coefficients chosen to converge fast from any spectrum (Jordan et al.)
    x = g.float()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (x.norm() + eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = x @ x.T
        B = b * A + c * A @ A
        x = a * x + B @ x
    return x.T if transposed else x


class Muon(torch.optim.Optimizer):
    """Momentum whose update is orthogonalised by Newton-Schulz, for 2-D hidden weight matrices.

    The update is scaled by sqrt(max(1, rows/cols)) so its RMS does not shrink for tall matrices."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad)
                update = p.grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_steps"])
                scale = max(1.0, p.size(0) / p.size(1)) ** 0.5
                p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)


def build_optimizers(model: torch.nn.Module, cfg) -> list[torch.optim.Optimizer]:
    """AdamW for everything, or Muon for 2-D hidden weights plus AdamW for the rest."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fused = all(p.is_cuda for _, p in named)
    adam_kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay, fused=fused or None)
    if cfg.name == "adamw":
        return [torch.optim.AdamW([p for _, p in named], **adam_kwargs)]
    hidden = [p for n, p in named if p.ndim == 2 and "wte" not in n and "wpe" not in n and "lm_head" not in n]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in hidden_ids]
    return [Muon(hidden, lr=cfg.muon_lr, momentum=cfg.muon_momentum), torch.optim.AdamW(rest, **adam_kwargs)]


def set_lr(optimizers: list[torch.optim.Optimizer], cfg, step: int) -> float:
    """Set this step's rates (Muon follows the same schedule shape, relative to its own peak)."""
    lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, decay_steps=cfg.decay_steps)
    for opt in optimizers:
        peak = cfg.muon_lr if isinstance(opt, Muon) else cfg.lr
        for group in opt.param_groups:
            group["lr"] = lr * peak / cfg.lr
    return lr
