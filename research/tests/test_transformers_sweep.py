"""The transformers sweep (research/transformers_sweep.py): fresh cases pass on the CPU, and it sees planted faults
in the integration."""

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import transformers_sweep  # noqa: E402

from stableflash.integrations import transformers as integration  # noqa: E402


def _run(cases):
    integration.register()
    return [transformers_sweep.run_case(case, torch.device("cpu"), torch.float32) for case in cases]


def test_fresh_cases_match_the_models_own_attention():
    """120 cases from a fresh seed every run (printed, so a failure names it: `--seed S --cases 120`)."""
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"transformers sweep: --seed {seed} --cases 120")
    results = _run(transformers_sweep.draw(s, 24) for s in range(seed, seed + 120))
    failed = [(r["case"]["seed"], r["failures"]) for r in results if r["failures"]]
    assert not failed, f"base seed {seed}: {failed[:3]}"
    assert {r["case"]["arch"] for r in results} == set(transformers_sweep.ARCHITECTURES)


def _padded(case):  # right padding hides behind causality: no real query sees a key after it
    return case["padding_side"] == "left" and any(case["padding"])


def _windowed(case):
    return case.get("sliding_window") is not None and case["sliding_window"] < case["length"]


@pytest.mark.parametrize("fault, applies", [("padding ignored", _padded), ("window one wider", _windowed),
                                            ("scale", lambda case: True), ("softcap ignored",
                                                                             lambda case: case["arch"] == "gemma2")])
def test_the_sweep_sees_a_planted_fault(monkeypatch, fault, applies):
    """The integration's call of `flash_attention` with a fault of a real one's size: key padding dropped, a sliding
    window one key wider, a scale 1% off, Gemma 2's cap left out. Among cases where the fault can show, most fail."""
    honest = integration.flash_attention

    def faulty(q, k, v, **kw):
        if fault == "padding ignored":
            kw["key_padding_mask"] = None
        if fault == "window one wider" and kw.get("window") is not None:
            kw["window"] = (kw["window"][0] + 1, kw["window"][1])
        if fault == "scale":
            kw["scale"] = (kw.get("scale") or q.shape[-1] ** -0.5) * 1.01
        if fault == "softcap ignored":
            kw["softcap"] = 0.0
        return honest(q, k, v, **kw)

    monkeypatch.setattr(integration, "flash_attention", faulty)
    cases = [c for c in (transformers_sweep.draw(s, 24) for s in range(400)) if applies(c)][:25]
    results = _run(cases)
    assert sum(bool(r["failures"]) for r in results) >= 0.6 * len(results), fault


def test_the_sweep_sees_packed_sequences_attending_across_each_other(monkeypatch):
    """The integration without its packing (position_ids restarting at 0 read as one sequence)."""
    monkeypatch.setattr(integration, "_packed_offsets", lambda position_ids, batch_size: None)
    cases = [c for c in (transformers_sweep.draw(s, 24) for s in range(200)) if c.get("packed")][:20]
    results = _run(cases)
    assert sum(any(f.startswith("packed") for f in r["failures"]) for r in results) >= 0.8 * len(results)
