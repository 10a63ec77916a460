"""The named baseline the research scripts time stableflash against, as one callable."""

from __future__ import annotations

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def cudnn_causal(q, k, v):
    """cuDNN's causal attention through SDPA, (B, H, T, D) in and out."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
