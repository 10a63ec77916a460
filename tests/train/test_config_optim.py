import pytest
import torch

from stableflash.train.config import from_dict, load_config
from stableflash.train.optim import lr_at, newton_schulz

try:
    import tomllib
except ModuleNotFoundError:
    import tomli as tomllib


def test_presets_load_and_gpt2s_has_the_seed_hyperparameters():
    cfg = load_config("gpt2s-owt")
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == (12, 12, 768, 1024)
    assert (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.weight_decay) == (0.9, 0.95, 0.0)
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.optim.grad_clip) == (1e-3, 1e-5, 2000, 1.0)
    assert cfg.data.batch_size * cfg.data.grad_accum * cfg.model.block_size == 327_680  # one process; see the file
    load_config("tiny-cpu")
    load_config("quick-gpu")


def test_overrides_roundtrip_and_unknown_keys():
    cfg = load_config("tiny-cpu", ["optim.lr=3e-4", "attention.layers.1.precision=fp32", "attention.layers.1.heads=0,1"])
    assert cfg.optim.lr == 3e-4 and cfg.attention.for_layer(1).heads == (0, 1)
    assert load_config("tiny-cpu", ["max_steps=40"]).run.max_steps == 40  # bare keys, when unambiguous
    assert from_dict(tomllib.loads(cfg.to_toml())) == cfg
    with pytest.raises(ValueError, match="did you mean optim.lr"):
        load_config("tiny-cpu", ["optim.learning_rate=1"])
    with pytest.raises(ValueError, match="unknown sections"):
        from_dict({"modle": {}})
    with pytest.raises(ValueError, match="attention.precision: expected one of"):
        load_config("tiny-cpu", ["attention.precision=fp17"])
    with pytest.raises(FileNotFoundError, match="presets: .*tiny-cpu"):
        load_config("nope")
    with pytest.raises(ValueError, match="run.ddp_bucket_mb: expected a positive size"):
        load_config("tiny-cpu", ["run.ddp_bucket_mb=0"])


def test_lr_schedule_is_independent_of_where_the_run_stops():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=100)
    assert lr_at(0, **kw) == 0.1 and lr_at(9, **kw) == 1.0
    assert abs(lr_at(55, **kw) - 0.55) < 1e-12 and lr_at(100, **kw) == 0.1 and lr_at(10**6, **kw) == 0.1


def test_newton_schulz_orthogonalises():
    g = torch.Generator().manual_seed(0)
    for shape in ((64, 32), (32, 96)):
        m = torch.randn(*shape, generator=g)
        ortho = newton_schulz(m)
        s = torch.linalg.svdvals(ortho)
        assert s.min() > 0.5 and s.max() < 1.3  # all singular values pushed towards 1
        u, _, vh = torch.linalg.svd(m, full_matrices=False)
        assert torch.nn.functional.cosine_similarity(ortho.flatten(), (u @ vh).flatten(), dim=0) > 0.95
    skewed = torch.randn(48, 48, generator=g) @ torch.diag(torch.logspace(-1, 1, 48))
    before, after = torch.linalg.cond(skewed), torch.linalg.cond(newton_schulz(skewed))
    assert after < before / 10


def test_gpt2s_owt_is_the_official_recipe():
    """configs/gpt2s-owt.toml against the values of the analysed code's train.py and model.py."""
    from stableflash.train.config import load_config

    cfg = load_config("gpt2s-owt", [])
    m, o, d = cfg.model, cfg.optim, cfg.data
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.bias, m.gelu) == (12, 12, 768, 1024, False, "exact")
    assert (o.lr, o.min_lr, o.warmup_steps, o.decay_steps, o.beta1, o.beta2, o.weight_decay, o.grad_clip) == (
        1e-3, 1e-5, 2000, 600000, 0.9, 0.95, 0.0, 1.0)
    assert d.batch_size * d.grad_accum * m.block_size == 327_680 and cfg.run.compile
    assert cfg.attention.precision == "paper"
    study = load_config("study-6l", [])
    assert (study.model.bias, study.model.gelu, study.run.compile) == (False, "exact", True)
    assert study.data.batch_size * study.data.grad_accum * study.model.block_size >= 131_072


def test_exact_gelu_is_torch_s_default_gelu():
    import torch

    from stableflash.model.gpt import MLP
    from stableflash.train.config import ModelConfig

    cfg = ModelConfig(n_embd=8, n_head=2, gelu="exact")
    mlp = MLP(cfg)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(mlp(x), mlp.c_proj(torch.nn.GELU()(mlp.c_fc(x))))
    with pytest.raises(ValueError, match="model.gelu"):
        ModelConfig(gelu="erf")
