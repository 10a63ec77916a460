"""Bad input raises naming the argument; non-finite and huge inputs have defined results."""

import math

import pytest
import torch

from stableflash import SFA, AttentionStats, flash_attention


def _qkv(*shape, dtype=torch.float32):
    return [torch.randn(*shape).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("call, error, match", [
    (lambda q, k, v: flash_attention(q[0], k[0], v[0]), ValueError, "q: expected rank 4"),
    (lambda q, k, v: flash_attention(q, k[:, :, :5], v), ValueError, "v: shape"),  # keys of another length: fine, not v
    (lambda q, k, v: flash_attention(q, k, v.double()), TypeError, "v: dtype"),
    (lambda q, k, v: flash_attention(q.int(), k, v), TypeError, "q: expected dtype"),
    (lambda q, k, v: flash_attention(q, k, v, backend="cuda-magic"), ValueError, "backend: expected one of"),
    (lambda q, k, v: flash_attention(q, k, v, precision="fp17"), ValueError, "precision: unknown preset"),
    (lambda q, k, v: flash_attention(q, k, v, stabilize="sfa"), TypeError, "stabilize: expected"),
    (lambda q, k, v: flash_attention(q, k, v, scale=-1.0), ValueError, "scale: expected"),
    (lambda q, k, v: flash_attention(q, k, v, causal=1), TypeError, "causal: expected a bool"),
    (lambda q, k, v: flash_attention(q, k, v, stats=AttentionStats(3)), ValueError, "stats: built for 3 heads"),
    (lambda q, k, v: flash_attention(q, k, v, backend="sdpa", stabilize=SFA()), ValueError, "stabilize: backend 'sdpa'"),
    (lambda q, k, v: flash_attention(q, k, v, backend="math", precision="paper"), ValueError, "precision: backend 'math'"),
    (lambda q, k, v: flash_attention(q, k, v, backend="sdpa", stats=AttentionStats(2)), ValueError, "backend 'sdpa' gives none"),
    (lambda q, k, v: flash_attention(q, [1], v), TypeError, "k: expected a torch.Tensor"),
    (lambda q, k, v: flash_attention(q, k[..., :8], v[..., :8]), ValueError, "k: expected batch 1 and head dim 16"),
    (lambda q, k, v: flash_attention(q, k[..., :8], v), ValueError, "k: expected batch 1 and head dim 16"),
])
def test_bad_input_names_the_argument(call, error, match):
    q, k, v = _qkv(1, 2, 8, 16)
    with pytest.raises(error, match=match):
        call(q, k, v)


def test_fixed_numerics_backends_take_an_unpickled_fa2_policy():
    """A policy restored from a checkpoint equals the preset without being the same object."""
    import pickle

    from stableflash.attention.precision import resolve

    restored = pickle.loads(pickle.dumps(resolve("fa2")))
    q, k, v = _qkv(1, 2, 8, 16)
    for backend in ("sdpa", "math"):
        assert torch.allclose(flash_attention(q, k, v, backend=backend, precision=restored),
                              flash_attention(q, k, v, backend=backend), atol=1e-6)


def test_triton_backend_refuses_without_gpu():
    q, k, v = _qkv(1, 2, 8, 16)
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(ValueError, match="backend: 'triton' needs CUDA tensors"):
        flash_attention(q, k, v, backend="triton")


@pytest.mark.parametrize("preset", ["fa2", "bf16", "paper", "fp32"])
@pytest.mark.parametrize("stabilize", [None, SFA()])
def test_huge_equal_logits_are_finite(preset, stabilize):
    # q = k = v = 133120 in bf16: every score is ~1.4e11 and tied; some flash kernels return NaN here
    q = torch.full((1, 2, 64, 64), 133120.0, dtype=torch.bfloat16)
    out = flash_attention(q, q, q, precision=preset, stabilize=stabilize, backend="reference")
    assert torch.isfinite(out).all()
    assert torch.allclose(out.float(), torch.full_like(out.float(), 133120.0), rtol=1e-2)


def test_huge_logits_backward_is_finite():
    q = torch.full((1, 1, 32, 64), 133120.0, dtype=torch.bfloat16, requires_grad=True)
    out = flash_attention(q, q, q, precision="paper", stabilize=SFA(), backend="reference")
    out.float().sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("backend", ["reference", "math"])
def test_nan_and_inf_inputs_poison_only_their_rows(backend):
    q, k, v = _qkv(1, 1, 16, 8, dtype=torch.float64)
    q[0, 0, 5, 0] = math.nan
    q[0, 0, 9, :] = math.inf  # +inf scores: inf - inf in the softmax gives NaN for that row
    out = flash_attention(q, k, v, causal=False, backend=backend, **({"precision": "fp64"} if backend == "reference" else {}))
    bad = torch.isnan(out[0, 0]).any(-1)
    assert bad.tolist() == [i in (5, 9) for i in range(16)]


def test_neg_inf_keys_are_masked_and_fully_masked_rows_give_zero():
    q, k, v = _qkv(1, 1, 8, 4, dtype=torch.float64)
    q = q.abs() + 0.1
    k = k.abs() + 0.1
    k[0, 0, 3] = -math.inf  # scores with key 3 are -inf: key 3 gets weight 0
    ref = flash_attention(q, k, v, causal=False, scale=0.5, precision="fp64", backend="reference")
    keep = [i for i in range(8) if i != 3]
    expected = torch.softmax((q @ k[:, :, keep].transpose(-1, -2)) * 0.5, -1) @ v[:, :, keep]
    assert torch.allclose(ref, expected)
    # a query of -inf against positive keys: every score -inf, no visible key: O = 0, gradients 0
    q2 = q.clone()
    q2[0, 0, 2] = -math.inf
    k2 = k.clone()
    k2[0, 0, 3] = 1.0
    q2.requires_grad_()
    out = flash_attention(q2, k2, v, causal=False, precision="fp64", backend="reference")
    assert torch.equal(out[0, 0, 2], torch.zeros(4, dtype=torch.float64))
    out.sum().backward()
    assert torch.isfinite(q2.grad[0, 0, [0, 1, 3]]).all()


@pytest.mark.parametrize("backend", ["auto", "reference", "math"])
@pytest.mark.parametrize("Tq, Tk", [(0, 5), (3, 0), (0, 0)])
def test_no_queries_or_no_keys_are_defined(backend, Tq, Tk):
    """Tq = 0: an empty O; Tk = 0: every row sees no key, so O = 0 and lse = -inf, as a fully masked row. Both keep
    the policy's dtypes and join autograd with zero gradients (GQA included), and the rows count in the statistics."""
    q = torch.randn(2, 4, Tq, 8, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, Tk, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    stats = AttentionStats(4) if backend != "math" else None
    out, lse = flash_attention(q, k, v, causal=True, backend=backend, stats=stats, return_lse=True,
                               key_padding_mask=torch.ones(2, Tk, dtype=torch.bool))
    assert out.shape == (2, 4, Tq, 8) and out.dtype == torch.bfloat16 and torch.equal(out, torch.zeros_like(out))
    assert lse.shape == (2, 4, Tq) and lse.dtype == torch.float32 and torch.isneginf(lse).all()
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(g.shape == t.shape and torch.equal(g, torch.zeros_like(g)) for g, t in zip(grads, (q, k, v)))
    if stats is not None:
        assert stats.rows.tolist() == [2 * Tq] * 4 and stats.repeated_max_rows.sum() == 0
    _, lse64 = flash_attention(q.double(), k.double(), v.double(), precision="fp64", return_lse=True)
    assert lse64.dtype == torch.float64


def test_statistics_stay_out_of_autograd_in_compiled_micro_batches():
    """A maximum that carries a gradient (a compiled op's float output) must not make the running totals part of the
    graph: a compiled step would then take them as an input needing a gradient, and the next micro-batch's backward
    would run the previous one's graph a second time."""
    stats = AttentionStats(2)
    w = torch.randn(2, requires_grad=True)

    def micro_batch(x):
        score = x * w
        stats.add(slice(None), rows=3, repeated_max_rows=torch.ones(2, dtype=torch.int64),
                  pbar_ones=torch.ones(2, dtype=torch.int64), max_score=score)
        return score.square().sum()

    step = torch.compile(micro_batch, backend="aot_eager", fullgraph=True)
    for i in range(3):
        step(torch.full((2,), float(i + 1))).backward()
    assert not stats.max_score.requires_grad
    assert stats.max_score.tolist() == pytest.approx(torch.maximum(w, 3 * w).tolist())  # the largest of x * w
    assert stats.rows.tolist() == [9, 9]


def test_kernels_report_no_masks_for_head_dims_or_dtypes_they_do_not_run():
    """`supports_masks` answers (False) rather than raising for a head dim or dtype the kernels lack: a masked call
    at such a head dim takes the reference. Head dims up to 256 run (those between the compiled ones padded)."""
    pytest.importorskip("triton")
    from stableflash.attention import triton as kernels
    from stableflash.attention.precision import resolve

    assert kernels.supports_masks(resolve("fa2"), None, torch.bfloat16, 64)
    assert kernels.supports_masks(resolve("fa2"), None, torch.bfloat16, 48)
    assert not kernels.supports_masks(resolve("fa2"), None, torch.bfloat16, 320)
    assert not kernels.supports_masks(resolve("fa2"), None, torch.float32, 64)
    assert kernels.supports_masks(resolve("paper"), None, torch.bfloat16, 64)
    assert not kernels.supports_masks(resolve("paper"), None, torch.bfloat16, 64, packed=True)
    assert kernels.supports_masks(resolve("fa2"), None, torch.bfloat16, 64, packed=True)
