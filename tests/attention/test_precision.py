"""Precision policies and stabilizers as plain-string keys (how the fused backend names them)."""

import pickle

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
