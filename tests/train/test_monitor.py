import torch

from stableflash.model import GPT
from stableflash.train.config import MonitorConfig, load_config
from stableflash.train.monitor import Monitor, SpectralNorms, head_matrices


def _model():
    cfg = load_config("tiny-cpu")
    return GPT(cfg.model, cfg.attention)


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
