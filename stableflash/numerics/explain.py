"""The bit-level walk through one floating-point addition (the seed's section 3.4.4).

`explain_add(a, b, fmt)` adds two operands held in a wide accumulator format
(fp32 by default, as in a matmul's accumulator), then rounds the exact sum to
`fmt` with round-to-nearest-even, recording every step a hardware adder takes:
exponent alignment, significand sum, overflow and renormalisation, the guard,
round and sticky bits, and the rounding decision.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction

from stableflash.numerics.formats import FP32, Format, _floor_log2, get_format


@dataclass(frozen=True)
class Operand:
    value: float
    sign: str
    exponent_bits: str
    fraction_bits: str
    exponent: int  # unbiased
    significand: str  # "1.xxxx" (or "0.xxxx" for a subnormal)


@dataclass(frozen=True)
class AdditionExplanation:
    """Every intermediate of `a + b` rounded to `format`; `str()` renders the walk."""

    a: Operand
    b: Operand
    operand_format: str
    format: str
    alignment_shift: int
    aligned_a: str
    aligned_b: str
    significand_sum: str
    overflowed: bool
    normalized_significand: str
    normalized_exponent: int
    kept_fraction: str
    guard_bit: int
    round_bit: int
    sticky_bit: int
    rounded_up: bool
    decision: str
    result: float
    result_bits: str
    exact_sum: float
    error: float

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"{self.operand_format} operands, sum rounded to {self.format} (round to nearest, ties to even)"]
        for label, op in (("a", self.a), ("b", self.b)):
            lines.append(
                f"  {label} = {op.value!r:<22} sign {op.sign}  exponent {op.exponent_bits} ({op.exponent:+d})"
                f"  significand {op.significand}")
        lines.append(f"1. align exponents: shift the smaller operand right by {self.alignment_shift}")
        width = max(len(self.aligned_a), len(self.aligned_b), len(self.significand_sum))
        lines.append(f"     {self.aligned_a:>{width}}")
        lines.append(f"   + {self.aligned_b:>{width}}")
        lines.append(f"2. significand sum:  {self.significand_sum}")
        if self.overflowed:
            lines.append("3. significand overflow (>= 2): shift right by one, exponent + 1")
        else:
            lines.append("3. no significand overflow; normalise if needed")
        lines.append(f"   normalised: {self.normalized_significand} x 2^{self.normalized_exponent}")
        lines.append(
            f"4. keep {len(self.kept_fraction)} fraction bits {self.kept_fraction} | guard {self.guard_bit}"
            f" | round {self.round_bit} | sticky {self.sticky_bit}")
        lines.append(f"5. decision: {self.decision}")
        lines.append(f"6. result ({self.format}): bits {self.result_bits} = {self.result!r}")
        lines.append(f"   exact sum: {self.exact_sum!r}")
        lines.append(f"   error (result - exact): {self.error!r}")
        return "\n".join(lines)


def _operand(value: Fraction, fmt: Format) -> Operand:
    sign, exp_bits, frac_bits = fmt.bit_fields(float(value))
    exponent_field = int(exp_bits, 2)
    exponent = exponent_field - fmt.bias if exponent_field else fmt.min_exponent
    lead = "1" if exponent_field else "0"
    return Operand(float(value), sign, exp_bits, frac_bits, exponent, f"{lead}.{frac_bits}")


def _binary(magnitude: Fraction, exponent: int, fraction_bits: int, negative: bool) -> str:
    """`magnitude / 2**exponent` written in binary with `fraction_bits` bits after the point."""
    scaled = magnitude / Fraction(2) ** exponent * 2**fraction_bits
    assert scaled.denominator == 1, "value needs more fraction bits than given"
    digits = format(int(scaled), "b").rjust(fraction_bits + 1, "0")
    text = f"{digits[:-fraction_bits] or '0'}.{digits[-fraction_bits:]}" if fraction_bits else digits
    return ("-" if negative else "") + text


def explain_add(a: float, b: float, fmt: str | Format = "bf16", operand_format: str | Format = FP32) -> AdditionExplanation:
    """Explain, bit by bit, how `a + b` is rounded to `fmt`.

    `a` and `b` must be exactly representable in `operand_format` (fp32 by
    default); the sum is exact before the single rounding to `fmt`.
    """
    fmt, operand_format = get_format(fmt), get_format(operand_format)
    values = []
    for name, value in (("a", a), ("b", b)):
        if not math.isfinite(value):
            raise ValueError(f"{name}: expected a finite number, got {value!r}")
        try:
            operand_format.encode(float(value))
        except ValueError:
            raise ValueError(
                f"{name}: {value!r} is not exactly representable in {operand_format.name}") from None
        values.append(Fraction(float(value)))
    fa, fb = values
    op_a, op_b = _operand(float(a), operand_format), _operand(float(b), operand_format)  # floats keep a zero's sign

    # -- 1. alignment: both significands on the larger exponent's scale --
    big_exp = max(op_a.exponent, op_b.exponent)
    shift = abs(op_a.exponent - op_b.exponent)
    frac_width = operand_format.fraction_bits + shift
    aligned_a = _binary(abs(fa), big_exp, frac_width, fa < 0)
    aligned_b = _binary(abs(fb), big_exp, frac_width, fb < 0)

    # -- 2. the exact sum, on the same scale --
    exact = fa + fb
    total = _binary(abs(exact), big_exp, frac_width, exact < 0) if exact != 0 else "0"

    if exact == 0:  # IEEE: -0 only as (-0) + (-0); x + (-x) is +0 under round to nearest
        zero = -0.0 if op_a.sign == op_b.sign == "1" else 0.0
        zero_bits = format(fmt.encode(zero), f"0{fmt.total_bits}b")
        return AdditionExplanation(op_a, op_b, operand_format.name, fmt.name, shift, aligned_a, aligned_b,
                                   total, False, "0", 0, "0" * fmt.fraction_bits, 0, 0, 0, False,
                                   "exact zero", zero, zero_bits, 0.0, 0.0)

    # -- 3. normalisation: leading one back to the units place --
    magnitude = abs(exact)
    exponent = max(_floor_log2(magnitude), fmt.min_exponent)
    overflowed = exponent > big_exp
    units = magnitude / Fraction(2) ** exponent  # in [1, 2), or < 1 if subnormal in fmt
    needed = 0
    while (units * 2**needed).denominator != 1:
        needed += 1
    needed = max(needed, fmt.fraction_bits + 2)
    normalized = _binary(magnitude, exponent, needed, exact < 0)

    # -- 4. guard / round / sticky against fmt's fraction width --
    scaled = units * 2**fmt.fraction_bits
    kept = int(scaled)  # integer significand, truncated
    remainder = scaled - kept  # in [0, 1)
    guard = int(remainder >= Fraction(1, 2))
    round_bit = int((remainder * 2) % 1 >= Fraction(1, 2))
    sticky = int((remainder * 4) % 1 != 0)
    lsb = kept & 1
    round_up = bool(guard and (round_bit or sticky or lsb))
    if not guard:
        decision = "guard bit 0: below halfway, truncate (round toward zero)"
    elif round_bit or sticky:
        decision = "guard bit 1 with round/sticky bits set: above halfway, round up (away from zero)"
    elif lsb:
        decision = "exact tie with odd last bit: round up to even"
    else:
        decision = "exact tie with even last bit: keep"
    rounded_units = Fraction(kept + round_up, 2**fmt.fraction_bits)
    result_magnitude = rounded_units * Fraction(2) ** exponent
    kept_bits = format(kept % 2**fmt.fraction_bits, f"0{fmt.fraction_bits}b") if fmt.fraction_bits else ""
    negative = exact < 0
    if result_magnitude > Fraction(fmt.max_finite):
        result = -math.inf if negative else math.inf
        if not fmt.has_inf:
            result = math.nan
        decision += f"; exceeds {fmt.name}'s largest finite value, overflow"
    else:  # a negative sum that rounds to zero keeps its sign: -0
        result = -float(result_magnitude) if negative else float(result_magnitude)
    result_bits = format(fmt.encode(result), f"0{fmt.total_bits}b")
    error = float(Fraction(result) - exact) if math.isfinite(result) else result
    return AdditionExplanation(
        a=op_a, b=op_b, operand_format=operand_format.name, format=fmt.name, alignment_shift=shift,
        aligned_a=aligned_a, aligned_b=aligned_b, significand_sum=total, overflowed=overflowed,
        normalized_significand=normalized, normalized_exponent=exponent, kept_fraction=kept_bits,
        guard_bit=guard, round_bit=round_bit, sticky_bit=sticky, rounded_up=round_up, decision=decision,
        result=result, result_bits=result_bits, exact_sum=float(exact), error=error,
    )
