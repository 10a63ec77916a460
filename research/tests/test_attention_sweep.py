"""The random differential sweep (research/attention_sweep.py): fresh cases pass on the CPU, and the sweep sees
planted faults."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attention_sweep  # noqa: E402


def test_fresh_cases_pass_against_the_dense_fp64_softmax():
    """400 cases from a fresh seed every run (printed, so a failure names it: `--seed S --cases 400`)."""
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"attention sweep: --seed {seed} --cases 400")
    records = [attention_sweep.run_case(seed + i, "cpu", 96, attention_sweep.TARGETS) for i in range(400)]
    failed = [(r["seed"], r["params"], r["failures"]) for r in records if r["failures"]]
    assert not failed, f"base seed {seed}: {failed[:3]}"
    assert {r["params"]["target"] for r in records} == set(attention_sweep.TARGETS)


@pytest.mark.parametrize("fault", ["top-left causal", "scale", "lse", "stats", "strides"])
def test_the_sweep_sees_a_planted_fault(monkeypatch, fault):
    """flash_attention with a fault of the size real ones have: causal aligned to the top left when Tk != Tq, a
    scale off by 1%, a log-sum-exp off by 0.01, a largest score 1% high in the statistics, or q read as if it were
    contiguous (a kernel that ignores a stride)."""
    honest = attention_sweep.flash_attention

    def faulty(q, k, v, **kw):
        if fault == "top-left causal" and kw.get("causal") and k.shape[-2] != q.shape[-2] and kw.get("window") in (
                None, (-1, -1)):
            Tq, Tk = (q.shape[1], k.shape[1]) if kw.get("layout") == "bthd" else (q.shape[-2], k.shape[-2])
            kw = dict(kw, causal=False, attn_mask=torch.ones(Tq, Tk, dtype=torch.bool).tril())
        if fault == "strides" and not q.is_contiguous():
            q = torch.as_strided(q, q.shape, torch.empty(q.shape).stride(), q.storage_offset())
        if fault == "scale":
            kw = dict(kw, scale=(kw.get("scale") or q.shape[-1] ** -0.5) * 1.01)
        result = honest(q, k, v, **kw)
        if fault == "stats" and kw.get("stats") is not None:
            kw["stats"].max_score.mul_(1.01)
        if fault == "lse" and kw.get("return_lse"):
            return result[0], result[1] + 0.01
        return result

    monkeypatch.setattr(attention_sweep, "flash_attention", faulty)
    records = [attention_sweep.run_case(i, "cpu", 96, ("flash_attention",)) for i in range(60)]
    assert sum(bool(r["failures"]) for r in records) >= 5


def test_the_sweep_sees_rotary_pairs_swapped_in_the_kv_cache_call(monkeypatch):
    honest = attention_sweep.flash_attn_with_kvcache

    def swapped(*args, rotary_interleaved=True, **kw):
        return honest(*args, rotary_interleaved=not rotary_interleaved, **kw)

    monkeypatch.setattr(attention_sweep, "flash_attn_with_kvcache", swapped)
    records = [attention_sweep.run_case(i, "cpu", 96, ("flash_attn_with_kvcache",)) for i in range(80)]
    rotary = [r for r in records if r["params"]["rotary"] != "none"]
    assert len(rotary) >= 20 and sum(bool(r["failures"]) for r in rotary) >= len(rotary) // 2
    assert not any(r["failures"] for r in records if r["params"]["rotary"] == "none")
