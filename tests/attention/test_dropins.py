"""The drop-ins where attention is already called: flash-attn's calls, SDPA's signature and a block of code routed
through stableflash. On the CPU, through the reference, against dense fp64 softmax attention."""

import math

import pytest
import torch
import torch.nn.functional as F

import stableflash
from stableflash.attention import (
    flash_attention,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    route_sdpa,
    sdpa,
)

EXACT = dict(precision="fp64", backend="reference")


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _dense(q, k, v, *, causal=False, softcap=0.0, bias=None):
    """Softmax attention on (B, H, T, D), causal to the bottom right: (O, lse)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if causal:
        Tq, Tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool).triu(Tk - Tq + 1), -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_packed_calls_are_flash_attn_func_and_lse_is_the_rows_log_sum_exp():
    q, k, v = (_randn(2, 9, 4, 8, seed=i) for i in range(3))
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **EXACT)
    want, want_lse = _dense(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    assert torch.allclose(out, want.transpose(1, 2)) and torch.allclose(lse, want_lse) and probs is None
    assert torch.equal(flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), causal=True, **EXACT), out)
    assert torch.equal(flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True, **EXACT), out)
    window = flash_attn_func(q, k, v, window_size=torch.tensor([2, 0]), **EXACT)  # a tensor window, as varlen users
    assert torch.equal(window, flash_attn_func(q, k, v, window_size=(2, 0), **EXACT))
    assert torch.equal(flash_attn_func(q, k, v, deterministic=True, causal=True, **EXACT), out)


def test_varlen_packed_forms_and_their_lse():
    lengths = [5, 1, 8]
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    q, k, v = (_randn(14, 4, 8, seed=i) for i in range(3))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True, return_attn_probs=True,
                                         block_table=None, **EXACT)
    assert lse.shape == (4, 14)
    for (a, b) in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want, want_lse = _dense(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), causal=True)
        assert torch.allclose(out[a:b], want[0].transpose(0, 1)) and torch.allclose(lse[:, a:b], want_lse[0])
    assert len(lengths) == 3
    qkv = torch.stack([q, k, v], 1)
    assert torch.equal(flash_attn_varlen_qkvpacked_func(qkv, cu, 8, causal=True, **EXACT), out)
    assert torch.equal(flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu, cu, 8, 8, causal=True, **EXACT),
                       out)
    # the keys and values in pages of 3 positions, each sequence's pages shuffled in one pool
    table = torch.tensor([[4, 0, 7], [2, 6, 8], [5, 1, 3]], dtype=torch.int32)
    pools = [torch.zeros(9, 3, 4, 8, dtype=torch.float64) for _ in range(2)]
    for pool, t in zip(pools, (k, v)):
        for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            padded = torch.cat([t[a:b], torch.zeros(9 - (b - a), 4, 8, dtype=t.dtype)])
            pool[table[s].long()] = padded.unflatten(0, (3, 3))
    paged = flash_attn_varlen_func(q, *pools, cu, cu, 8, 8, causal=True, block_table=table, **EXACT)
    assert torch.equal(paged, out)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_varlen_func(q, *pools, cu, cu, 8, 8, block_table=table[:, :2], **EXACT)


@pytest.mark.parametrize("biased", [False, True])
def test_softcap_forward_and_backward_are_the_capped_softmax(biased):
    """With a float `attn_mask` too: its bias is added after the cap, so the backward's derivative through the cap
    is taken at the capped scores without it (at the biased ones, dQ and dK were off by up to 0.6 here)."""
    q, k, v = (_randn(1, 2, 7, 4, seed=i).mul(4).requires_grad_() for i in range(3))
    bias = _randn(1, 1, 7, 7, seed=5).mul(2) if biased else None
    ours = flash_attention(q, k, v, softcap=2.0, attn_mask=bias, **EXACT)
    want, _ = _dense(q, k, v, causal=True, softcap=2.0, bias=bias)
    assert torch.allclose(ours, want)
    dout = _randn(1, 2, 7, 4, seed=9)
    grads = torch.autograd.grad(ours, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for name, a, b in zip("qkv", grads, want_grads):
        assert torch.allclose(a, b, atol=1e-10), name


def test_sdpa_has_sdpas_signature_defaults_and_masks():
    q, k, v = (_randn(2, 3, 6, 8, seed=i) for i in range(3))
    k2, v2 = _randn(2, 3, 9, 8, seed=5), _randn(2, 3, 9, 8, seed=6)
    cases = [dict(), dict(is_causal=True), dict(attn_mask=torch.rand(6, 9, generator=torch.Generator().manual_seed(1)) > 0.2),
             dict(attn_mask=_randn(2, 1, 6, 9, seed=7)), dict(scale=0.3)]
    for kwargs in cases:
        keys = (k2, v2) if "attn_mask" in kwargs or kwargs.get("is_causal") else (k, v)
        want = F.scaled_dot_product_attention(q, *keys, **kwargs)
        assert torch.allclose(sdpa(q, *keys, **kwargs, precision="fp64", backend="reference"), want), kwargs
    # SDPA's causal mask for L != S is aligned to the top left, flash-attn's to the bottom right
    assert torch.allclose(sdpa(q, k2, v2, is_causal=True, **EXACT), F.scaled_dot_product_attention(q, k2, v2,
                                                                                                    is_causal=True))
    kv = _randn(2, 1, 6, 8, seed=8)
    assert torch.allclose(sdpa(q, kv, kv, enable_gqa=True, **EXACT),
                          F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True))
    with pytest.raises(ValueError, match="enable_gqa"):
        sdpa(q, kv, kv)
    with pytest.raises(ValueError, match="dropout_p"):
        sdpa(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="attn_mask: shape"):
        sdpa(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.bool))
    three = sdpa(q[0], k[0], v[0], **EXACT)  # (H, L, E)
    assert torch.allclose(three, F.scaled_dot_product_attention(q[0], k[0], v[0]))


@pytest.mark.parametrize("L, S", [(0, 7), (5, 0), (0, 0)])
def test_sdpa_without_queries_or_keys_gives_sdpas_result(L, S):
    """No queries: an empty output; no keys: zeros (each query's softmax weighs nothing); gradients as torch's, GQA
    included."""
    q = torch.randn(2, 4, L, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, S, 8, requires_grad=True) for _ in range(2))
    ours = sdpa(q, k, v, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert ours.shape == theirs.shape == (2, 4, L, 8) and torch.equal(ours, theirs)
    dout = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), dout), torch.autograd.grad(theirs, (q, k, v), dout)):
        assert torch.equal(a, b)


def test_route_sdpa_sends_a_blocks_calls_through_stableflash_and_restores_torchs():
    q = _randn(1, 2, 5, 4, seed=0).float()
    original = F.scaled_dot_product_attention
    stats = stableflash.AttentionStats(2)
    with route_sdpa(precision="fp32", backend="reference", stats=stats):
        inside = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert F.scaled_dot_product_attention is original
    assert stats.rows.tolist() == [5, 5]  # it went through stableflash
    assert torch.allclose(inside, original(q, q, q, is_causal=True), atol=1e-6)
    with pytest.raises(TypeError, match="route_sdpa: unknown options"):
        with route_sdpa(precison="fp32"):
            pass


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_writes_the_new_keys_in_place_and_attends_to_each_sequences_own(paged):
    B, T, H, D = 3, 12, 2, 8
    k_cache, v_cache = torch.zeros(B, T, H, D, dtype=torch.float64), torch.zeros(B, T, H, D, dtype=torch.float64)
    lengths = torch.tensor([4, 7, 1], dtype=torch.int32)
    history = [(_randn(T, H, D, seed=10 + b), _randn(T, H, D, seed=20 + b)) for b in range(B)]
    for b, (hk, hv) in enumerate(history):
        k_cache[b, :lengths[b]], v_cache[b, :lengths[b]] = hk[:lengths[b]], hv[:lengths[b]]
    new_k, new_v = _randn(B, 1, H, D, seed=1), _randn(B, 1, H, D, seed=2)
    q = _randn(B, 1, H, D, seed=3)
    kwargs = dict(k=new_k, v=new_v, cache_seqlens=lengths, causal=True, return_softmax_lse=True, **EXACT)
    if paged:  # 4 pages of 3 positions each, the sequences' pages shuffled in one pool
        table = torch.tensor([[5, 0, 9, 2], [1, 7, 3, 11], [4, 6, 8, 10]], dtype=torch.int32)
        pool_k, pool_v = torch.zeros(12, 3, H, D, dtype=torch.float64), torch.zeros(12, 3, H, D, dtype=torch.float64)
        for b in range(B):
            for p in range(4):
                pool_k[table[b, p]], pool_v[table[b, p]] = k_cache[b, 3 * p:3 * p + 3], v_cache[b, 3 * p:3 * p + 3]
        out, lse = flash_attn_with_kvcache(q, pool_k, pool_v, block_table=table, **kwargs)
        written = pool_k[table[0, 4 // 3], 4 % 3]
    else:
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        written = k_cache[0, 4]
    assert torch.equal(written, new_k[0, 0])  # in place, after the sequence's 4 keys
    for b in range(B):
        n = int(lengths[b])
        keys = torch.cat([history[b][0][:n], new_k[b]])
        values = torch.cat([history[b][1][:n], new_v[b]])
        want, want_lse = _dense(q[b:b + 1].transpose(1, 2), keys[None].transpose(1, 2), values[None].transpose(1, 2))
        assert torch.allclose(out[b:b + 1], want.transpose(1, 2)) and torch.allclose(lse[b], want_lse[0]), b
    with pytest.raises(ValueError, match="rotary_cos, rotary_sin"):
        flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=torch.ones(1))


def _rotated_as_complex(x, angles, interleaved):
    """x (T, H, D) with its first 2·angles.shape[1] dims rotated by e^{i·angle} (angles (T, R/2)), the pairs
    taken as complex numbers: the rotation's definition, independent of the library's sin/cos form."""
    r = 2 * angles.shape[1]
    head = x[..., :r]
    pairs = head.unflatten(-1, (r // 2, 2)) if interleaved else torch.stack(head.chunk(2, dim=-1), dim=-1)
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(angles),
                                                                                          angles)[:, None])
    turned = turned.flatten(-2) if interleaved else torch.cat(turned.unbind(-1), dim=-1)
    return torch.cat([turned, x[..., r:]], dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_rotates_new_keys_and_queries_at_their_positions(interleaved, causal):
    B, T, H, D, R, new = 2, 16, 2, 12, 8, 3
    angles = _randn(T, R // 2, seed=5) * math.pi
    k_cache, v_cache = _randn(B, T, H, D, seed=6), _randn(B, T, H, D, seed=7)
    before = k_cache.clone()
    lengths = torch.tensor([2, 9])
    new_k, new_v, q = _randn(B, new, H, D, seed=8), _randn(B, new, H, D, seed=9), _randn(B, new, H, D, seed=10)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, new_k, new_v, rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                                  cache_seqlens=lengths, causal=causal, rotary_interleaved=interleaved, **EXACT)
    for b in range(B):
        n = int(lengths[b])
        at = torch.arange(n, n + new)
        want_k = _rotated_as_complex(new_k[b], angles[at], interleaved)
        assert torch.allclose(k_cache[b, n:n + new], want_k) and torch.equal(k_cache[b, :n], before[b, :n]), b
        # causal: each query at its own position; else every query at the cache's end
        q_at = at if causal else torch.full((new,), n)
        want_q = _rotated_as_complex(q[b], angles[q_at], interleaved)
        keys, values = k_cache[b, :n + new], v_cache[b, :n + new]
        want, _ = _dense(want_q[None].transpose(1, 2), keys[None].transpose(1, 2), values[None].transpose(1, 2),
                         causal=causal)
        assert torch.allclose(out[b], want[0].transpose(0, 1)), b


def test_kvcache_left_padding_starts_each_sequence_at_its_own_first_key():
    B, T, H, D = 3, 12, 2, 8
    k_cache, v_cache = _randn(B, T, H, D, seed=11), _randn(B, T, H, D, seed=12)
    lengths, starts = torch.tensor([6, 11, 4]), torch.tensor([2, 0, 1])
    q = _randn(B, 3, H, D, seed=13)
    for causal, Tq in ((True, 3), (True, 1), (False, 3)):  # a call per sequence, and the key-padding call
        out = flash_attn_with_kvcache(q[:, :Tq], k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=starts,
                                      causal=causal, **EXACT)
        for b in range(B):
            keys, values = (c[b:b + 1, int(starts[b]):int(lengths[b])].transpose(1, 2) for c in (k_cache, v_cache))
            want, _ = _dense(q[b:b + 1, :Tq].transpose(1, 2), keys, values, causal=causal)
            assert torch.allclose(out[b:b + 1], want.transpose(1, 2)), (causal, Tq, b)
    with pytest.raises(ValueError, match="cache_leftpad"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=torch.tensor([7, 0, 0]),
                                **EXACT)


@pytest.mark.parametrize("precision, dtype", [("fp64", torch.float64), ("fa2", torch.float32)])
def test_varlen_sequences_without_keys_give_the_policys_lse_dtype(precision, dtype):
    """Sequences with no key (some, or all of them) give O = 0 and lse = -inf in the dtype the others' calls give,
    and a gradient (zero there): with every sequence empty the output still joins autograd's graph."""
    g = torch.Generator().manual_seed(31)
    q = torch.randn(7, 2, 8, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(3, 2, 8, dtype=torch.float64, generator=g)
    v = k
    for ks in ([0, 3, 3], [0, 0, 0]):
        out, lse, _ = flash_attn_varlen_func(q, k[:ks[-1]], v[:ks[-1]], torch.tensor([0, 3, 7], dtype=torch.int32),
                                             torch.tensor(ks, dtype=torch.int32), 4, 3, return_attn_probs=True,
                                             precision=precision, backend="reference")
        assert lse.dtype == dtype and (out[3:] == 0).all() and (lse[:, 3:] == float("-inf")).all(), ks
        (dq,) = torch.autograd.grad(out, q, torch.ones_like(out))
        assert (dq[3:] == 0).all(), ks


@pytest.mark.parametrize("paged", [False, True], ids=["rows", "pages"])
def test_kvcache_with_no_key_in_any_sequence_gives_zeros_and_minus_infinity(paged):
    """Every sequence empty (cache_seqlens 0 and no new keys), through each of the call's routes: what one empty
    sequence among others gives, not an error about a cache of length 0."""
    H, D = 2, 8
    k_cache, v_cache = (_randn(4, 4, H, D, seed=s) for s in (21, 22))  # 4 pages of 4, or 4 rows of 4
    table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32) if paged else None
    for causal, Tq, window in ((True, 1, (-1, -1)), (False, 2, (-1, -1)), (True, 3, (2, 0))):
        q = _randn(2, Tq, H, D, seed=23)
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([0, 0]), block_table=table,
                                           causal=causal, window_size=window, return_softmax_lse=True, **EXACT)
        assert (out == 0).all() and out.shape == q.shape, (causal, Tq)
        assert lse.shape == (2, H, Tq) and (lse == float("-inf")).all(), (causal, Tq)
        assert lse.dtype == torch.float64  # as the policy's calls give it (fp64 numerics here)


