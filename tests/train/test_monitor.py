import torch

from stableflash.model import GPT
from stableflash.train.config import MonitorConfig, load_config
from stableflash.train.monitor import Monitor, SpectralNorms, head_matrices


def _model():
    cfg = load_config("tiny-cpu")
    return GPT(cfg.model, cfg.attention.resolve(cfg.model.n_layer))


def test_power_iteration_matches_svd_per_head():
    model = _model()
    spectral = SpectralNorms(iters=50)
    norms = spectral(model)  # random init: clustered singular values, slow but monotone convergence from below
    for name, w in head_matrices(model).items():
        exact = torch.linalg.matrix_norm(w, ord=2)
        assert (norms[name] <= exact * (1 + 1e-5)).all() and (norms[name] >= 0.95 * exact).all(), name
    with torch.no_grad():  # a grown direction, as in a failing head: converges to the SVD value
        w = model.attentions[0].c_attn.weight
        w[:32] += 0.5 * torch.randn(32, 1) @ torch.randn(1, 64)
    norms = SpectralNorms(iters=8)(model)
    exact = torch.linalg.matrix_norm(head_matrices(model)["q"], ord=2)
    assert torch.allclose(norms["q"][0], exact[0], rtol=1e-4)


def test_warning_fires_when_repeated_max_rows_jump(tmp_path):
    model = _model()
    monitor = Monitor(MonitorConfig(interval=1, warn_factor=3.0, warn_min_fraction=0.05), model, tmp_path)
    x = torch.randint(0, 256, (2, 32))
    events = []
    for step in range(6):
        monitor.arm(model)
        model(x, x)
        if step == 5:  # pretend layer 1, head 0 suddenly has many repeated-max rows
            model.attentions[1].stats.repeated_max_rows[0] = model.attentions[1].stats.rows[0]
        record, new = monitor.observe(step, model, loss=3.0)
        events += new
        assert len(record["spectral"]["q"]) == 2 and record["attention"][0]["rows"][0] == 64
    assert [(e["layer"], e["head"], e["step"]) for e in events] == [(1, 0, 5)]


def test_loss_checks():
    monitor = Monitor(MonitorConfig(spike_factor=3.0), _model(), ".")
    assert "nan" in monitor.check_loss(1, float("nan"), warmup_steps=0)
    for step in range(20):
        assert monitor.check_loss(step, 2.0, warmup_steps=0) is None
    assert "spike" in monitor.check_loss(21, 7.0, warmup_steps=0)


def test_gradient_norm_warning_on_a_jump_or_a_non_finite_norm(tmp_path):
    monitor = Monitor(MonitorConfig(interval=1, grad_warn_factor=10.0), _model(), tmp_path)
    assert all(monitor.check_grad(step, 1.0 + 0.01 * step) is None for step in range(12))
    assert monitor.check_grad(12, 5.0) is None
    event = monitor.check_grad(13, 50.0)
    assert event["signal"] == "grad_norm" and event["running_median"] < 1.1
    assert monitor.check_grad(14, float("inf"))["grad_norm"] == float("inf")


def test_logit_growth_warning(tmp_path):
    monitor = Monitor(MonitorConfig(interval=1, logit_warn_factor=3.0, logit_warn_min=50.0), _model(), tmp_path)
    for step, score in enumerate([1.0, 2.0, 3.0, 5.0]):  # small logits: growth, but below the floor
        assert monitor.logit_events(step, 0, [score, 1.0]) == []
    events = monitor.logit_events(5, 0, [400.0, 1.0])
    assert [(e["signal"], e["head"]) for e in events] == [("max_logit", 0)]


def test_a_non_finite_gradient_skips_the_update(tiny, tmp_path):
    from stableflash.train.loop import Trainer
    from stableflash.train.records import read_jsonl

    trainer = Trainer(tiny("run.max_steps=3", "run.eval_interval=0"), tmp_path)
    weight = trainer.model.transformer.wte.weight
    before = weight.detach().clone()
    weight.register_hook(lambda g: g * float("inf"))  # every step's gradient norm is inf
    trainer.run()
    assert torch.equal(weight.detach(), before) and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert kinds.count("skipped_step") == 3


def test_scores_resolution_warning_once_per_head(tmp_path):
    from stableflash.attention.precision import PRESETS
    from stableflash.train.monitor import scores_format

    assert scores_format(PRESETS["paper"]).name == "bf16" and scores_format(PRESETS["bf16"]).name == "bf16"
    assert scores_format(PRESETS["fa2"]) is None and scores_format(PRESETS["fp32"]) is None
    assert scores_format(PRESETS["fa2"].replace(qk="fp16")).name == "fp16"
    monitor = Monitor(MonitorConfig(interval=1, score_ulp_warn=4.0), _model(), tmp_path)
    bf16 = scores_format(PRESETS["bf16"])
    assert monitor.resolution_events(1, 0, [511.0, 20.0], bf16) == []  # spacing 2 below 512
    events = monitor.resolution_events(2, 0, [600.0, 20.0], bf16)
    assert [(e["head"], e["spacing"], e["format"]) for e in events] == [(0, 4.0, "bf16")]
    assert monitor.resolution_events(3, 0, [9000.0, 20.0], bf16) == []  # once per head
    assert monitor.resolution_events(3, 0, [9000.0, 9000.0], None) == []  # scores kept in fp32: nothing to say


def test_a_resolution_warning_can_switch_the_layer_to_fp32(tiny, tmp_path):
    from stableflash.train.loop import train
    from stableflash.train.records import read_jsonl

    # a threshold every score passes: the rule fires at the first monitored step (logged as step 1), and not
    # at step 3, when the switched layers keep their scores in fp32
    train(tiny("run.max_steps=4", "run.eval_interval=0", "monitor.interval=2", "monitor.score_ulp_warn=1e-9",
               "monitor.action=fp32"), tmp_path)
    events = read_jsonl(tmp_path / "events.jsonl")
    warned = [e for e in events if e.get("signal") == "score_resolution"]
    assert {(e["step"], e["layer"]) for e in warned} == {(1, 0), (1, 1)} and warned[0]["format"] == "bf16"
    actions = [e for e in events if e["kind"] == "action"]
    assert actions and all(a["attention"] == "reference:fp32" for a in actions)
