import math

import pytest
import torch

from stableflash.numerics import BF16, FORMATS, FP8_E4M3, FP8_E5M2, FP16, FP32, get_format


@pytest.mark.parametrize("fmt", [BF16, FP16, FP32, FP8_E4M3, FP8_E5M2])
def test_ranges_match_torch(fmt):
    info = torch.finfo(fmt.torch_dtype)
    assert fmt.max_finite == info.max
    assert fmt.min_normal == info.smallest_normal
    assert fmt.eps == info.eps


@pytest.mark.parametrize("fmt", [BF16, FP16, FP8_E4M3, FP8_E5M2])
def test_encode_matches_torch_bits(fmt):
    values = torch.randn(500) * 4
    values = values.to(fmt.torch_dtype)
    raw = values.view(torch.uint8 if fmt.total_bits == 8 else torch.int16).tolist()
    for value, bits in zip(values.float().tolist(), raw):
        assert fmt.encode(value) == bits & (2**fmt.total_bits - 1)
        assert float(fmt.decode(fmt.encode(value))) == value


def test_seed_bits():
    assert "".join(FP32.bit_fields(-2.4071154594421387)) == "11000000000110100000111000101110"
    assert format(BF16.encode(-4.71875), "016b") == "1100000010010111"


def test_specials_and_errors():
    assert BF16.decode(BF16.encode(math.inf)) == math.inf
    assert math.isnan(FP8_E4M3.decode(0x7F))
    with pytest.raises(ValueError, match="not representable"):
        BF16.encode(1.0 + 2**-9)
    with pytest.raises(ValueError, match="no infinity"):
        FP8_E4M3.encode(math.inf)
    with pytest.raises(ValueError, match="fmt: unknown format"):
        get_format("fp12")
    assert get_format("e4m3") is FP8_E4M3 and get_format(torch.bfloat16) is BF16
    assert set(FORMATS) >= {"bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"}


def test_ulp_is_the_spacing_of_neighbours():
    bf16, fp16 = get_format("bf16"), get_format("fp16")
    assert bf16.ulp(1.0) == 2.0 ** -7 and bf16.ulp(-1024.0) == 8.0 and bf16.ulp(1500.0) == 8.0 and bf16.ulp(512) == 4.0
    assert fp16.ulp(1024.0) == 1.0 and bf16.ulp(0.0) == bf16.min_subnormal and bf16.ulp(float("nan")) == float("inf")
    x = torch.tensor(1000.0, dtype=torch.bfloat16)  # torch agrees: the next value up is one ulp away
    assert (torch.nextafter(x, torch.tensor(2e3, dtype=torch.bfloat16)) - x).item() == bf16.ulp(1000.0)