def test_kvcache_positions_past_the_cache_are_an_error_flash_attn_code_catches():
    """flash-attn raises a RuntimeError here and this library a ValueError: the error is both."""
    pool = torch.zeros(4, 8, 1, 4, dtype=torch.float64)
    table = torch.zeros(1, 1, dtype=torch.int32)
    q = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, pool, pool, cache_seqlens=torch.tensor([9]), block_table=table, **EXACT)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, pool, pool, k=q, v=q, cache_seqlens=torch.tensor([8]), block_table=table, **EXACT)
    assert flash_attn_with_kvcache(q, pool, pool, cache_seqlens=torch.tensor([8]), block_table=table,
                                   **EXACT).shape == q.shape


def test_kvcache_with_several_causal_queries_aligns_each_to_its_own_end():
    B, T, H, D = 2, 10, 1, 4
    k_cache, v_cache = _randn(B, T, H, D, seed=1), _randn(B, T, H, D, seed=2)
    q = _randn(B, 3, H, D, seed=3)
    lengths = torch.tensor([5, 9])
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True, **EXACT)
    for b in range(B):
        n = int(lengths[b])
        want, _ = _dense(q[b:b + 1].transpose(1, 2), k_cache[b:b + 1, :n].transpose(1, 2),
                         v_cache[b:b + 1, :n].transpose(1, 2), causal=True)
        assert torch.allclose(out[b:b + 1], want.transpose(1, 2))


