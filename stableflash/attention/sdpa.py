"""torch's `scaled_dot_product_attention` convention over `flash_attention`: `sdpa` takes SDPA's exact signature and
defaults (`is_causal=False`, causal aligned to the top left when L != S, a bool or float `attn_mask`), and
`route_sdpa` sends every `torch.nn.functional.scaled_dot_product_attention` call of a block of code through it.

Where the two differ, by design: a row that a mask leaves without keys gives O = 0 (SDPA: NaN), and `dropout_p` must
be 0. With no queries or no keys at all (L or S = 0) it gives what SDPA gives: an empty output, or zeros.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from stableflash.attention.api import flash_attention


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
         precision="fa2", stabilize=None, stats=None, backend: str = "auto") -> torch.Tensor:
    """`F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)` with
    this library's `precision`, `stabilize`, `stats` and `backend` (`flash_attention`'s).

    query (..., H, L, E) and key, value (..., H_kv, S, E) with one or two leading dims (as a model's (B, H, L, E));
    H_kv < H needs `enable_gqa=True`, as in SDPA. `is_causal` masks keys after each query with the mask aligned to
    the top left (SDPA's `tril(ones(L, S))`; flash-attn and `flash_attention` align it to the bottom right), and
    may not be combined with `attn_mask`."""
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: only 0.0 is supported, got {dropout_p!r}")
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal, attn_mask: SDPA takes one or the other, not both")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4):
            raise ValueError(f"{name}: expected a (B, H, L, E) or (H, L, E) tensor")
    if key.shape[-3] != query.shape[-3] and not enable_gqa:
        raise ValueError(f"key: {key.shape[-3]} heads where query has {query.shape[-3]}; pass enable_gqa=True for "
                         "grouped-query attention")
    batched = query.dim() == 4
    q, k, v = (t if batched else t.unsqueeze(0) for t in (query, key, value))
    L, S = q.shape[-2], k.shape[-2]
    causal = is_causal and L == S
    if is_causal and L != S:  # SDPA's causal mask for L != S: query i sees keys 0..i
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
    out = flash_attention(q, k, v, causal=causal, attn_mask=attn_mask, scale=scale, precision=precision,
                          stabilize=stabilize, stats=stats, backend=backend)
    return out if batched else out[0]


@contextlib.contextmanager
def route_sdpa(**options):
    """Within the block, `torch.nn.functional.scaled_dot_product_attention` is `sdpa` with `options` (`precision`,
    `stabilize`, `stats`, `backend`): an existing model's attention runs through this library unchanged. Code that
    imported the function by name before the block keeps torch's."""
    unknown = set(options) - {"precision", "stabilize", "stats", "backend"}
    if unknown:
        raise TypeError(f"route_sdpa: unknown options {sorted(unknown)}; expected precision, stabilize, stats, backend")
    previous = F.scaled_dot_product_attention

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **options)

    F.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous
