import math

import pytest
import torch

from stableflash.numerics import BF16, FP8_E4M3, FP8_E5M2, FP16, round_to
from stableflash.numerics.formats import NARROW_BF16


def _samples(n=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    # many magnitudes, including subnormals of the narrow formats and exact ties
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-20, 20, (n,), generator=g)).double()
    ties = (torch.randint(1, 255, (500,), generator=g).double() + 0.5) * 2.0**-7
    return torch.cat([x, ties, -ties, torch.tensor([0.0, -0.0])])


@pytest.mark.parametrize("fmt", [BF16, FP16, FP8_E5M2])
def test_nearest_matches_torch_casts(fmt):
    x = _samples().float().double()  # torch casts from fp32
    ours = round_to(x, fmt)
    theirs = x.float().to(fmt.torch_dtype).double()
    assert torch.equal(ours, theirs)


def test_nearest_e4m3_in_range_matches_torch():
    x = _samples().clamp(-440, 440).float().double()
    assert torch.equal(round_to(x, FP8_E4M3), x.float().to(torch.float8_e4m3fn).double())


def test_overflow_rules():
    big = torch.tensor([1e6, -1e6], dtype=torch.float64)
    assert torch.isinf(round_to(big, FP16)).all()
    assert torch.isnan(round_to(big, FP8_E4M3)).all()  # OCP e4m3 has no infinity (torch's cast saturates)
    assert round_to(big, FP16, "toward_zero").tolist() == [65504.0, -65504.0]
    assert round_to(big, FP16, "up").tolist() == [float("inf"), -65504.0]


def test_toward_zero_and_directed():
    x = _samples()
    for mode, check in [("toward_zero", lambda r: r.abs() <= x.abs()), ("up", lambda r: r >= x), ("down", lambda r: r <= x)]:
        r = round_to(x, BF16, mode)
        assert check(r).all(), mode
        assert torch.equal(round_to(r, BF16), r)  # representable
        assert ((r - x).abs() < BF16.eps * 2 * x.abs().clamp(min=BF16.min_subnormal)).all()


