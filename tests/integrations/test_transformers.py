"""stableflash inside a `transformers` model: tiny Llama (GQA), Mistral (a window), Qwen2 (biased projections),
Gemma 2 (softcap, alternating windows) and GPT-2 built in code, against `sdpa`."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from stableflash.integrations.transformers import register  # noqa: E402

CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "mistral-window": lambda: MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            sliding_window=5),
    "qwen2": lambda: Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "gemma2-softcap": lambda: Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           max_position_embeddings=64, sliding_window=6, attn_logit_softcapping=5.0,
                                           query_pre_attn_scalar=16, initializer_range=0.5),
    "gpt2": lambda: GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                               resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}


def _baseline(name):
    """`sdpa`, or `eager` for Gemma 2, which transformers runs without SDPA (SDPA has no softcap)."""
    return "eager" if name.startswith("gemma2") else "sdpa"


def _model(name, impl, seed=1):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation=impl)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("impl", ["stableflash", "stableflash_sfa"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_gradients_match_sdpa_with_padding(name, impl):
    assert set(register()) == {"stableflash", "stableflash_sfa"}
    seed = 0
    print(f"seed {seed}")
    ids = torch.randint(0, 97, (3, 19), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(3, 19, dtype=torch.long)
    mask[1, 13:] = 0  # right padding
    mask[2, :4] = 0  # left padding
    real = mask.bool()
    results = {}
    baseline = _baseline(name)
    for which in (baseline, impl):
        model = _model(name, which)
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits[real].float().square().mean().backward()
        results[which] = logits.detach()[real], torch.cat([p.grad.flatten() for p in model.parameters()])
    assert _rel(results[impl][0], results[baseline][0]) < 1e-5
    assert _rel(results[impl][1], results[baseline][1]) < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_sdpa_token_for_token(name):
    """20 new tokens from a left-padded batch, through the cache (one query against the cached keys each step)."""
    register()
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding, as generation pads
    tokens = {}
    baseline = _baseline(name)
    for which in (baseline, "stableflash"):
        model = _model(name, which).eval()
        model.generation_config.pad_token_id = 0
        tokens[which] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                       min_new_tokens=20)
    assert torch.equal(tokens["stableflash"], tokens[baseline])


def test_packed_sequences_attend_within_each_sequence():
    register()
    lengths = [7, 5, 9]
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = _model("llama-gqa", "stableflash")(input_ids=ids, position_ids=position_ids).logits[0]
    alone = _model("llama-gqa", "sdpa")
    start = 0
    for n in lengths:
        one = alone(input_ids=ids[:, start:start + n]).logits[0]
        assert _rel(packed[start:start + n], one) < 1e-5
        start += n
    # the offsets as transformers' DataCollatorWithFlattening hands them give the same
    offsets = torch.tensor([0, 7, 12, 21], dtype=torch.int32)
    given = _model("llama-gqa", "stableflash")(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=offsets,
                                               cu_seq_lens_k=offsets, max_length_q=9, max_length_k=9).logits[0]
    assert torch.equal(given, packed)


def test_a_batch_of_several_rows_is_never_taken_for_packed():
    """Models hand every batch a (1, T) `position_ids`: only a batch of one row is checked for packing."""
    register()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    ours = _model("llama-gqa", "stableflash")(input_ids=ids).logits
    assert _rel(ours, _model("llama-gqa", "sdpa")(input_ids=ids).logits) < 1e-5


def test_a_training_step_under_bf16_autocast_stays_close_to_sdpa():
    register()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(4))
    losses = {}
    for impl in ("sdpa", "stableflash_sfa"):
        model = _model("llama-gqa", impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses[impl] = loss.item()
    assert abs(losses["stableflash_sfa"] - losses["sdpa"]) < 2e-2 * losses["sdpa"]


def test_unsupported_arguments_are_named():
    register()
    with pytest.raises(ValueError, match="dropout"):
        model = _model("gpt2", "stableflash")
        model.config.attn_pdrop = 0.5
        for block in model.transformer.h:
            block.attn.attn_dropout.p = 0.5
            block.attn.attention_dropout = 0.5
        model.train()(input_ids=torch.zeros(1, 5, dtype=torch.long))


def _gpu_llama(impl, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl).cuda().to(torch.bfloat16)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the fused kernels)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("impl", ["stableflash", "stableflash_sfa"])
def test_llama_in_the_kernels_matches_sdpa_on_the_gpu(impl, monkeypatch):
    """GQA (4 query heads, 2 key/value heads) and a padded row through the fused kernels, in bf16: logits and
    gradients within bf16's tolerance of `sdpa`'s."""
    from stableflash.attention.triton import launch

    register()
    launched = []
    forward = launch.forward
    monkeypatch.setattr(launch, "forward", lambda *a, **kw: launched.append(a[1].shape) or forward(*a, **kw))
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    ids = torch.randint(0, 512, (3, 201), generator=torch.Generator().manual_seed(seed)).cuda()
    mask = torch.ones(3, 201, dtype=torch.long, device="cuda")
    mask[1, 150:] = 0  # right padding: the kernels' key-padding form
    real = mask.bool()
    results = {}
    for which in ("sdpa", impl):
        model = _gpu_llama(which)
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits[real].float().square().mean().backward()
        results[which] = (logits.detach()[real].float(),
                          torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert launched and all(shape[1] == 2 for shape in launched), f"the kernels did not take k, v of 2 heads: {launched}"
    assert _rel(results[impl][0], results["sdpa"][0]) < 2e-2, f"seed {seed}"
    assert _rel(results[impl][1], results["sdpa"][1]) < 5e-2, f"seed {seed}"


@pytest.mark.gpu
@gpu
def test_a_compiled_llama_has_no_graph_breaks():
    register()
    model = _gpu_llama("stableflash_sfa")
    ids = torch.randint(0, 512, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    explanation = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_attention_sinks_are_refused_by_name():
    from stableflash.integrations.transformers import _make_forward

    forward = _make_forward(None)
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="s_aux"):
        forward(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))

