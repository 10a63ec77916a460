"""`stableflash.watch`: the trainer's monitor rules on a model that is not ours."""

import json
import sys
from pathlib import Path

import pytest
import torch

import stableflash
from stableflash.attention import SFA
from stableflash.train.config import MonitorConfig

ROOT = Path(__file__).resolve().parents[2]


def _counted(w, layer, rows, repeated):
    _, _, stats = w.attention_for(layer)
    heads = w.num_heads
    stats.add(slice(None), rows=rows, repeated_max_rows=torch.full((heads,), repeated),
              pbar_ones=torch.zeros(heads, dtype=torch.long), max_score=torch.ones(heads))


def test_a_jump_of_repeated_maxima_warns_and_switches_the_layer(tmp_path):
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"num_attention_heads": 2})
    config = MonitorConfig(interval=1, warn_factor=3.0, warn_min_fraction=0.05, action="sfa")
    with stableflash.watch(model, log_dir=tmp_path, config=config) as w:
        for step in range(6):
            _counted(w, 0, rows=100, repeated=2 if step < 5 else 60)  # step 5: 60% of the rows
            events = w.step(loss=1.0)
        assert [e["signal"] for e in events if e["kind"] == "warning"] == ["repeated_max", "repeated_max"]
        assert {"kind": "action", "action": "sfa", "layer": 0, "step": 5} in events
        precision, stabilize, _ = w.attention_for(0)
        assert isinstance(stabilize, SFA) and w.attention_for(1)[1] is None
    logged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert logged == events
    assert len((tmp_path / "monitor.jsonl").read_text().splitlines()) == 6
    assert stableflash.integrations.watch.active_watch() is None


def test_the_example_trains_a_llama_with_the_watch_on(tmp_path, capsys):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import hf_llama_sfa
    finally:
        sys.path.pop(0)
    hf_llama_sfa.main(["--steps", "25", "--out", str(tmp_path)])
    records = [json.loads(line) for line in (tmp_path / "monitor.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 10, 20]
    assert all(len(r["attention"]) == 2 and r["attention"][0]["rows"] == [512] * 4 for r in records)
    assert "loss" in capsys.readouterr().out


def test_the_trainer_callback_steps_the_watch():
    pytest.importorskip("transformers")
    from stableflash.integrations.watch import trainer_callback

    model = torch.nn.Linear(2, 2)
    with stableflash.watch(model, num_heads=2) as w:
        callback = trainer_callback(w)
        state = type("State", (), {"log_history": [{"loss": 2.5}]})()
        callback.on_step_end(None, state, None)
        callback.on_step_end(None, state, None)
        assert w.step_count == 2
