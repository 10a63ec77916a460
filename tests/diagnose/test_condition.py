"""The seed's condition measured: biasable rows, the arms' bias against their noise, and the errors over training."""

import json

import pytest
import torch

from stableflash.attention import AttentionStats, flash_attention
from stableflash.attention.precision import PRESETS
from stableflash.attention.reference import forward
from stableflash.diagnose.condition import (
    arm_policy,
    condition_check,
    tied_rows,
    ulps,
    unmanipulated,
    verdict,
)
from stableflash.diagnose.errors import error_trace
from stableflash.numerics.formats import get_format
from stableflash.numerics.rounding import round_to
from stableflash.train.loop import train


def test_ulps_are_the_formats_spacing():
    e8m4 = get_format("e8m4")
    values = torch.tensor([1.0, 1.9, 2.0, -3.0, 0.75], dtype=torch.float64)
    assert ulps(values, e8m4).tolist() == [2**-4, 2**-4, 2**-3, 2**-3, 2**-5]
    x = torch.tensor([1.0 + 2**-4], dtype=torch.float64)  # one ulp above 1: representable, the next half is not
    assert round_to(x, e8m4, "nearest").item() == x.item()


def test_arms_are_the_documented_policies():
    b3, c4, d4 = arm_policy("B3"), arm_policy("C4"), arm_policy("D4")
    assert (b3.v_operand, b3.pv, b3.rounding) == ("e8m3", "e8m3", "nearest")
    assert (c4.v_operand, c4.pv, c4.rounding, c4.rounding_sites) == ("e8m4", "e8m4", "stochastic", ("pv",))
    assert (d4.v_operand, d4.pv) == ("input", "e8m4")
    assert arm_policy("B7").replace(name="paper") == PRESETS["paper"].replace(v_operand="bf16")
    assert unmanipulated("C3").pv == "fp32" and unmanipulated("C3").rounding == "nearest"
    for bad in ("A4", "B2", "B8", "Bx"):
        with pytest.raises(ValueError, match="arm: expected"):
            arm_policy(bad)


def _row_flags(q, k, v, policy, causal=False):
    flags = {}
    forward(q, k, v, scale=q.shape[-1] ** -0.5, causal=causal, policy=policy, row_flags=flags)
    return flags


def test_biasable_rows_need_ties_a_small_tail_and_a_coarse_product():
    """Sharp rows with n >= 2 tied keys are biasable under paper (P̄V in bf16), rows with one maximum are not, and no
    row is under fa2 (P̄V in fp32); exact ties with a tail below fp32's resolution are not (an exact tie rounds to
    even without bias); soft rows, whose tail is above half an ulp, are not."""
    one, two = tied_rows(heads=2, keys=128, ties=(1, 2), scores=(12.0, 24.0))
    assert not _row_flags(*one, PRESETS["paper"])["biasable"].any()
    flags = _row_flags(*two, PRESETS["paper"])
    assert flags["biasable"].double().mean() > 0.9 and flags["repeated"].all() and flags["positive"].all()
    assert not _row_flags(*two, PRESETS["fa2"])["biasable"].any()
    razor = tied_rows(heads=2, keys=128, ties=(2,), scores=(200.0, 220.0))[0]  # tail ~e^-100: lost in fp32
    assert not _row_flags(*razor, PRESETS["paper"])["biasable"].any()
    soft = tied_rows(heads=2, keys=128, ties=(2,), scores=(0.5, 1.0))[0]  # the other keys carry most of the mass
    assert not _row_flags(*soft, PRESETS["paper"])["biasable"].any()


