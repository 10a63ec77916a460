"""`AttentionStats`: per-head counters that attention kernels fill when asked.

Pass one as `flash_attention(..., stats=s)`; every call adds to it (forward only),
so a monitor can read and `reset()` it once per logging interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionStats:
    """Counters per head, summed over batch, rows and calls.

    - `rows`: query rows seen;
    - `repeated_max_rows`: rows with more than one score within `eps` of the
      tile maximum in some tile (the SFA condition rs > 1);
    - `pbar_ones`: P̄ entries equal to exactly 1 in the format they enter P̄V in;
    - `max_score`: largest finite pre-softmax score S (scaled).
    """

    num_heads: int
    eps: float = 1e-3
    counts: torch.Tensor = field(init=False)  # (num_heads, 3) int64: repeated_max_rows, pbar_ones, rows
    max_score: torch.Tensor = field(init=False)

    def __post_init__(self):
        if not isinstance(self.num_heads, int) or self.num_heads < 1:
            raise ValueError(f"num_heads: expected a positive int, got {self.num_heads!r}")
        if not self.eps >= 0:
            raise ValueError(f"eps: expected a number >= 0, got {self.eps!r}")
        self.reset()

    # the three counters are columns of one tensor, a head's three side by side, so that a kernel adds to them
    # through one pointer (`kernel_targets`)
    @property
    def repeated_max_rows(self) -> torch.Tensor:
        return self.counts[:, 0]

    @property
    def pbar_ones(self) -> torch.Tensor:
        return self.counts[:, 1]

    @property
    def rows(self) -> torch.Tensor:
        return self.counts[:, 2]

    def reset(self, device: torch.device | str | None = None) -> None:
        device = device if device is not None else getattr(self, "counts", torch.empty(0)).device
        self.counts = torch.zeros(self.num_heads, 3, dtype=torch.int64, device=device)
        self.max_score = torch.full((self.num_heads,), -torch.inf, dtype=torch.float32, device=device)

    def _to(self, device: torch.device) -> None:
        if self.counts.device != device:
            self.counts, self.max_score = self.counts.to(device), self.max_score.to(device)

    def kernel_targets(self, heads: torch.Tensor | slice, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Tensors a kernel can add the counts of heads `heads` to in place, on `device`: counts (H, 3) and max_score
        (H,), head h's at offsets 3h and h; None where the heads are not a run of consecutive ones (an index tensor).
        For every head (`slice(None)`, the common case) the totals themselves: a view costs an eager call ~5 µs."""
        if not isinstance(heads, slice) or heads.step not in (None, 1):
            return None
        self._to(device)
        if heads == slice(None):
            return self.counts, self.max_score
        return self.counts[heads], self.max_score[heads]

    def add(self, heads: torch.Tensor | slice, rows, repeated_max_rows, pbar_ones, max_score) -> None:
        """Accumulate per-head counts for the heads `heads` (a slice or an index tensor); `rows` may be one number
        for every head. With a slice, each counter is one in-place kernel. (Eagerly the Triton kernels skip this and
        add to `kernel_targets` themselves: at small sizes these launches cost more than the kernels they follow.)
        The values are taken detached: totals that joined the autograd graph would, in a compiled step, be an input
        needing a gradient, and the next micro-batch's backward would run this one's graph a second time."""
        rows, repeated_max_rows, pbar_ones, max_score = (
            t.detach() if isinstance(t, torch.Tensor) else t for t in (rows, repeated_max_rows, pbar_ones, max_score))
        self._to(max_score.device)
        self.rows[heads] += rows
        self.repeated_max_rows[heads] += repeated_max_rows
        self.pbar_ones[heads] += pbar_ones
        if isinstance(heads, slice):  # a view: update it in place
            self.max_score[heads].clamp_min_(max_score.float())
        else:
            self.max_score[heads] = torch.maximum(self.max_score[heads], max_score.float())

    def check(self, num_heads: int) -> None:
        if self.num_heads != num_heads:
            raise ValueError(f"stats: built for {self.num_heads} heads, but the input has {num_heads}")

    def to_dict(self) -> dict:
        return {
            "rows": self.rows.tolist(),
            "repeated_max_rows": self.repeated_max_rows.tolist(),
            "pbar_ones": self.pbar_ones.tolist(),
            "max_score": self.max_score.tolist(),
        }

    @property
    def repeated_max_fraction(self) -> torch.Tensor:
        return self.repeated_max_rows.double() / self.rows.clamp(min=1).double()
