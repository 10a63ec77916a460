"""The oracle trace's own pieces, on any machine (in the default run)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import official_trace  # noqa: E402


def test_tied_inputs_hold_exact_tied_maxima_in_both_tiles():
    q, k, v, _ = official_trace.trace_inputs("tied")
    scores = (q.float() @ k.float().transpose(-1, -2)).masked_fill(torch.ones(1024, 1024, dtype=torch.bool).triu(1),
                                                                   float("-inf"))
    top = scores.amax(-1, keepdim=True)
    ties = (scores == top).sum(-1)
    assert (ties[..., 600:] == len(official_trace.SINKS)).float().mean() > 0.99  # every sink wins, exactly tied
    assert (v[:, :, :, :8] > 0).all()
    again = official_trace.trace_inputs("tied")
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again[:3]))  # seeded: the same bits anywhere


def test_bit_equal_counts_nan_as_equal_and_casts_to_the_oracle_dtype():
    a = torch.tensor([1.0, float("nan"), 2.0 + 2 ** -10])
    b = torch.tensor([1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    assert official_trace.bit_equal(a, b) == 1.0
    assert official_trace.bit_equal(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 2.0])) == 0.5
