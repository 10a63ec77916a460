import pytest
import torch

from stableflash.numerics import BF16, FP8_E4M3, FP8_E5M2, FP16, round_to


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
