"""Stabilizations of the online softmax: the seed's SFA and the ClampPbar control.

Both act per tile, on a row's tile maximum `rm` and its count of near-maxima
`rs = #{S >= rm - eps}`, and both aim at one thing: no P̄ entry equal to 1 in a
row with repeated maxima, which is what triggers the biased bf16 rounding in P̄V.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from stableflash.numerics.formats import Format
from stableflash.numerics.rounding import round_to


@dataclass(frozen=True)
class SFA:
    """Stabilized flash attention's modified safe softmax (the seed's Algorithm 3).

    Per tile: rm = rowmax(S), rs = rowsum(rm - S <= eps);
    m' = beta*rm where rm > 0 and rs > 1, else rm; m = 0 where rm < 0 and rs > 1, else m'.
    Exact in real arithmetic (softmax is shift invariant).

    `bounded=False` is the paper's rule as written. It has two holes: a repeated
    maximum with rm above ~88 (or far below 0, where m = 0) shifts every P̄ into
    underflow, so l = 0 and O = NaN; and for |rm| below ~2^-8 (or rm = 0) the
    shifted maximum still rounds to exactly 1. The default, bounded rule clamps
    the shift m - rm in repeated-max rows to [min_shift, max_shift], where
    min_shift is the smallest shift whose exp rounds below 1 in the P̄ format
    (2^-fraction_bits) and max_shift keeps exp(-shift) a normal number; the shift
    is applied after rounding m to its storage format (rounding up), and a row
    whose rm is so large that no such m is representable stays unshifted.

    `official_rule=True` (`SFA.official()`) is the rule as the paper's own code runs it
    (`STABLE=1`): unbounded, the near-maximum test written `S >= rm - eps` (with
    rm - eps rounded like any elementwise op on m), and applied to tiles with no
    visible key too, whose repeated "maximum" is the mask value, so that m
    becomes max(m, 0) there. In the kernels, by the emulation kernels (bit for bit as the reference).
    """

    beta: float = 2.0
    eps: float = 1e-3
    bounded: bool = True
    max_shift: float = 16.0
    official_rule: bool = False

    def __post_init__(self):
        if not (isinstance(self.beta, (int, float)) and self.beta > 1):
            raise ValueError(f"SFA.beta: expected a number > 1, got {self.beta!r}")
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"SFA.eps: expected a number >= 0, got {self.eps!r}")
        if not self.max_shift > 0:
            raise ValueError(f"SFA.max_shift: expected a number > 0, got {self.max_shift!r}")
        if self.official_rule and self.bounded:
            raise ValueError("SFA.official_rule: the official rule is unbounded; use SFA.official() or bounded=False")
        object.__setattr__(self, "_key", _key(self))  # computed here: traced code only reads it (`key_of`)

    @classmethod
    def official(cls, beta: float = 2.0, eps: float = 1e-3) -> SFA:
        """The paper's code's rule exactly: per 512-key tile in its recipe, absolute eps, beta = 2, unbounded,
        fully masked tiles included."""
        return cls(beta=beta, eps=eps, bounded=False, official_rule=True)

    def shift_bounds(self, pbar_format: Format) -> tuple[float, float]:
        """(min, max) shift m - rm that keeps max P̄ in (0, 1) in `pbar_format`."""
        low = math.ldexp(1.0, -pbar_format.fraction_bits)
        high = min(self.max_shift, -math.log(pbar_format.min_normal) / 2)
        return low, high

    def row_shift_max(self, rm: torch.Tensor, rs: torch.Tensor, storage: Format, pbar_format: Format) -> torch.Tensor:
        """The m of each row (compute dtype) given its tile max `rm` and near-max count `rs`."""
        repeated = rs > 1
        paper = torch.where(repeated & (rm > 0), self.beta * rm, rm)
        paper = torch.where(repeated & (rm < 0), torch.zeros_like(rm), paper)
        if not self.bounded:
            return paper
        low, high = self.shift_bounds(pbar_format)
        finite = torch.isfinite(rm)
        safe_rm = torch.where(finite, rm, torch.zeros_like(rm))
        shift = torch.clamp(paper - rm, min=low, max=high)
        # round m up in its storage format so the stored shift is still >= low
        m = round_to(safe_rm + shift, storage, "up", dtype=rm.dtype)
        actual = m.double() - safe_rm.double()
        usable = repeated & finite & (actual >= low) & (actual <= high)
        return torch.where(usable, m, rm)


@dataclass(frozen=True)
class ClampPbar:
    """Control for the seed's Limitation 4: keep m = rm (same temperature) but clamp
    P̄ to the largest value below 1 of its format, so no entry is exactly 1.

    Not exact in real arithmetic: the maxima get weight 1 - 2^-(fraction_bits+1)."""

    eps: float = 1e-3

    def __post_init__(self):
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"ClampPbar.eps: expected a number >= 0, got {self.eps!r}")
        object.__setattr__(self, "_key", _key(self))

    @staticmethod
    def ceiling(pbar_format: Format) -> float:
        return 1.0 - math.ldexp(1.0, -(pbar_format.fraction_bits + 1))


Stabilizer = SFA | ClampPbar


STABILIZERS = ("none", "sfa", "sfa-official", "sfa-unbounded", "clamp")
"""The names a config gives a stabilizer, as the API names them: `sfa` is `SFA()` (the bounded rule), `sfa-official`
`SFA.official()` (the paper's code's rule), `sfa-unbounded` `SFA(bounded=False)` (the rule as written), `clamp`
`ClampPbar()`."""


def key_of(stabilize) -> str | None:
    """A stabilizer as a string (`from_key` inverts it), for the places torch.compile needs a constant."""
    if stabilize is None:
        return None
    key = getattr(stabilize, "_key", None)
    if key is None:  # unpickled from an earlier version
        key = _key(stabilize)
        object.__setattr__(stabilize, "_key", key)
    return key


def _key(stabilize) -> str:
    # an inline `SFA()` builds its key on every attention call: the string is made once per distinct record (the
    # fields are numbers and flags; their types are part of the record, so 2 and 2.0 keep their own strings)
    fields = tuple((f.name, type(value := getattr(stabilize, f.name)), value) for f in dataclasses.fields(stabilize))
    return _key_of_record(type(stabilize).__name__, fields)


@functools.lru_cache(maxsize=256)
def _key_of_record(kind: str, fields: tuple) -> str:
    # an f-string, not JSON: torch.compile(fullgraph=True) traces it where a model builds its stabilizer inline
    return kind + "(" + ", ".join(f"{name}={value!r}" for name, _, value in fields) + ")"


def _field_value(text: str):
    """A field's value from its repr in a key: a bool, an int, or a float (inf included)."""
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return float(text)


def from_key(key: str | None):
    if key is None:
        return None
    kind, _, fields = key.partition("(")
    pairs = (field.split("=", 1) for field in fields.removesuffix(")").split(", ") if field)
    return {"SFA": SFA, "ClampPbar": ClampPbar}[kind](**{name: _field_value(text) for name, text in pairs})


def check_stabilize(stabilize) -> Stabilizer | None:
    if stabilize is None or isinstance(stabilize, (SFA, ClampPbar)):
        return stabilize
    raise TypeError(f"stabilize: expected None, SFA(...) or ClampPbar(...), got {type(stabilize).__name__}")
