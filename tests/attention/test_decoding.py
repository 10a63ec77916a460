"""The decoding kernel (`triton/decoding.py`) against fp64 and the reference's FA2 numerics, sequence by sequence, on
fresh random caches of odd lengths: GQA/MQA, several queries, causal, windows, softcap, pages, left padding.

Runs on a CUDA GPU (also through `flash_attn_with_kvcache`), or on the CPU under Triton's interpreter."""

import os

import pytest
import torch

from stableflash.attention import flash_attention, flash_attn_with_kvcache
from stableflash.numerics.formats import get_format
from tests.attention.conftest import fresh_seed

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs a CUDA GPU or TRITON_INTERPRET=1"),
]
pytest.importorskip("triton")
from stableflash.attention import triton as kernels  # noqa: E402
from stableflash.attention.precision import resolve  # noqa: E402
from stableflash.attention.triton import decode_attention, kernel_options, supports_decode  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
MAX_LEN = 150 if INTERPRET else 3000  # cache positions per sequence
PAGE = 16 if INTERPRET else 256

# (batch, queries, heads, kv heads, head dim, causal, window, softcap, paged, left padding)
CASES = [
    (3, 1, 4, 4, 64, True, (-1, -1), 0.0, False, False),
    (2, 3, 8, 2, 80, True, (-1, -1), 0.0, True, False),
    (3, 2, 6, 1, 32, False, (-1, -1), 30.0, False, True),
    (2, 1, 4, 2, 64, True, (37, 0), 0.0, True, True),
    (2, 4, 4, 4, 16, False, (20, 5), 0.0, False, False),
]
if not INTERPRET:
    CASES += [(4, 1, 32, 8, 128, True, (-1, -1), 0.0, True, False), (2, 2, 8, 4, 256, True, (-1, -1), 50.0, False, True)]


class _Cache:
    """A random cache, dense (B + 1 rows, read through a permutation) or paged, and each sequence's visible span."""

    def __init__(self, batch, queries, heads, kv_heads, dim, paged, leftpad, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        self.seen = torch.randint(1, MAX_LEN + 1, (batch,), generator=g)
        self.seen[0] = MAX_LEN
        self.first = (torch.rand(batch, generator=g) * self.seen).long() if leftpad else torch.zeros_like(self.seen)
        self.q = torch.randn(batch, queries, heads, dim, generator=g).to(dtype)
        if paged:
            pages = -(-MAX_LEN // PAGE)
            shape = (batch * pages + 3, PAGE, kv_heads, dim)
            self.table = torch.randperm(shape[0], generator=g)[:batch * pages].reshape(batch, pages).int()
            self.rows = torch.arange(batch)
        else:
            shape = (batch + 1, MAX_LEN, kv_heads, dim)
            self.table = None
            self.rows = torch.randperm(batch + 1, generator=g)[:batch]
        self.k, self.v = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))

    def keys_of(self, b):
        """(1, span, H_kv, D) keys and values of sequence b."""
        if self.table is None:
            k, v = self.k[self.rows[b]], self.v[self.rows[b]]
        else:
            k, v = (c[self.table[b].long()].flatten(0, 1) for c in (self.k, self.v))
        span = slice(int(self.first[b]), int(self.seen[b]))
        return k[None, span], v[None, span]

    def on(self, device):
        for name in ("q", "k", "v", "seen", "first", "rows", "table"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))
        return self


