"""Binary floating-point formats described by their bits.

A `Format` knows its field widths and derives everything else (bias, range,
spacing) from them, so bf16, fp16, fp32, fp64 and the two OCP fp8 formats are
one class. Values are encoded and decoded exactly with Python integers and
`fractions.Fraction`; no rounding happens here (see `rounding.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch


@dataclass(frozen=True)
class Format:
    """A sign / exponent / fraction layout.

    `has_inf=False` marks the OCP fp8 e4m3 ("fn") layout: no infinities, and
    only the all-ones exponent *and* fraction pattern is NaN, which buys one
    more binade of finite values (max 448).
    """

    name: str
    exponent_bits: int
    fraction_bits: int
    has_inf: bool = True
    torch_dtype: torch.dtype | None = None

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def total_bits(self) -> int:
        return 1 + self.exponent_bits + self.fraction_bits

    @property
    def max_exponent(self) -> int:
        """Largest unbiased exponent of a finite value."""
        top = 2**self.exponent_bits - 1
        return (top if not self.has_inf else top - 1) - self.bias

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal value (also the subnormals' scale)."""
        return 1 - self.bias

    @property
    def max_finite(self) -> float:
        if self.has_inf:
            significand = 2 - Fraction(1, 2**self.fraction_bits)
        else:  # all-ones fraction is NaN in the top binade
            significand = 2 - Fraction(2, 2**self.fraction_bits)
        return float(significand * Fraction(2) ** self.max_exponent)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.min_exponent)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.min_exponent - self.fraction_bits)

    @property
    def eps(self) -> float:
        """Spacing of values just above 1."""
        return math.ldexp(1.0, -self.fraction_bits)

    def ulp(self, x: float) -> float:
        """Spacing of this format's values at |x|: how far apart two neighbours there are (inf for inf/NaN)."""
        if not math.isfinite(x):
            return math.inf
        exponent = max(math.frexp(abs(x))[1] - 1, self.min_exponent) if x else self.min_exponent
        return math.ldexp(1.0, exponent - self.fraction_bits)

    # -- exact encode / decode -------------------------------------------------

    def encode(self, value: float | Fraction) -> int:
        """Bit pattern of `value`, which must be exactly representable."""
        if isinstance(value, float) and math.isnan(value):
            exp_all = 2**self.exponent_bits - 1
            frac = 2**self.fraction_bits - 1 if not self.has_inf else 2 ** (self.fraction_bits - 1)
            return (exp_all << self.fraction_bits) | frac
        sign = 1 if (value < 0 or (isinstance(value, float) and math.copysign(1.0, value) < 0)) else 0
        magnitude = abs(value)
        if isinstance(magnitude, float) and math.isinf(magnitude):
            if not self.has_inf:
                raise ValueError(f"{self.name} has no infinity")
            exponent_field, fraction_field = 2**self.exponent_bits - 1, 0
        elif magnitude == 0:
            exponent_field, fraction_field = 0, 0
        else:
            exact = Fraction(magnitude)
            exponent = _floor_log2(exact)
            if exponent < self.min_exponent:  # subnormal
                exponent_field = 0
                scaled = exact / Fraction(2) ** (self.min_exponent - self.fraction_bits)
            else:
                exponent_field = exponent + self.bias
                scaled = (exact / Fraction(2) ** exponent - 1) * 2**self.fraction_bits
            if scaled.denominator != 1 or exponent > self.max_exponent:
                raise ValueError(f"{float(value)!r} is not representable in {self.name}")
            fraction_field = int(scaled)
        return (sign << (self.total_bits - 1)) | (exponent_field << self.fraction_bits) | fraction_field

    def decode(self, bits: int) -> Fraction | float:
        """Value of a bit pattern (a Fraction when finite, else a float inf/nan)."""
        sign = -1 if bits >> (self.total_bits - 1) & 1 else 1
        exponent_field = (bits >> self.fraction_bits) & (2**self.exponent_bits - 1)
        fraction_field = bits & (2**self.fraction_bits - 1)
        top = 2**self.exponent_bits - 1
        if exponent_field == top and self.has_inf:
            return sign * math.inf if fraction_field == 0 else math.nan
        if exponent_field == top and fraction_field == 2**self.fraction_bits - 1:
            return math.nan
        if exponent_field == 0:
            return sign * Fraction(fraction_field, 2**self.fraction_bits) * Fraction(2) ** self.min_exponent
        significand = 1 + Fraction(fraction_field, 2**self.fraction_bits)
        return sign * significand * Fraction(2) ** (exponent_field - self.bias)

    def bit_fields(self, value: float | Fraction) -> tuple[str, str, str]:
        """(sign, exponent, fraction) bit strings of a representable value."""
        bits = format(self.encode(value), f"0{self.total_bits}b")
        return bits[0], bits[1 : 1 + self.exponent_bits], bits[1 + self.exponent_bits :]


def _floor_log2(x: Fraction) -> int:
    """floor(log2(x)) for a positive Fraction, exactly."""
    guess = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** guess > x:
        guess -= 1
    while Fraction(2) ** (guess + 1) <= x:
        guess += 1
    return guess


BF16 = Format("bf16", 8, 7, torch_dtype=torch.bfloat16)
FP16 = Format("fp16", 5, 10, torch_dtype=torch.float16)
FP32 = Format("fp32", 8, 23, torch_dtype=torch.float32)
FP64 = Format("fp64", 11, 52, torch_dtype=torch.float64)
FP8_E4M3 = Format("fp8_e4m3", 4, 3, has_inf=False, torch_dtype=torch.float8_e4m3fn)
FP8_E5M2 = Format("fp8_e5m2", 5, 2, torch_dtype=torch.float8_e5m2)

# bf16's exponent with fewer fraction bits: the seed's rounding error made larger at its own sites (a dose of it).
# No torch dtype holds them; a site in one of them is stored in fp32, holding values of the format.
NARROW_BF16 = tuple(Format(f"e8m{bits}", 8, bits) for bits in (6, 5, 4, 3))

FORMATS: dict[str, Format] = {f.name: f for f in (BF16, FP16, FP32, FP64, FP8_E4M3, FP8_E5M2, *NARROW_BF16)}
_ALIASES = {
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "float64": "fp64", "double": "fp64", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2",
    "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
}


def get_format(fmt: str | Format | torch.dtype) -> Format:
    """Look a format up by name (`"bf16"`, `"e4m3"`, ...), torch dtype, or pass one through."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for candidate in FORMATS.values():
            if candidate.torch_dtype == fmt:
                return candidate
        raise ValueError(f"fmt: no format for torch dtype {fmt}")
    if isinstance(fmt, str):
        key = _ALIASES.get(fmt.lower(), fmt.lower())
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(f"fmt: unknown format {fmt!r}; expected one of {sorted(FORMATS)}")