def test_the_reference_compiles_whole_exports_and_takes_torch_func():
    """The reference path under torch.compile(fullgraph=True) with a window and key padding (no data-dependent
    branch left), torch.export, and torch.func's grad and vmap: each the eager values. GQA (k and v of one head for
    q's three), which the reference's autograd function takes as it is."""
    q = _randn(2, 3, 24, 8, seed=0).float().requires_grad_()
    k, v = (_randn(2, 1, 24, 8, seed=i).float().requires_grad_() for i in (1, 2))
    keep = torch.rand(2, 24, generator=torch.Generator().manual_seed(4)) > 0.2

    def f(q, k, v):
        return flash_attention(q, k, v, precision="paper", backend="reference", window=(9, -1),
                               key_padding_mask=keep).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    eager, again = (torch.autograd.grad(fn(q, k, v), (q, k, v)) for fn in (f, compiled))
    assert all(torch.equal(a, b) for a, b in zip(eager, again))

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return flash_attention(q, k, v, precision="fp32", backend="reference")

    inputs = tuple(t.detach() for t in (q, k, v))
    exported = torch.export.export(Attention(), inputs)
    assert torch.equal(exported.module()(*inputs), Attention()(*inputs))

    def loss(q):
        return flash_attention(q, k.detach(), v.detach(), precision="fp32", backend="reference").sum()

    batch = torch.stack([inputs[0], inputs[0] * 0.5])
    grads = torch.func.vmap(torch.func.grad(loss))(batch)
    for one, grad in zip(batch, grads):
        assert torch.allclose(grad, torch.func.grad(loss)(one))


