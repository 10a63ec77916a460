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


def test_a_real_trainer_steps_the_watch_with_each_steps_loss_and_grad_norm(tmp_path):
    """transformers' Trainer, 6 steps of a tiny Llama with logging every step: the watch steps once per optimizer
    step, its monitored records carry that step's logged loss, its gradient-norm rule sees that step's norm, and
    TensorBoard gets the monitor's signals."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    from transformers import LlamaConfig, Trainer, TrainingArguments

    from stableflash.integrations.transformers import register
    from stableflash.integrations.watch import trainer_callback

    register()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="stableflash")
    ids = torch.randint(0, 61, (24, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, max_steps=6,
                             logging_steps=1, report_to=[], learning_rate=1e-3, use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    seen = []
    with stableflash.watch(model, log_dir=tmp_path / "watch", interval=2, tensorboard=True) as w:
        original = w.step
        w.step = lambda loss=None, grad_norm=None: seen.append((loss, grad_norm)) or original(loss, grad_norm)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[trainer_callback(w)])
        trainer.train()
    logged = [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 6 and w.step_count == 6
    assert seen == [(pytest.approx(loss), pytest.approx(norm)) for loss, norm in logged]
    records = [json.loads(line) for line in (tmp_path / "watch" / "monitor.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 4]
    assert [r["loss"] for r in records] == [pytest.approx(logged[i][0]) for i in (0, 2, 4)]
    assert list((tmp_path / "watch" / "tb").glob("events.out.tfevents.*"))
