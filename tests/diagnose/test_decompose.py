import pytest
import torch

from stableflash.diagnose.decompose import WqErrorDecomposition, alignment_across_steps, decompose_wq_error, wq_gradient


def _inputs(seed, B=2, T=37, C=24, D=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    w_q = torch.randn(D, C, generator=g, dtype=torch.float64) / C**0.5
    k, v, dout = (torch.randn(B, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    delta_hp = torch.randn(B, T, generator=g, dtype=torch.float64)
    delta_lp = delta_hp + 1e-3 * (torch.rand(B, T, generator=g, dtype=torch.float64) + 0.2)  # biased, as in the seed
    return x, w_q, k, v, dout, delta_hp, delta_lp


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_identity_holds_when_only_delta_differs(seed, causal):
    x, w_q, k, v, dout, d_hp, d_lp = _inputs(seed)
    d = decompose_wq_error(x, w_q, k, v, dout, d_hp, d_lp, scale=8**-0.5, causal=causal).check(1e-6)
    assert d.relative_residual < 1e-10
    assert d.delta_error_frac_positive == 1.0 and d.delta_error_mean > 0
    assert 0 < d.top_singular_share <= 1


def test_identity_fails_loudly_with_a_second_error_source():
    x, w_q, k, v, dout, d_hp, d_lp = _inputs(3)
    dp = dout @ v.transpose(-1, -2)
    measured = (wq_gradient(x, w_q, k, v, dout, d_hp, scale=0.3)
                - wq_gradient(x, w_q, k, v, dout, d_lp, scale=0.3, dp=dp * (1 + 1e-3)))  # dP also perturbed
    d = decompose_wq_error(x, w_q, k, v, dout, d_hp, d_lp, scale=0.3, measured=measured)
    assert d.relative_residual > 1e-3
    with pytest.raises(ValueError, match="differ by more than δ"):
        d.check()


def test_terms_of_one_sign_and_direction_are_fully_similar():
    # every token with the same (PK) row and X row and a positive δ error: all rank-1 terms coincide
    B, T, C, D = 1, 9, 6, 4
    x = torch.ones(B, T, C, dtype=torch.float64)
    w_q = torch.zeros(D, C, dtype=torch.float64)
    k = torch.ones(B, T, D, dtype=torch.float64)
    v = dout = torch.ones(B, T, D, dtype=torch.float64)
    d = decompose_wq_error(x, w_q, k, v, dout, torch.zeros(B, T), torch.full((B, T), 1e-3), scale=0.5, causal=False)
    assert d.token_cosine_mean == pytest.approx(1.0)
    assert d.top_singular_share == pytest.approx(1.0)
    assert alignment_across_steps([d, d]) == [pytest.approx(1.0)]


def test_round_trip(tmp_path):
    d = decompose_wq_error(*_inputs(4), scale=0.3)
    assert WqErrorDecomposition.load(d.save(tmp_path / "d.json")) == d


def test_alignment_is_signed_so_cancellation_shows():
    gen = torch.Generator().manual_seed(11)
    print("seed 11")
    x, k, v, dout = (torch.randn(1, 12, 6, generator=gen, dtype=torch.float64) for _ in range(4))
    w_q = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    delta_hp = torch.randn(1, 12, generator=gen, dtype=torch.float64)
    bump = torch.rand(1, 12, generator=gen, dtype=torch.float64) + 0.5
    up = decompose_wq_error(x, w_q, k[0], v[0], dout[0], delta_hp, delta_hp + bump, scale=0.4)
    down = decompose_wq_error(x, w_q, k[0], v[0], dout[0], delta_hp, delta_hp - bump, scale=0.4)
    assert alignment_across_steps([up, up]) == [pytest.approx(1.0)]
    assert alignment_across_steps([up, down]) == [pytest.approx(-1.0)]
