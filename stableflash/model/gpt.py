"""GPT-2 (pre-LN, GELU MLP, tied embeddings) whose attention is chosen per layer and per head.

Each block's attention calls `stableflash.flash_attention` with its own backend,
precision policy and stabilization, so the seed's isolation experiments are
configurations, not code changes. Options for the comparisons the seed discusses:
QK-norm, QK-clip (Kimi's post-step rescaling of W_q and W_k), gated attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from stableflash.attention import SFA, AttentionStats, ClampPbar, flash_attention
from stableflash.attention.precision import Precision

PRESET_SHAPES = {
    "gpt2s": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2m": dict(n_layer=24, n_head=16, n_embd=1024),
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),
    "small": dict(n_layer=4, n_head=4, n_embd=256),
}


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention, a plain record: what `flash_attention` is called with."""

    backend: str
    precision: Precision
    stabilize: SFA | ClampPbar | None

    def describe(self) -> str:
        stab = "" if self.stabilize is None else f"+{type(self.stabilize).__name__}"
        return f"{self.backend}:{self.precision.name}{stab}"


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg, attention: LayerAttention):
        super().__init__()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_gate = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias) if cfg.gated_attention else None
        self.q_norm = nn.LayerNorm(self.head_dim, bias=cfg.bias) if cfg.qk_norm else None
        self.k_norm = nn.LayerNorm(self.head_dim, bias=cfg.bias) if cfg.qk_norm else None
        self.attention = attention
        self.stats: AttentionStats | None = None  # set by the monitor when it wants counts
        self.track_max_logit = cfg.qk_clip > 0
        self.max_logit: torch.Tensor | None = None
        self.capture: list[dict] | None = None  # set by diagnose.capture to record q, k, v and dO

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        if self.track_max_logit:
            with torch.no_grad():  # per-head max logit, for QK-clip after the step
                scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(self.head_dim)
                scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), -math.inf)
                self.max_logit = scores.amax(dim=(0, 2, 3))
        a = self.attention
        y = flash_attention(q, k, v, causal=True, precision=a.precision, stabilize=a.stabilize,
                            backend=a.backend, stats=self.stats)
        if self.capture is not None:  # the pre-hook opened this layer's record
            y.retain_grad()
            self.capture[-1].update(q=q.detach(), k=k.detach(), v=v.detach(), y=y)
        y = y.to(v.dtype)
        if self.c_gate is not None:
            gate = torch.sigmoid(self.c_gate(x)).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
            y = y * gate
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads
        return self.c_proj(y)

    @torch.no_grad()
    def apply_qk_clip(self, threshold: float) -> None:
        """Kimi's QK-clip: scale W_q and W_k of each head whose max logit exceeded `threshold`."""
        if self.max_logit is None:
            return
        factor = torch.clamp(threshold / self.max_logit.clamp(min=1e-6), max=1.0).sqrt()  # (nh,)
        per_row = factor.repeat_interleave(self.head_dim)
        w = self.c_attn.weight  # rows: [q | k | v]
        w[: self.n_embd] *= per_row[:, None]
        w[self.n_embd: 2 * self.n_embd] *= per_row[:, None]
        if self.c_attn.bias is not None:
            self.c_attn.bias[: self.n_embd] *= per_row
            self.c_attn.bias[self.n_embd: 2 * self.n_embd] *= per_row


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.approximate = "none" if cfg.gelu == "exact" else "tanh"

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, cfg, attention: LayerAttention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, attention)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 with each layer's attention as given (`AttentionConfig.resolve(n_layer)` builds them from a config)."""

    def __init__(self, cfg, attentions: Sequence[LayerAttention]):
        super().__init__()
        if len(attentions) != cfg.n_layer:
            raise ValueError(f"attentions: expected one per layer ({cfg.n_layer}), got {len(attentions)}")
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList(Block(cfg, attention) for attention in attentions),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def attentions(self) -> list[CausalSelfAttention]:
        return [block.attn for block in self.transformer.h]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"idx: sequence length {T} exceeds model.block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def set_layer_attention(self, layer: int, attention: LayerAttention) -> None:
        """Switch one layer's attention (the monitor's intervention)."""
        self.transformer.h[layer].attn.attention = attention