def _per_sequence(cache, precision, causal, window, softcap):
    outs, lses = [], []
    for b in range(cache.q.shape[0]):
        k, v = cache.keys_of(b)
        q = cache.q[b:b + 1]
        if precision == "fp64":
            q, k, v = q.double(), k.double(), v.double()
        out, lse = flash_attention(q, k, v, causal=causal, window=window, softcap=softcap, layout="bthd",
                                   precision=precision, backend="reference", return_lse=True)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _check(ours, ref, exact, what, seed, dtype, ulps=1, slack=0.0):
    """flash-attention's rule: |ours - exact| <= 2 |reference - exact| + `ulps` ulps at the largest entry (the lse's
    four: fp32 sums in another order and the hardware's exp2) + `slack`."""
    ours, ref, exact = (t.detach().cpu().double() for t in (ours, ref, exact))
    atol = ulps * get_format(dtype).ulp(exact.abs().max().item()) + slack
    err, ref_err = (ours - exact).abs().max().item(), (ref - exact).abs().max().item()
    assert err <= 2 * ref_err + atol, f"{what}: error {err:.3g}, reference's {ref_err:.3g}, atol {atol:.3g} (seed {seed})"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decoding_is_within_twice_the_references_error(case):
    B, Tq, H, H_kv, D, causal, window, softcap, paged, leftpad = case
    seed = fresh_seed()
    dtype = torch.bfloat16
    cache = _Cache(B, Tq, H, H_kv, D, paged, leftpad, dtype, seed)
    exact_out, exact_lse = _per_sequence(cache, "fp64", causal, window, softcap)
    ref_out, ref_lse = _per_sequence(cache, "fa2", causal, window, softcap)
    cache.on(DEVICE)
    out, lse = decode_attention(cache.q, cache.k, cache.v, seen=cache.seen, first=cache.first, cache_rows=cache.rows,
                                block_table=cache.table, scale=D**-0.5, window=window, causal=causal, softcap=softcap)
    assert out.shape == cache.q.shape and out.dtype == dtype and lse.shape == (B, H, Tq)
    _check(out, ref_out, exact_out, "out", seed, dtype)
    hidden = exact_lse == float("-inf")  # queries before their sequence's first key (causal): O = 0, lse = -inf
    assert torch.equal(lse.cpu() == float("-inf"), hidden), f"rows without keys (seed {seed})"
    assert (out.cpu()[hidden.transpose(1, 2)] == 0).all(), f"rows without keys (seed {seed})"
    # the kernels' tanh, 2·sigmoid(2x) - 1, keeps about 2^-23 of absolute precision: up to ~2^-21 of the cap per score
    _check(lse.cpu()[~hidden], ref_lse[~hidden], exact_lse[~hidden], "lse", seed, torch.float32, ulps=4,
           slack=softcap * 2.0**-21)


def test_a_sequence_without_keys_gives_zeros_and_minus_infinity():
    cache = _Cache(2, 1, 4, 2, 32, False, False, torch.float16, 0).on(DEVICE)
    seen = torch.tensor([0, 5], device=DEVICE)
    out, lse = decode_attention(cache.q, cache.k, cache.v, seen=seen, first=torch.zeros_like(seen),
                                cache_rows=cache.rows, scale=0.2, causal=True)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    assert torch.isfinite(lse[1]).all()


def test_the_decoding_kernel_takes_only_what_it_computes():
    fa2 = resolve("fa2")
    assert supports_decode(fa2, None, torch.bfloat16, 256, 64)
    assert not supports_decode(fa2, None, torch.float32, 64, 1)  # fp32 caches: the flash kernels' reference path
    assert not supports_decode(fa2, None, torch.bfloat16, 64, 65)  # a prefill's rows
    assert not supports_decode(resolve("paper"), None, torch.bfloat16, 64, 1)  # emulated numerics
    with kernel_options(decode_kernel=False):
        assert not supports_decode(fa2, None, torch.bfloat16, 64, 1)
    cache = _Cache(1, 1, 4, 3, 32, False, False, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="k_cache: 3 key/value heads"):
        decode_attention(cache.q, cache.k, cache.v, seen=cache.seen, first=cache.first, cache_rows=cache.rows,
                         scale=1.0)


