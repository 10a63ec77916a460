"""Capture what each attention layer saw in one forward/backward pass of a GPT."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class LayerCapture:
    """One layer's attention inputs and output gradient for one batch (all detached)."""

    x: torch.Tensor
    """(B, T, C) input of c_attn (after ln_1)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    """(B, H, T, D) as flash_attention received them."""
    dout: torch.Tensor
    """(B, H, T, D) gradient of the loss with respect to the attention output."""
    w_q: torch.Tensor
    """(C, C) rows of c_attn's weight that make q; head h is rows h*D:(h+1)*D."""


def capture_attention(model, x: torch.Tensor, y: torch.Tensor, *, autocast: bool = True) -> list[LayerCapture]:
    """Run one forward and backward of `model` on (x, y); return every layer's capture.

    Gradients reach the model's parameters as in training; the caller zeroes them.
    """
    records: list[dict] = []
    hooks = []
    for attn in model.attentions:
        def pre_hook(module, args, records=records):
            records.append({"x": args[0].detach()})

        hooks.append(attn.register_forward_pre_hook(pre_hook))
        attn.capture = records
    device_type = x.device.type
    ctx = torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with ctx:
            _, loss = model(x, y)
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
        for attn in model.attentions:
            attn.capture = None
    out = []
    for attn, rec in zip(model.attentions, records):
        C = attn.n_embd
        out.append(LayerCapture(x=rec["x"], q=rec["q"], k=rec["k"], v=rec["v"], dout=rec["y"].grad.detach(),
                                w_q=attn.c_attn.weight[:C].detach()))
    return out
