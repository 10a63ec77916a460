import math

import pytest
import torch

from stableflash.diagnose.bias import BiasAttribution, bias_attribution
from stableflash.diagnose.delta import DeltaErrors, delta_error, model_delta_errors
from stableflash.diagnose.mechanism import tied_maxima_inputs
from stableflash.diagnose.pv_trace import PVTrace, pv_trace, pv_trace_from_attention
from stableflash.diagnose.record import Record


def test_site_contributions_and_remainder_sum_to_the_total(tmp_path):
    q, k, v, dout = tied_maxima_inputs(4, heads=4, keys=128)
    a = bias_attribution(q, k, v, dout, "paper")
    for key in ("o", "delta"):
        parts = sum(row[key]["mean"] for row in a.sites) + a.remainder[key]["mean"]
        assert parts == pytest.approx(a.total[key]["mean"], rel=1e-9, abs=1e-15)
        for est in [a.total[key], a.remainder[key], *(row[key] for row in a.sites)]:
            assert est["low"] <= est["mean"] <= est["high"] and est["n"] == 4 * 128
    # the seed's signs: O biased negative, δ positive, each interval excluding zero
    assert a.total["o"]["high"] < 0 < a.total["delta"]["low"]
    assert {g["group"] for g in a.groups} == {"P̄V path", "row statistics"}
    assert BiasAttribution.load(a.save(tmp_path / "bias.json")) == a
    with pytest.raises(ValueError, match="sites: unknown"):
        bias_attribution(q, k, v, dout, "paper", sites=["nope"])


def test_pv_trace_marks_the_ones_and_explains_the_largest_jump(tmp_path):
    pbar = torch.tensor([1.0, 0.5, 1.0, 0.25, 1.0]).bfloat16()
    values = torch.tensor([-2.40625, -2.296875, -2.3125, -1.0, -2.5]).bfloat16()
    t = pv_trace(pbar, values, "bf16")
    assert t.ones == [0, 2, 4]
    exact = sum(p * x for p, x in zip(pbar.double().tolist(), values.double().tolist()))
    assert t.high[-1] == pytest.approx(exact)
    assert t.error[-1] == pytest.approx(t.low[-1] - exact)
    assert t.explanation["format"] == "bf16" and "guard" in t.explanation_text.lower()
    assert PVTrace.load(t.save(tmp_path / "pv-trace.json")) == t
    q, k, v, _ = tied_maxima_inputs(4, heads=1, keys=64)
    trace = pv_trace_from_attention(q, k, v, row=3, causal=False)
    assert len(trace.ones) >= 4  # the tied maxima all give P̄ = 1
    with pytest.raises(ValueError, match="pbar, values"):
        pv_trace(pbar, values[:3])


def test_delta_error_is_biased_positive_on_tied_maxima():
    q, k, v, dout = tied_maxima_inputs(4, heads=4, keys=128)
    err = delta_error(q, k, v, dout, "paper", "fp64", causal=False)
    assert err.shape == (1, 4, 128) and err.mean() > 0
    assert torch.equal(delta_error(q, k, v, dout, "fp64", "fp64", causal=False), torch.zeros_like(err))


def test_model_delta_errors_per_layer_and_head(tiny, tmp_path):
    from stableflash.model.gpt import GPT

    cfg = tiny()
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.attention.resolve(cfg.model.n_layer))
    x = torch.randint(0, 256, (2, cfg.model.block_size))
    errors = model_delta_errors(model, x, torch.roll(x, -1, 1), "paper", "fp64")
    assert len(errors.layers) == cfg.model.n_layer
    for layer in errors.layers:
        assert len(layer["sum"]) == cfg.model.n_head and all(math.isfinite(s) for s in layer["sum"])
        assert len(layer["per_token"]) == cfg.model.n_head and len(layer["per_token"][0]) == cfg.model.block_size
    assert all(p.grad is None for p in model.parameters())
    assert DeltaErrors.load(errors.save(tmp_path / "delta.json")) == errors


def test_record_refuses_another_kind(tmp_path):
    path = DeltaErrors(low="a", high="b", layers=[]).save(tmp_path / "x.json")
    with pytest.raises(ValueError, match="holds a DeltaErrors"):
        PVTrace.load(path)
    assert issubclass(PVTrace, Record)


def test_warning_replay_measures_the_lead_time(tmp_path):
    import json

    from stableflash.diagnose.warnings import WarningReplay, replay_warnings

    def write(run, losses, grads):
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": loss, "grad_norm": g}) + "\n"
                                                  for i, (loss, g) in enumerate(zip(losses, grads))))

    losses = [3.0 - 0.02 * i for i in range(30)] + [2.5 + 0.1 * i for i in range(20)]
    grads = [1.0] * 25 + [40.0] + [60.0] * 24
    write(tmp_path / "failing", losses, grads)
    replay = replay_warnings(tmp_path / "failing")
    assert replay.first_warning_step == 26
    assert replay.blowup_step == 41  # loss 3.5 >= best (2.42) + 1.0
    assert replay.lead_steps == 15
    assert WarningReplay.load(replay.save(tmp_path / "w.json")) == replay
    write(tmp_path / "healthy", [3.0 - 0.01 * i for i in range(50)], [1.0 + 0.01 * (i % 7) for i in range(50)])
    healthy = replay_warnings(tmp_path / "healthy")
    assert healthy.warnings == [] and healthy.blowup_step is None and healthy.lead_steps is None


def test_a_blowup_is_sustained_and_after_the_warmup():
    from stableflash.diagnose.warnings import blowup_step

    losses = list(enumerate([5.5, 4.0, 3.4, 5.7, 3.3, 3.2] + [3.1] * 20 + [4.3] * 12))
    assert blowup_step(losses) == 26  # the one-step spike at step 3 recovers at once
    assert blowup_step(losses, window=1) == 3
    assert blowup_step(losses[:30]) == 26  # fewer than `window` losses left: all of them count
    assert blowup_step(losses, after=30) == 31  # best before step 31 is still 3.1
    assert blowup_step([(0, 3.0), (1, 2.0), (2, math.nan), (3, 2.0)]) == 2
    assert blowup_step([(0, 3.0), (1, math.inf)], after=5) is None
