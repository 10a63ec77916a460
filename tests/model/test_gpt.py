import pytest
import torch

from stableflash.model import GPT
from stableflash.train.config import load_config


def _model(*overrides):
    cfg = load_config("tiny-cpu", list(overrides))
    return GPT(cfg.model, cfg.attention.resolve(cfg.model.n_layer)), cfg


def test_per_layer_and_per_head_attention():
    model, _ = _model("attention.backend=sdpa", "attention.precision=fa2", "attention.layers.1.backend=reference",
                      "attention.layers.1.precision=paper", "attention.layers.1.heads=1",
                      "attention.layers.1.stabilize=sfa")
    described = [a.attention.describe() for a in model.attentions]
    assert described == ["sdpa:fa2", "reference:paper+heads[1]+SFA"]


def test_one_pass_in_other_numerics_from_the_config():
    model, _ = _model("attention.precision=bf16", "attention.backward_precision=fa2")
    policy = model.attentions[0].attention.precision
    assert policy.name == "bf16+backward=fa2" and (policy.qk, policy.dp, policy.ds_operand) == ("bf16", "fp32", "input")
    with pytest.raises(ValueError, match="attention.forward_precision: expected '' or one of"):
        _model("attention.forward_precision=fp31")


def test_sites_set_by_hand_from_the_config():
    model, cfg = _model("attention.precision=bf16", "attention.sites.qk=fp32", "attention.sites.scores=fp32")
    policy = model.attentions[1].attention.precision
    assert (policy.qk, policy.scores, policy.row_max) == ("fp32", "fp32", "bf16") and "qk=fp32" in policy.name
    with pytest.raises(ValueError, match="attention.sites: unknown site 'qkv'"):
        _model("attention.sites.qkv=fp32")
    with pytest.raises(ValueError, match="attention.sites.qk: expected 'input' or a format name"):
        _model("attention.sites.qk=fp33")
    with pytest.raises(ValueError, match="attention.sites: expected a table"):
        _model("attention.sites=5")
    with pytest.raises(ValueError, match="--set attention.layers.1.sites: Expecting value"):
        _model("attention.layers.1.sites=fp32")
    layered, _ = _model('attention.layers.1.sites={"qk": "fp32"}')
    assert [a.attention.precision.qk for a in layered.attentions] == ["bf16", "fp32"]


def test_sdpa_with_numerics_knobs_is_refused():
    with pytest.raises(ValueError, match="backend 'sdpa' has fixed numerics"):
        _model("attention.backend=sdpa", "attention.precision=paper")
    with pytest.raises(ValueError, match="backend 'sdpa' has fixed numerics"):
        _model("attention.backend=sdpa", "attention.forward_precision=fp32")


@pytest.mark.parametrize("option", ["model.qk_norm=true", "model.gated_attention=true", "model.qk_clip=0.5"])
def test_options_train_a_step(option):
    model, cfg = _model(option)
    x = torch.randint(0, 256, (2, 32))
    _, loss = model(x, x)
    loss.backward()
    assert torch.isfinite(loss)
    if "qk_clip" in option:
        before = model.attentions[0].c_attn.weight.detach().clone()
        model.attentions[0].apply_qk_clip(0.5)
        scores = model.attentions[0].max_logit
        changed = not torch.equal(before, model.attentions[0].c_attn.weight)
        assert changed == bool((scores > 0.5).any())


def test_tied_embeddings_and_shapes():
    model, cfg = _model()
    assert model.lm_head.weight is model.transformer.wte.weight
    logits, loss = model(torch.randint(0, 256, (3, 20)))
    assert logits.shape == (3, 20, 256) and loss is None
    with pytest.raises(ValueError, match="exceeds model.block_size"):
        model(torch.randint(0, 256, (1, cfg.model.block_size + 1)))
