"""SFA and ClampPbar: the NaN holes, the bounded rule, and the statistics."""

import math

import pytest
import torch
from conftest import rel_err, tied_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

from stableflash import SFA, AttentionStats, ClampPbar, flash_attention
from stableflash.attention import PRESETS
from stableflash.attention import stabilize as stabilizers


def _rows_as_inputs(row: list[float], dtype):
    """q, k, v where every query's scores (scale 1) are exactly `row` (k = identity)."""
    T = len(row)
    q = torch.tensor(row, dtype=dtype).expand(1, 1, T, T).contiguous()
    k = torch.eye(T, dtype=dtype)[None, None]
    v = torch.randn(1, 1, T, T, generator=torch.Generator().manual_seed(T)).to(dtype)
    return q, k, v


score = st.floats(-1e4, 1e4, allow_nan=False, width=16).filter(math.isfinite)


@settings(max_examples=60, deadline=None)
@given(st.lists(score, min_size=2, max_size=12), st.integers(2, 4), st.sampled_from([torch.bfloat16, torch.float32]),
       st.sampled_from([1.5, 2.0, 8.0]), st.sampled_from(["paper", "bf16", "fa2", "fp32"]))
def test_bounded_sfa_never_nan_or_inf(row, ties, dtype, beta, preset):
    top = max(row)
    row = row + [top] * (ties - 1)  # tied maxima
    q, k, v = _rows_as_inputs(row, dtype)
    out = flash_attention(q, k, v, causal=False, scale=1.0, stabilize=SFA(beta=beta), precision=preset,
                          backend="reference")
    assert torch.isfinite(out).all()


def test_unbounded_sfa_nan_case():
    # a repeated maximum of 200: the paper's rule shifts by (beta-1)*200, every P̄ underflows, 0/0
    row = [200.0, 200.0, 3.0, -5.0]
    q, k, v = _rows_as_inputs(row, torch.float32)
    paper_rule = flash_attention(q, k, v, causal=False, scale=1.0, stabilize=SFA(bounded=False), precision="fa2",
                                 backend="reference")
    assert torch.isnan(paper_rule).all()
    bounded = flash_attention(q, k, v, causal=False, scale=1.0, stabilize=SFA(), precision="fa2", backend="reference")
    exact = flash_attention(q.double(), k.double(), v.double(), causal=False, scale=1.0, backend="math")
    assert torch.isfinite(bounded).all()
    assert rel_err(bounded, exact) < 1e-2


def test_unbounded_sfa_rounds_to_one_for_tiny_maxima():
    # rm = 2^-10 repeated: exp(-(beta-1) rm) rounds to 1 in bf16, so the paper's rule still makes P̄ = 1
    row = [2.0**-10, 2.0**-10, -1.0, -2.0]
    q, k, v = _rows_as_inputs(row, torch.bfloat16)
    for sfa, expect_ones in ((SFA(bounded=False), True), (SFA(), False)):
        stats = AttentionStats(1)
        flash_attention(q, k, v, causal=False, scale=1.0, stabilize=sfa, precision="paper", backend="reference", stats=stats)
        assert (stats.pbar_ones.item() > 0) == expect_ones


def test_stats_tied_maxima_standard_vs_sfa():
    q, k, v = tied_inputs(2, T=64, heads=3)
    rows = q.shape[1] * q.shape[2]
    plain, sfa = AttentionStats(3), AttentionStats(3)
    flash_attention(q, k, v, causal=False, precision="paper", backend="reference", stats=plain)
    flash_attention(q, k, v, causal=False, precision="paper", backend="reference", stabilize=SFA(), stats=sfa)
    assert plain.repeated_max_rows.sum().item() == rows
    assert plain.pbar_ones.sum().item() >= 2 * rows
    assert sfa.pbar_ones.sum().item() == 0
    assert sfa.repeated_max_rows.sum().item() == rows
    assert plain.rows.tolist() == [64, 64, 64]
    assert (plain.max_score > 0).all()