def test_a_row_that_sees_no_key_is_zero_with_zero_gradients_on_the_sdpa_backend_too():
    """SDPA alone gives NaN where a mask hides every key of a row (left padding does that); through stableflash's
    'sdpa' backend the row gives O = 0 and its gradients stay finite, as on the reference."""
    q, k, v = (_randn(2, 2, 5, 8, seed=i).float().requires_grad_() for i in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[2] = False
    fast = sdpa(q, k, v, attn_mask=mask, backend="sdpa")
    exact = sdpa(q, k, v, attn_mask=mask, precision="fp32", backend="reference")
    assert torch.allclose(fast, exact, atol=1e-6) and (fast[:, :, 2] == 0).all()
    grads, want = (torch.autograd.grad(o.sum(), (q, k, v)) for o in (fast, exact))
    assert all(torch.isfinite(g).all() and torch.allclose(g, w, atol=1e-5) for g, w in zip(grads, want))


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_keeps_the_backward_free_of_atomics(deterministic, monkeypatch):
    """flash-attn's `deterministic=True` runs its forwards (plain, packed, per sequence) with
    `KernelOptions.atomic_dq` off, which chooses their backward; False leaves the option as set."""
    import stableflash.attention.flash_attn as dropins
    from stableflash.attention.triton import kernel_options
    from stableflash.attention.triton.options import current

    seen = []
    run = dropins.flash_attention
    monkeypatch.setattr(dropins, "flash_attention", lambda *a, **kw: seen.append(current().atomic_dq) or run(*a, **kw))
    q = _randn(6, 2, 8, seed=0)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with kernel_options(atomic_dq=True):
        flash_attn_func(q[None], q[None], q[None], deterministic=deterministic, **EXACT)
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, deterministic=deterministic, **EXACT)
    assert seen == [not deterministic] * 3


def test_the_sdpa_backend_takes_views_that_start_off_alignment():
    """q, k, v as views at an offset of 3 elements into NaN-filled tensors, with a float mask: the result of the same
    values stored contiguously. On an H200, torch's cuDNN attention gave all NaN for such views (found by
    research/attention_sweep.py), so the 'sdpa' backend hands it aligned copies."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(15)
    values = [torch.randn(1, 1, n, 192, generator=g).to(dtype).to(device) for n in (75, 6, 6)]
    bias = torch.randn(75, 6, generator=g).to(dtype).to(device)
    views = []
    for t in values:
        base = torch.full((1, 2, t.shape[2], 200), float("nan"), dtype=dtype, device=device)
        views.append(base[:, 1:, :, 3:195])
        views[-1].copy_(t)
    assert views[0].data_ptr() % 16 != 0
    want = flash_attention(*values, attn_mask=bias, scale=0.5, causal=False, backend="sdpa")
    ours = flash_attention(*views, attn_mask=bias, scale=0.5, causal=False, backend="sdpa")
    assert torch.isfinite(ours).all() and torch.equal(ours, want)
