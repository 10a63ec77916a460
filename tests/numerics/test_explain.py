import math
from fractions import Fraction

import pytest
import torch

from stableflash.numerics import explain_add


def test_seed_worked_example():
    e = explain_add(-2.4071154594421387, -2.296875)
    assert e.exact_sum == -4.703990459442139
    assert e.result == -4.71875
    assert e.result_bits == "1100000010010111"
    assert e.error == -0.014759540557861328
    assert e.overflowed and e.guard_bit == 1 and e.round_bit == 0 and e.sticky_bit == 1 and e.rounded_up
    assert e.significand_sum == "-10.01011010000111000101110"
    text = str(e)
    for needle in ("-4.703990459442139", "-4.71875", "1100000010010111", "-0.014759540557861328"):
        assert needle in text


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e5m2"])
def test_agrees_with_torch_on_random_pairs(fmt):
    g = torch.Generator().manual_seed(3)
    pairs = (torch.randn(300, 2, generator=g) * torch.exp2(torch.randint(-6, 6, (300, 2), generator=g))).tolist()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e5m2": torch.float8_e5m2}[fmt]
    for a, b in pairs:
        e = explain_add(a, b, fmt)
        exact = Fraction(a) + Fraction(b)
        assert e.exact_sum == float(exact)
        # torch: the fp64 sum of two fp32 values is exact here, then one rounding
        expected = torch.tensor(float(exact), dtype=torch.float64).to(dtype).double().item()
        assert e.result == expected
        assert e.error == float(Fraction(e.result) - exact)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_a_zero_result_carries_ieees_sign(fmt):
    """A negative sum that underflows to zero is -0, (-0) + (-0) is -0, and x + (-x) is +0, as torch's casts and
    adds give them."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    for a, b in ((-(2.0**-149), 0.0), (-(2.0**-140), -(2.0**-149)), (-0.0, -0.0), (1.5, -1.5), (-0.0, 0.0)):
        e = explain_add(a, b, fmt)
        expected = (torch.tensor(a, dtype=torch.float64) + b).to(dtype)  # exact in fp64, then one rounding
        assert e.result == 0.0 and math.copysign(1.0, e.result) == math.copysign(1.0, expected.item()), (a, b)
        assert e.result_bits == format(expected.view(torch.int16).item() & 0xFFFF, "016b"), (a, b)


def test_zero_sum_and_bad_input():
    assert explain_add(1.5, -1.5).result == 0.0
    with pytest.raises(ValueError, match="a: .* not exactly representable in fp32"):
        explain_add(0.1, 1.0)
    with pytest.raises(ValueError, match="b: expected a finite number"):
        explain_add(1.0, math.inf)