def test_clamp_pbar_removes_ones_but_keeps_temperature():
    q, k, v = tied_inputs(3, T=64)
    stats = AttentionStats(4)
    out = flash_attention(q, k, v, causal=False, precision="paper", stabilize=ClampPbar(), backend="reference", stats=stats)
    assert stats.pbar_ones.sum().item() == 0
    exact = flash_attention(*(t.double() for t in (q, k, v)), causal=False, backend="math")
    assert rel_err(out, exact) < 2e-2


def test_sfa_error_not_worse_than_plain_on_random_inputs():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 150, 64, generator=g).bfloat16() for _ in range(3))
    exact = flash_attention(*(t.double() for t in (q, k, v)), backend="math")
    plain = rel_err(flash_attention(q, k, v, precision="fa2", backend="reference"), exact)
    sfa = rel_err(flash_attention(q, k, v, precision="fa2", stabilize=SFA(), backend="reference"), exact)
    assert sfa <= plain * 1.05


def test_sfa_in_tiles_counts_ties_within_a_tile():
    q, k, v = tied_inputs(2, T=64)
    policy = PRESETS["paper"].replace(block_m=16, block_n=16)
    stats = AttentionStats(4)
    flash_attention(q, k, v, causal=False, precision=policy, stabilize=SFA(), backend="reference", stats=stats)
    assert stats.pbar_ones.sum().item() == 0


def test_stats_accumulate_over_calls_on_head_slices_and_index_heads():
    stats = AttentionStats(3)
    stats.add(slice(None), rows=10, repeated_max_rows=torch.tensor([1, 0, 2], dtype=torch.int32),
              pbar_ones=torch.tensor([3, 3, 3]), max_score=torch.tensor([0.5, -1.0, 2.0]))
    stats.add(torch.tensor([2, 0]), rows=4, repeated_max_rows=torch.tensor([1, 1]), pbar_ones=torch.tensor([0, 5]),
              max_score=torch.tensor([1.0, 7.0]))
    assert stats.rows.tolist() == [14, 10, 14]
    assert stats.repeated_max_rows.tolist() == [2, 0, 3]
    assert stats.pbar_ones.tolist() == [8, 3, 3]
    assert stats.max_score.tolist() == [7.0, -1.0, 2.0]
    assert stats.rows.dtype == stats.pbar_ones.dtype == torch.int64


def test_kernel_counts_add_by_column_and_named_counters_default_to_zero():
    """A kernel's (heads, 5) counters land column by column (`STAT_COLUMNS`); `add` without the sign split or the
    biasable rows adds zeros there."""
    stats = AttentionStats(4)
    stats.add_counts(slice(1, 3), torch.tensor([[1, 1, 2, 3, 0], [4, 2, 5, 6, 1]]), torch.tensor([5.0, 6.0]))
    assert stats.to_dict() == {"repeated_max_rows": [0, 1, 4, 0], "repeated_max_rows_positive": [0, 1, 2, 0],
                               "pbar_ones": [0, 2, 5, 0], "rows": [0, 3, 6, 0], "biasable_rows": [0, 0, 1, 0],
                               "max_score": [-float("inf"), 5.0, 6.0, -float("inf")]}
    stats.add(torch.tensor([3]), rows=2, repeated_max_rows=1, pbar_ones=0, max_score=torch.tensor([1.0]))
    assert stats.counts[3].tolist() == [1, 0, 0, 2, 0] and stats.max_score[3].item() == 1.0


