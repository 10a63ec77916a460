"""GQA/MQA, Tk != Tq (causal aligned bottom-right), windows, key padding, the (B, T, H, D) layout and flash-attn's
signatures, against a dense fp64 softmax written here from the definitions."""

import math

import pytest
import torch

from stableflash import AttentionStats, flash_attention
from stableflash.attention import flash_attn_func, flash_attn_varlen_func


def dense(q, k, v, *, causal=False, window=(-1, -1), keep=None, scale=None):
    """softmax(q kᵀ) v in fp64, key j visible to query i when 0-based j - (i + Tk - Tq) is in [-left, right]."""
    q, k, v = (t.double() for t in (q, k, v))
    H, Hkv = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    Tq, Tk = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    d = torch.arange(Tk)[None, :] - (torch.arange(Tq)[:, None] + Tk - Tq)
    visible = torch.ones(Tq, Tk, dtype=torch.bool)
    right = 0 if causal else window[1]
    if causal and window[1] >= 0:
        right = min(0, window[1])
    if right >= 0 or causal:
        visible &= d <= right
    if window[0] >= 0:
        visible &= d >= -window[0]
    visible = visible.expand(q.shape[0], 1, Tq, Tk)
    if keep is not None:
        visible = visible & keep[:, None, None, :]
    p = torch.softmax(s.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)  # no visible key: O = 0
    return p @ v


def _inputs(seed, B=2, H=6, Hkv=2, Tq=37, Tk=53, D=16, dtype=torch.float64):
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g)
    k, v = (torch.randn(B, Hkv, Tk, D, generator=g) for _ in range(2))
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _grads(out, inputs, seed):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return torch.autograd.grad(out, inputs, dout.to(out.dtype))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CASES = [
    dict(Hkv=2), dict(Hkv=1), dict(Hkv=6, Tq=53),  # GQA, MQA, MHA
    dict(causal=True), dict(causal=True, Tq=53, Tk=37),  # bottom-right causal, both ways round
    dict(window=(5, 3)), dict(causal=True, window=(7, -1)), dict(keep=True), dict(causal=True, keep=True),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("backend", ["reference", "math"])
def test_masked_and_grouped_attention_is_the_dense_softmax(case, backend):
    case = dict(case)
    seed = 31 + len(str(case))
    shape = {key: case.pop(key) for key in ("Hkv", "Tq", "Tk") if key in case}
    q, k, v = _inputs(seed, **shape)
    keep = None
    if case.pop("keep", False):
        keep = torch.rand(q.shape[0], k.shape[-2], generator=torch.Generator().manual_seed(seed)) > 0.3
        keep[1] = False  # a batch whose every key is padding: O = 0, zero gradients
    kw = dict(causal=case.get("causal", False), window=case.get("window"), key_padding_mask=keep)
    # math computes in the inputs' dtype (fp64 here) with the default policy; the reference under fp64
    precision = "fp64" if backend == "reference" else "fa2"
    ours = flash_attention(q, k, v, precision=precision, backend=backend, **kw)
    exact = dense(q, k, v, causal=kw["causal"], window=kw["window"] or (-1, -1), keep=keep)
    assert _rel(ours, exact) < 1e-12
    for a, b in zip(_grads(ours, (q, k, v), seed), _grads(exact, (q, k, v), seed)):
        assert _rel(a, b) < 1e-10
    if keep is not None:
        assert (ours[1] == 0).all()


def test_low_precision_keeps_the_error_of_its_format():
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in _inputs(7))
    exact = dense(q, k, v, causal=True, window=(9, -1))
    out = flash_attention(q, k, v, causal=True, window=(9, -1), precision="paper", backend="reference")
    assert _rel(out, exact) < 2e-2


def test_the_bthd_layout_is_the_same_attention():
    q, k, v = _inputs(3)
    bhtd = flash_attention(q, k, v, causal=True, precision="fp64", backend="reference")
    bthd = flash_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, precision="fp64", backend="reference",
                           layout="bthd")
    assert torch.equal(bthd.transpose(1, 2), bhtd)
    fa = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, precision="fp64", backend="reference")
    assert torch.equal(fa, bthd)


def test_flash_attn_func_refuses_what_it_does_not_do():
    q, k, v = (t.transpose(1, 2) for t in _inputs(4))
    for kwargs, name in ((dict(dropout_p=0.1), "dropout_p"), (dict(softcap=-1.0), "softcap"),
                         (dict(alibi_slopes=torch.ones(6)), "alibi_slopes")):
        with pytest.raises(ValueError, match=name):
            flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="window"):
        flash_attn_func(q, k, v, window_size=(2, -5))


def test_varlen_is_each_sequence_alone():
    g = torch.Generator().manual_seed(9)
    print("seed 9")
    lengths_q, lengths_k = [5, 0, 11, 7], [6, 3, 11, 9]
    q = torch.randn(sum(lengths_q), 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 11, causal=True, precision="fp64", backend="reference")
    for s in range(4):
        a, b = cu_q[s].item(), cu_q[s + 1].item()
        if a == b:
            continue
        c, d = cu_k[s].item(), cu_k[s + 1].item()
        one = dense(q[None, a:b].transpose(1, 2), k[None, c:d].transpose(1, 2), v[None, c:d].transpose(1, 2),
                    causal=True)
        assert _rel(out[a:b], one[0].transpose(0, 1)) < 1e-12
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        flash_attn_varlen_func(q, k, v, cu_q.flip(0), cu_k, 11, 11)


def test_statistics_count_only_visible_keys():
    # two tied maxima per row, one of them behind the padding: no repeated maximum is left
    q = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.tensor([[[[3.0, 0.0], [3.0, 0.0], [0.0, 1.0], [0.0, 2.0]]]], dtype=torch.float64)
    v = torch.randn(1, 1, 4, 2, dtype=torch.float64)
    counts = {}
    for name, keep in (("all", None), ("padded", torch.tensor([[True, False, True, True]]))):
        stats = AttentionStats(num_heads=1)
        flash_attention(q, k, v, causal=False, scale=1.0, precision="fp64", backend="reference", stats=stats,
                        key_padding_mask=keep)
        counts[name] = int(stats.repeated_max_rows[0])
    assert counts == {"all": 4, "padded": 0}


def test_argument_checks_name_the_argument():
    q, k, v = _inputs(5)
    with pytest.raises(ValueError, match="k: its 4 heads must divide q's 6"):
        flash_attention(q, torch.zeros(2, 4, 53, 16, dtype=torch.float64), torch.zeros(2, 4, 53, 16,
                                                                                       dtype=torch.float64))
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(B, Tk\)"):
        flash_attention(q, k, v, key_padding_mask=torch.ones(2, 37, dtype=torch.bool))
    with pytest.raises(ValueError, match="layout"):
        flash_attention(q, k, v, layout="bhdt")
    with pytest.raises(ValueError, match="triton"):
        flash_attention(q, k, v, backend="triton", window=(4, 4))
