"""Precision policies and stabilizers as plain-string keys (how the fused backend names them)."""

import pickle

import pytest

from stableflash.attention import precision, stabilize
from stableflash.attention.precision import resolve
from stableflash.attention.stabilize import SFA


def test_unpickled_policies_and_stabilizers_are_found_by_their_keys():
    # the fused backend names them by `cache_key`; a policy restored from a checkpoint must resolve too
    policy = resolve("paper").with_pv_fp32().replace(block_m=256)
    sfa = SFA(beta=3.0)
    blobs = pickle.dumps(policy), pickle.dumps(sfa)
    del precision._BY_CACHE_KEY[policy.cache_key], stabilize._BY_CACHE_KEY[sfa.cache_key]  # as in a new process
    restored, restored_sfa = (pickle.loads(b) for b in blobs)
    assert precision.from_cache_key(restored.cache_key) == policy
    assert stabilize.from_cache_key(restored_sfa.cache_key) == sfa


def test_one_pass_takes_another_presets_formats():
    from stableflash.attention.precision import BACKWARD_SITES, FORWARD_SITES, PRESETS, SITES

    assert FORWARD_SITES + BACKWARD_SITES == tuple(SITES) and FORWARD_SITES[-1] == "lse"
    base, fa2 = PRESETS["bf16"], PRESETS["fa2"]
    fwd = base.with_pass_of("forward", "fa2")
    assert all(getattr(fwd, s) == getattr(fa2, s) for s in FORWARD_SITES)
    assert all(getattr(fwd, s) == getattr(base, s) for s in BACKWARD_SITES)
    assert (fwd.block_n, fwd.tile_sum_clamp) == (base.block_n, base.tile_sum_clamp)  # not a site: stays
    bwd = base.with_pass_of("backward", fa2)
    assert all(getattr(bwd, s) == getattr(fa2, s) for s in BACKWARD_SITES) and bwd.qk == "bf16"
    with pytest.raises(ValueError, match="which: expected 'forward' or 'backward'"):
        base.with_pass_of("sideways", "fa2")