def test_one_length_for_every_sequence_gives_the_per_sequence_calls_bits():
    cache = _Cache(3, 2, 6, 3, 64, False, False, torch.bfloat16, 1).on(DEVICE)
    every = torch.full((3,), 100, device=DEVICE)
    rows = torch.arange(3, device=DEVICE)
    kw = dict(scale=0.125, causal=True, window=(40, -1))
    out, lse = decode_attention(cache.q, cache.k, cache.v, seen=100, **kw)
    each, each_lse = decode_attention(cache.q, cache.k, cache.v, seen=every, first=torch.zeros_like(every),
                                      cache_rows=rows, **kw)
    assert torch.equal(out, each) and torch.equal(lse, each_lse)
    with pytest.raises(ValueError, match="first, cache_rows"):
        decode_attention(cache.q, cache.k, cache.v, seen=every, scale=1.0)


@pytest.fixture
def decoding_calls(monkeypatch):
    """How many calls reached the decoding kernel."""
    calls = []
    monkeypatch.setattr(kernels, "decode_attention", lambda *a, **kw: calls.append(1) or decode_attention(*a, **kw))
    return calls


@pytest.mark.skipif(INTERPRET, reason="the drop-ins route to the kernel on CUDA tensors")
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_decoding_on_the_gpu_takes_the_kernel_and_matches_the_reference_path(paged, decoding_calls):
    seed = fresh_seed()
    cache = _Cache(3, 1, 8, 2, 128, paged, False, torch.bfloat16, seed).on(DEVICE)
    kwargs = dict(cache_seqlens=cache.seen, cache_batch_idx=None if paged else cache.rows, block_table=cache.table,
                  causal=True, return_softmax_lse=True)
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(cache.q, cache.k, cache.v, **kwargs)
        ref, ref_lse = flash_attn_with_kvcache(cache.q, cache.k, cache.v, backend="reference", **kwargs)
    assert decoding_calls == [1]
    assert (out.float() - ref.float()).abs().max() < 2e-2, f"seed {seed}"
    assert (lse - ref_lse).abs().max() < 1e-3, f"seed {seed}"


