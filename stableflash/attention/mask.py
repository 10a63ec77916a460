"""Which keys each query sees: causal (aligned bottom-right, as flash-attn), a sliding window, key padding.

Query i of Tq and key j of Tk are at distance d = j - (i + Tk - Tq): the causal mask hides d > 0, a window
(left, right) hides d < -left and d > right (-1: unbounded), a key-padding mask (B, Tk; True = a real key) hides
the padding. A query that sees no key gets O = 0 and zero gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Visibility:
    q_len: int
    k_len: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    key_padding: torch.Tensor | None = None
    """(B, Tk) bool, True where the key is real."""
    dense: torch.Tensor | None = None
    """(B or 1, H or 1, Tq, Tk) bool, True where the query sees the key: any pattern (SDPA's boolean attn_mask)."""

    @property
    def offset(self) -> int:
        return self.k_len - self.q_len

    @property
    def right(self) -> int | None:
        """Largest visible distance j - (i + offset), or None when unbounded."""
        if self.causal:
            return 0 if self.window[1] < 0 else min(0, self.window[1])
        return None if self.window[1] < 0 else self.window[1]

    @property
    def left(self) -> int | None:
        return None if self.window[0] < 0 else self.window[0]

    @property
    def banded(self) -> bool:
        """Whether causality or a window hides some keys (padding aside)."""
        return self.right is not None or self.left is not None

    def skips(self, i0: int, rows: int, j0: int, cols: int) -> bool:
        """Whether the band hides the whole tile of queries i0.. and keys j0.. (padding not counted)."""
        if self.right is not None and j0 - (i0 + rows - 1 + self.offset) > self.right:
            return True
        return self.left is not None and (j0 + cols - 1) - (i0 + self.offset) < -self.left

    def hidden(self, i0: int, rows: int, j0: int, cols: int, device) -> torch.Tensor | None:
        """True where the tile's key is hidden from its query: (rows, cols), or (B, 1, rows, cols) with padding;
        None when the band hides nothing in the tile and there is no padding or dense mask. Decided from the
        tile's bounds, never from the mask's values (traced code may not branch on them)."""
        mask = None
        nearest, farthest = j0 - (i0 + rows - 1 + self.offset), (j0 + cols - 1) - (i0 + self.offset)
        if (self.right is not None and farthest > self.right) or (self.left is not None and nearest < -self.left):
            i = torch.arange(i0, i0 + rows, device=device)[:, None]
            j = torch.arange(j0, j0 + cols, device=device)[None, :]
            distance = j - (i + self.offset)
            mask = torch.zeros(rows, cols, dtype=torch.bool, device=device)
            if self.right is not None:
                mask |= distance > self.right
            if self.left is not None:
                mask |= distance < -self.left
        if self.key_padding is not None:
            pad = ~self.key_padding[:, None, None, j0:j0 + cols].to(device)  # (B, 1, 1, cols)
            mask = pad if mask is None else mask | pad
        if self.dense is not None:
            hidden = ~self.dense[..., i0:i0 + rows, j0:j0 + cols].to(device)
            mask = hidden if mask is None else mask | hidden
        return mask


@dataclass(frozen=True, eq=False)
class ScoreMods:
    """What changes the scaled scores S before the softmax: `softcap` > 0 caps them as softcap · tanh(S / softcap)
    (Gemma 2's), then `bias` (B or 1, H or 1, Tq, Tk) is added (SDPA's float attn_mask: -inf hides a key)."""
    softcap: float = 0.0
    bias: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.softcap > 0 or self.bias is not None