def test_stochastic_is_unbiased_and_seeded():
    x = torch.full((200_000,), 1.0 + 2**-9, dtype=torch.float64)  # a quarter of the way to the next bf16
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a, b = round_to(x, BF16, "stochastic", generator=g1), round_to(x, BF16, "stochastic", generator=g2)
    assert torch.equal(a, b)
    assert set(a.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(a.mean().item() - (1 + 2**-9)) < 4 * (2**-7 * 0.433) / 200_000**0.5
    nearest_bias = round_to(x, BF16).mean().item() - (1 + 2**-9)
    assert abs(nearest_bias) > 1e-3  # nearest rounding is biased here; stochastic is not


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        round_to(torch.ones(1), BF16, "sideways")
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        round_to([1.0], BF16)


def test_counter_bits_give_unbiased_reproducible_stochastic_rounding():
    """The counter-based noise (what the kernels use) is uniform enough that stochastic rounding stays unbiased, is a
    pure function of (seed, site, position), and changes with each of them."""
    from stableflash.numerics.rounding import counter_bits, counter_noise

    rows = torch.arange(200_000)
    bits = counter_bits(7, 3, torch.zeros(()), rows, torch.zeros(()), 0)
    assert torch.equal(bits, counter_bits(7, 3, torch.zeros(()), rows, torch.zeros(()), 0))
    for other in (counter_bits(8, 3, torch.zeros(()), rows, torch.zeros(()), 0),
                  counter_bits(7, 4, torch.zeros(()), rows, torch.zeros(()), 0),
                  counter_bits(7, 3, torch.zeros(()), rows, torch.zeros(()), 1)):
        assert (other != bits).float().mean() > 0.99
    noise = counter_noise(bits, "e8m4")
    assert 0 <= noise.min() and noise.max() < 1 and abs(noise.mean().item() - 0.5) < 0.005
    x = torch.full((200_000,), 1.0 + 2**-6, dtype=torch.float32)  # a quarter of e8m4's spacing above 1
    rounded = round_to(x, "e8m4", "stochastic", noise=noise)
    assert abs(rounded.mean().item() - x[0].item()) < 2e-4  # unbiased: round_to to nearest would give 1.0


def _representable(fmt) -> torch.Tensor:
    """Every finite value >= 0 of a format, ascending, from torch's own dtypes' bit patterns (not this library's
    formats): bf16, fp16 and fp8 as they are; e8mN as the bf16 values whose low 7 - N fraction bits are 0."""
    if fmt.torch_dtype is not None:
        width = torch.finfo(fmt.torch_dtype).bits
        patterns = torch.arange(2 ** (width - 1), dtype=torch.int32)  # the sign bit 0
        view = {8: torch.uint8, 16: torch.int16}[width]
        values = patterns.to(view).view(fmt.torch_dtype).double()
    else:
        patterns = torch.arange(2**15, dtype=torch.int32)
        patterns = patterns[patterns % 2 ** (7 - fmt.fraction_bits) == 0]
        values = patterns.to(torch.int16).view(torch.bfloat16).double()
    return values[torch.isfinite(values)]


@pytest.mark.parametrize("fmt", [BF16, FP16, FP8_E4M3, FP8_E5M2, *NARROW_BF16], ids=lambda f: f.name)
def test_every_mode_gives_the_neighbour_a_brute_force_search_gives(fmt):
    """x against the sorted list of the format's values: nearest (ties to the even pattern; past the largest value
    plus half a spacing infinity, NaN without one), toward zero, up and down (past the largest value: infinity on
    the side rounded to, the largest value on the other), on random magnitudes through the subnormals, exact
    midpoints, the values themselves and values past the range."""
    values = _representable(fmt)
    top, spacing = values[-1].item(), (values[-1] - values[-2]).item()
    g = torch.Generator().manual_seed(7)
    n = 4000
    lowest = values[1].log2().item()
    magnitudes = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * (math.log2(top) + 2 - lowest) + lowest)
    pick = torch.randint(0, len(values) - 1, (n,), generator=g)
    midpoints = (values[pick] + values[pick + 1]) / 2
    x = torch.cat([magnitudes, midpoints, values[pick], torch.tensor([top + spacing / 2, top + spacing / 4])])
    x = torch.cat([x, -x])
    a = x.abs()
    upper_i = torch.searchsorted(values, a).clamp(max=len(values) - 1)  # first value >= |x|
    exact = values[upper_i] == a
    lower_i = torch.where(exact, upper_i, upper_i - 1)
    past = a > top
    lower = torch.where(past, top, values[lower_i])
    upper = torch.where(past, math.inf, values[upper_i])
    # past the largest value, nearest rounds as if the format went on by one spacing, that next pattern odd or even
    # in turn, and gives infinity where it would take it: e4m3's largest value is even, so 464 gives 448
    below = a - lower
    above = torch.where(past, top + spacing - a, upper - a)
    even_lower = torch.where(past, (len(values) - 1) % 2 == 0, lower_i % 2 == 0)
    takes_lower = (below < above) | ((below == above) & even_lower)
    nearest = torch.where(takes_lower, lower, torch.where(past, math.inf, upper))
    sign = torch.sign(x)
    expected = {"nearest": sign * nearest, "toward_zero": sign * lower,
                "up": torch.where(x >= 0, upper, -lower), "down": torch.where(x >= 0, lower, -upper)}
    for mode, want in expected.items():
        if not fmt.has_inf:
            want = torch.where(torch.isinf(want), math.nan, want)
        got = round_to(x, fmt, mode)
        bad = ~((got == want) | (torch.isnan(got) & torch.isnan(want)))
        assert not bad.any(), (f"{fmt.name} {mode}: {int(bad.sum())} of {len(x)} differ, e.g. x = {x[bad][:3].tolist()}"
                               f" gave {got[bad][:3].tolist()}, expected {want[bad][:3].tolist()}")
