"""`AttentionStats`: per-head counters that attention kernels fill when asked.

Pass one as `flash_attention(..., stats=s)`; every call adds to it (forward only),
so a monitor can read and `reset()` it once per logging interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STAT_COLUMNS = ("repeated_max_rows", "repeated_max_rows_positive", "pbar_ones", "rows", "biasable_rows")
"""The counters of `AttentionStats.counts`, a head's side by side, in the order the kernels add to them."""


TAIL_FLOOR = 2.0**-24
"""A biasable row's lower bound on its tile's P̄ mass outside the entries equal to 1, per such entry: half an ulp of
fp32. A smaller tail is lost when P̄V accumulates in fp32, leaving an exact tie, which rounding to nearest-even breaks
without bias."""


def tail_limit(pv_fraction_bits: int) -> float:
    """A biasable row's upper bound on that mass per entry equal to 1: half an ulp of the format P̄V is rounded to,
    2^-(fraction bits + 1), so that the tail decides a tie rather than the rounding. 0 (no row is biasable) where P̄V
    is rounded to fp32 or wider."""
    return 0.0 if pv_fraction_bits >= 23 else 2.0 ** -(pv_fraction_bits + 1)


def biasable_in_tile(ones: torch.Tensor, tail: torch.Tensor, limit: float) -> torch.Tensor:
    """Rows of one tile whose P̄V sum rounds with the seed's bias: at least two P̄ = 1 (`ones`), and the rest of the
    tile's P̄ mass (`tail`) between `TAIL_FLOOR` and `limit` (`tail_limit`) per such entry."""
    return (ones >= 2) & (tail >= ones * TAIL_FLOOR) & (tail < ones * limit)


@dataclass
class AttentionStats:
    """Counters per head, summed over batch, rows and calls.

    - `rows`: query rows seen;
    - `repeated_max_rows`: rows with more than one score within `eps` of the tile maximum in some tile (the SFA
      condition rs > 1); `repeated_max_rows_positive`: those where some such maximum is positive (where SFA's rule
      multiplies m by beta; the others' maxima are all <= 0, where it sets m = 0: the seed's Figure 13);
    - `pbar_ones`: P̄ entries equal to exactly 1 in the format they enter P̄V in;
    - `biasable_rows`: rows where some tile has at least two P̄ = 1 and its other entries' P̄ mass is below half an
      ulp of P̄V's format per such entry, and above fp32's (`biasable`): the rows whose P̄V sum rounds with the
      seed's bias;
    - `max_score`: largest finite pre-softmax score S (scaled).
    """

    num_heads: int
    eps: float = 1e-3
    counts: torch.Tensor = field(init=False)  # (num_heads, len(STAT_COLUMNS)) int64
    max_score: torch.Tensor = field(init=False)

    def __post_init__(self):
        if not isinstance(self.num_heads, int) or self.num_heads < 1:
            raise ValueError(f"num_heads: expected a positive int, got {self.num_heads!r}")
        if not self.eps >= 0:
            raise ValueError(f"eps: expected a number >= 0, got {self.eps!r}")
        self.reset()

    def _column(self, name: str) -> torch.Tensor:
        return self.counts[:, STAT_COLUMNS.index(name)]

    @property
    def repeated_max_rows(self) -> torch.Tensor:
        return self._column("repeated_max_rows")

    @property
    def repeated_max_rows_positive(self) -> torch.Tensor:
        return self._column("repeated_max_rows_positive")

    @property
    def pbar_ones(self) -> torch.Tensor:
        return self._column("pbar_ones")

    @property
    def rows(self) -> torch.Tensor:
        return self._column("rows")

    @property
    def biasable_rows(self) -> torch.Tensor:
        return self._column("biasable_rows")

    def reset(self, device: torch.device | str | None = None) -> None:
        device = device if device is not None else getattr(self, "counts", torch.empty(0)).device
        self.counts = torch.zeros(self.num_heads, len(STAT_COLUMNS), dtype=torch.int64, device=device)
        self.max_score = torch.full((self.num_heads,), -torch.inf, dtype=torch.float32, device=device)

    def _to(self, device: torch.device) -> None:
        if self.counts.device != device:
            self.counts, self.max_score = self.counts.to(device), self.max_score.to(device)

    def add_counts(self, heads: torch.Tensor | slice, counts: torch.Tensor, max_score: torch.Tensor) -> None:
        """Accumulate a kernel's (len(heads), len(STAT_COLUMNS)) counters and (len(heads),) largest scores for the
        heads `heads` (a slice or an index tensor). Taken detached: totals that joined the autograd graph would, in a
        compiled step, be an input needing a gradient, and the next micro-batch's backward would run this one's
        graph a second time."""
        counts, max_score = counts.detach(), max_score.detach()
        self._to(max_score.device)
        self.counts[heads] += counts.to(self.counts.dtype)
        if isinstance(heads, slice):  # a view: update it in place
            self.max_score[heads].clamp_min_(max_score.float())
        else:
            self.max_score[heads] = torch.maximum(self.max_score[heads], max_score.float())

    def add(self, heads: torch.Tensor | slice, rows, repeated_max_rows, pbar_ones, max_score, *,
            repeated_max_rows_positive=0, biasable_rows=0) -> None:
        """`add_counts` with each counter given by name; `rows` (or any counter) may be one number for every head."""
        max_score = max_score.detach() if isinstance(max_score, torch.Tensor) else torch.as_tensor(max_score)
        values = dict(repeated_max_rows=repeated_max_rows, repeated_max_rows_positive=repeated_max_rows_positive,
                      pbar_ones=pbar_ones, rows=rows, biasable_rows=biasable_rows)
        n = len(range(self.num_heads)[heads]) if isinstance(heads, slice) else len(heads)
        counts = torch.stack([torch.as_tensor(values[c], device=max_score.device).detach().to(torch.int64).expand(n)
                              for c in STAT_COLUMNS], dim=1)
        self.add_counts(heads, counts, max_score.expand(n))

    def check(self, num_heads: int) -> None:
        if self.num_heads != num_heads:
            raise ValueError(f"stats: built for {self.num_heads} heads, but the input has {num_heads}")

    def to_dict(self) -> dict:
        return {**{c: self._column(c).tolist() for c in STAT_COLUMNS}, "max_score": self.max_score.tolist()}

    @property
    def repeated_max_fraction(self) -> torch.Tensor:
        return self.repeated_max_rows.double() / self.rows.clamp(min=1).double()