def test_official_sfa_is_the_unbounded_rule_and_emulated_in_the_kernels():
    rule = SFA.official()
    assert (rule.beta, rule.eps, rule.bounded, rule.official_rule) == (2.0, 1e-3, False, True)
    with pytest.raises(ValueError, match="SFA.official_rule"):
        SFA(official_rule=True)
    from stableflash.attention.triton.spec import build_spec, unsupported_reason
    for preset in ("paper", "fa2"):  # the emulation kernels run it, under fa2's numerics too
        assert unsupported_reason(PRESETS[preset], rule, torch.bfloat16) is None
        assert not build_spec(PRESETS[preset], rule, torch.bfloat16, 128).native
    # a tied maximum of 200: the official rule shifts every P̄ into underflow, and the official row-sum clamp
    # (1e-10, in `paper`) turns 0/0 into O = 0: the row's output is lost
    q, k, v = _rows_as_inputs([200.0, 200.0, 3.0, -5.0], torch.float32)
    official = flash_attention(q, k, v, causal=False, scale=1.0, stabilize=rule, precision="paper", backend="reference")
    bounded = flash_attention(q, k, v, causal=False, scale=1.0, stabilize=SFA(), precision="paper", backend="reference")
    assert (official == 0).all() and torch.isfinite(bounded).all() and (bounded != 0).any()


def test_official_sfa_visits_fully_masked_tiles():
    """Causal rows of the first query tile meet a key tile with no visible key: the official loop visits it and
    m becomes max(m, 0), which in fp64 changes nothing but the path (O equals plain attention's)."""
    gen = torch.Generator().manual_seed(5)
    print("seed 5")
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    q = q - 3.0 * k.mean(2, keepdim=True)  # mostly negative scores: m < 0 before the masked tile
    tiles = PRESETS["fp64"].replace(block_m=4, block_n=4)
    plain = flash_attention(q, k, v, causal=True, precision="fp64", backend="reference")
    official = flash_attention(q, k, v, causal=True, precision=tiles, stabilize=SFA.official(), backend="reference")
    assert rel_err(official, plain) < 1e-12
    # in bf16 the extra rescale by exp(m - max(m, 0)) rounds O once more: the rule is visibly a different path
    low = tiles.replace(**{s: "bf16" for s in ("acc_scaled", "acc")})
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    visited = flash_attention(qb, kb, vb, causal=True, precision=low, stabilize=SFA.official(), backend="reference")
    skipped = flash_attention(qb, kb, vb, causal=True, precision=low, stabilize=SFA(bounded=False), backend="reference")
    assert not torch.equal(visited, skipped)


@pytest.mark.parametrize("stabilize", [SFA(), SFA(beta=3), SFA(beta=2), SFA(eps=0.0, bounded=False), SFA.official(),
                                       SFA(max_shift=math.inf), SFA(eps=1e-30), ClampPbar(), ClampPbar(eps=1e-2)],
                         ids=repr)
def test_a_stabilizer_and_its_key_give_each_other_back(stabilize):
    """The key is what torch.compile holds as a constant: it names the record exactly, and equal records (an inline
    `SFA()` on every call) get the same string."""
    key = stabilizers.key_of(stabilize)
    back = stabilizers.from_key(key)
    assert back == stabilize and type(back) is type(stabilize)
    assert all(type(getattr(back, f)) is type(getattr(stabilize, f)) for f in stabilize.__dataclass_fields__)
    again = type(stabilize)(**{f: getattr(stabilize, f) for f in stabilize.__dataclass_fields__})
    assert stabilizers.key_of(again) == key
    assert stabilizers.key_of(SFA(beta=3.5)) != stabilizers.key_of(SFA(beta=3.0))


def test_a_stabilizer_built_inside_compiled_code_traces_whole():
    """A model that writes `stabilize=SFA(...)` inline in its forward compiles with fullgraph=True: the record's key is
    built by code dynamo traces. (aot_eager: on the CPU, inductor's C++ for the rounding to narrow formats does not
    build, a torch bug; see the README.)"""
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True, stabilize=SFA(beta=3.0), backend="reference")

    torch._dynamo.reset()
    assert torch.equal(torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v), attend(q, k, v))