def test_the_sign_split_of_repeated_maxima():
    """Tied maxima below zero repeat a maximum but not a positive one; the statistics count both columns."""
    g = torch.Generator().manual_seed(0)
    D, T = 16, 32
    w = torch.randn(1, 1, D, generator=g)
    w = w / w.norm() * D**0.5
    k = w * (1.05 + torch.rand(1, T, 1, generator=g))  # every other key scores lower for a negative query
    k[:, :2] = w
    q = -w * (1 + torch.rand(1, T, 1, generator=g)) / D**0.5
    v = torch.randn(1, T, D, generator=g)
    q, k, v = (t.unsqueeze(0).bfloat16() for t in (q, k, v))
    stats = AttentionStats(1)
    flash_attention(q, k, v, causal=False, precision="paper", backend="reference", stats=stats)
    assert stats.repeated_max_rows.item() == T and stats.repeated_max_rows_positive.item() == 0
    flags = _row_flags(q, k, v, PRESETS["paper"])
    assert flags["repeated"].all() and not flags["positive"].any()


def test_the_manipulation_check_finds_the_bias_in_b_and_not_in_c():
    """On sharp tied rows the B arm's error is biased below zero and doubles in absolute size per bit, while the C arm
    (the same rounding, stochastic) has about the same noise and no bias of that size: the check's rule passes."""
    check = condition_check(tied_rows(heads=2, keys=256, ties=(1, 2, 3)), ["B5", "B4", "C4"], causal=False,
                            source="test")
    rows = {(r["arm"], r["group"]): r for r in check.rows}
    b4, c4 = rows[("B4", "biasable")], rows[("C4", "biasable")]
    assert b4["mean"]["high"] < 0 and b4["mean"]["mean"] <= -0.1
    assert abs(c4["mean"]["mean"]) < 0.1 * abs(b4["mean"]["mean"])
    assert rows[("B4", "other")]["n"] > 0  # the single-maximum rows
    outcome = verdict(check)
    assert outcome["passed"], outcome["reasons"]
    assert json.loads(json.dumps(check.to_dict()))["rows"]


def test_the_rule_fails_an_arm_without_bias():
    check = condition_check(tied_rows(heads=2, keys=256, ties=(2,)), ["C4"], causal=False, source="test")
    check.rows = [dict(r, arm="B4") for r in check.rows]  # a "B" arm that rounds without bias
    assert not verdict(check)["passed"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, data_dir):
    from stableflash.train.config import load_config

    out = tmp_path_factory.mktemp("run")
    overrides = [f"data.data_dir={data_dir}", "run.progress=false", "run.max_steps=3", "run.eval_interval=0",
                 "data.grad_accum=2"]
    train(load_config("tiny-cpu", overrides), out)
    return out, overrides


def test_error_trace_is_zero_where_low_is_high_and_sums_every_micro_batch(short_run, tiny):
    run, overrides = short_run
    cfg = tiny(*overrides[2:], "run.max_steps=10")
    same = error_trace(cfg, run, 4, layer=1, low="fp64", high="fp64", estimate_steps=2)
    assert same.steps == [3, 4, 5, 6]
    for group in ("tied", "untied"):
        assert all(v == 0 for step in same.delta_error[group] for v in step)
        assert all(v == 0 for step in same.o_error[group] for v in step)
    rows = cfg.data.batch_size * cfg.data.grad_accum * cfg.model.block_size  # every micro-batch's rows, per head
    assert [t + u for t, u in zip(same.rows["tied"][0], same.rows["untied"][0])] == [rows] * cfg.model.n_head
    assert len(same.wq_drift_along_r) == 2 and len(same.wq_drift_along_r[0]) == cfg.model.n_head
    low = error_trace(cfg, run, 2, layer=0, low="bf16", high="fp64", estimate_steps=1)
    total = [sum(s) for s in zip(low.delta_error["tied"][0], low.delta_error["untied"][0])]
    assert low.cumulative_delta_error[0] == pytest.approx(total)
    assert any(v != 0 for v in low.cumulative_delta_error[-1])
    # with ℓ already in fp32 the share ℓ's rounding makes is exactly zero
    ell32 = PRESETS["bf16"].replace(name="bf16+l32", tile_sum="fp32", row_sum="fp32", row_sum_saved="fp32")
    assert all(v == 0 for v in error_trace(cfg, run, 1, layer=0, low=ell32, estimate_steps=0).delta_error_from_ell[0])
    with pytest.raises(ValueError, match="estimate_steps"):
        error_trace(cfg, run, 2, layer=0, estimate_steps=3)