@pytest.mark.skipif(INTERPRET, reason="flash_attention routes to the kernel on CUDA tensors")
def test_flash_attention_decodes_in_the_kernel_only_without_gradients(decoding_calls):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 8, 1, 64, generator=g).to(DEVICE, torch.bfloat16)
    k, v = (torch.randn(2, 2, 777, 64, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        out = flash_attention(q, k, v, causal=True, window=(300, 0))
        with kernel_options(decode_kernel=False):
            flash = flash_attention(q, k, v, causal=True, window=(300, 0))
    assert decoding_calls == [1]
    exact = flash_attention(q.double(), k.double(), v.double(), causal=True, window=(300, 0), precision="fp64",
                            backend="reference")
    _check(out, flash, exact, "out", seed, torch.bfloat16)
    flash_attention(q.requires_grad_(), k, v, causal=True)  # a graph to keep: the flash kernels
    assert decoding_calls == [1]


@pytest.mark.parametrize("form", ["whole caches", "lengths and new keys", "pages, left padding", "rows picked"])
def test_kvcache_calls_reach_the_kernel_with_each_sequences_span(form, monkeypatch):
    """flash_attn_with_kvcache's forms through the decoding kernel (on the CPU too, its route forced) against its
    reference path: the new keys written first, lengths, left padding, pages and picked cache rows."""
    import stableflash.attention.flash_attn as dropins

    seed = fresh_seed()
    paged = form.startswith("pages")
    cache = _Cache(3, 2, 8, 2, 64, paged, False, torch.bfloat16, seed).on(DEVICE)
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(causal=True, return_softmax_lse=True, block_table=cache.table)
    if form != "whole caches":
        kwargs["cache_seqlens"] = (cache.seen - 3).clamp(min=0)
    if form == "lengths and new keys":
        kwargs["k"], kwargs["v"] = (torch.randn(3, 3, 2, 64, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    if paged:
        kwargs["cache_leftpad"] = torch.tensor([2, 0, 5], device=DEVICE).clamp(max=kwargs["cache_seqlens"])
    if form == "rows picked":
        kwargs["cache_batch_idx"] = cache.rows
    k_ref, v_ref = cache.k.clone(), cache.v.clone()
    ref, ref_lse = flash_attn_with_kvcache(cache.q, k_ref, v_ref, backend="reference", **kwargs)
    calls = []
    monkeypatch.setattr(dropins, "_decodes_in_the_kernel", lambda *a: calls.append(1) or True)
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(cache.q, cache.k, cache.v, **kwargs)
    assert calls == [1]
    assert torch.equal(cache.k, k_ref) and torch.equal(cache.v, v_ref), "the new keys written as the reference writes"
    assert (out.float() - ref.float()).abs().max() < 2e-2, f"seed {seed}"
    finite = ref_lse > float("-inf")
    assert torch.equal(lse > float("-inf"), finite) and (lse - ref_lse)[finite].abs().max() < 1e-3, f"seed {seed}"


def test_many_splits_are_combined_a_block_at_a_time(monkeypatch):
    """More splits than the combine takes at once (16): a 2,600-position cache in 21 splits of one tile each."""
    from stableflash.attention.triton import decoding

    monkeypatch.setattr(decoding, "_programs_to_fill", lambda device: 100)
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 4, 16, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 2600, 1, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    kw = dict(causal=True, window=(-1, -1), softcap=0.0, layout="bthd", backend="reference", return_lse=True)
    exact, exact_lse = flash_attention(q.double(), k.double(), v.double(), precision="fp64", **kw)
    ref, _ = flash_attention(q, k, v, precision="fa2", **kw)
    out, lse = decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), seen=2600, scale=0.25, causal=True)
    _check(out, ref, exact, "out", seed, torch.bfloat16)
    assert (lse.cpu().double() - exact_lse).abs().max() < 1e-3, f"seed {seed}"


def test_a_requested_split_count_is_taken_and_a_bad_one_refused(monkeypatch):
    """`splits` (flash_attn_with_kvcache's `num_splits`) sets how many programs share a sequence's keys: one, or
    more, the results within rounding of each other; the count reaches the kernel's grid."""
    from stableflash.attention.triton import decoding

    grids = []
    split_kernel = decoding._decode_split
    monkeypatch.setattr(decoding, "_decode_split", type("Spy", (), {
        "__getitem__": lambda self, grid: grids.append(grid) or split_kernel[grid]})())
    cache = _Cache(2, 1, 4, 2, 16, False, False, torch.bfloat16, 3).on(DEVICE)
    kw = dict(seen=MAX_LEN, scale=0.25, causal=True)
    one, _ = decode_attention(cache.q, cache.k, cache.v, splits=1, **kw)
    two, _ = decode_attention(cache.q, cache.k, cache.v, splits=2, **kw)
    assert [grid[1] for grid in grids] == [1, 2]
    assert (one.float() - two.float()).abs().max() < 2e-2
    with pytest.raises(ValueError, match="splits: expected an int >= 0"):
        decode_attention(cache.q, cache.k, cache.v, splits=-1, **kw)


def test_inputs_whose_head_dim_is_strided_give_the_contiguous_inputs_bits():
    """q and the caches as every other element of wider tensors (the head dim's stride 2): the kernel addresses the
    head dim as contiguous, so the call reads such inputs through contiguous copies (q's output in q's shape)."""
    cache = _Cache(2, 2, 4, 2, 32, False, True, torch.bfloat16, 3).on(DEVICE)
    kw = dict(seen=cache.seen, first=cache.first, cache_rows=cache.rows, scale=0.2, causal=True)
    out, lse = decode_attention(cache.q, cache.k, cache.v, **kw)
    q, k, v = (torch.stack([t, torch.full_like(t, float("nan"))], dim=-1).flatten(-2)[..., ::2]
               for t in (cache.q, cache.k, cache.v))
    assert q.stride(-1) == 2 and torch.equal(q, cache.q)
    strided_out, strided_lse = decode_attention(q, k, v, **kw)
    assert torch.equal(strided_out, out) and torch.equal(strided_lse, lse)
