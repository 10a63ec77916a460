"""The fused kernels against the reference, on fresh random inputs of odd sizes every run.

Runs on a CUDA GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, which the test configuration
sets where no GPU is present; smaller sizes).
"""

import contextlib
import functools
import math
import os

import pytest
import torch

from stableflash import SFA, AttentionStats, ClampPbar, flash_attention
from stableflash.attention.precision import PRESETS, SITES, resolve
from stableflash.attention.stats import STAT_COLUMNS
from stableflash.attention.triton import kernel_options
from stableflash.numerics.formats import get_format
from tests.attention.conftest import fresh_seed, no_tile_picks, rel_err, tied_below_zero_inputs, tied_inputs
from tests.attention.variants import EMULATED_VARIANTS, NARROW_VARIANTS, emulated_variant

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs a CUDA GPU or TRITON_INTERPRET=1"),
]
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from stableflash.attention.triton.emulation import _round_at  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
# (B, H, T, D): odd lengths, ragged last tiles, several tiles per row
SHAPES = [(2, 4, 77, 16), (1, 2, 130, 64)] if INTERPRET else [(2, 3, 77, 64), (1, 4, 513, 64), (2, 2, 1000, 128)]


def _attention(q, k, v, **kw):
    """The fused kernel (through the public API on a GPU, the backend directly under the interpreter)."""
    if INTERPRET:
        from stableflash.attention import triton as backend
        D = q.shape[-1]
        return backend.attention(q, k, v, causal=kw.get("causal", True), scale=kw.get("scale") or D**-0.5,
                                 policy=resolve(kw.get("precision", "fa2")), stabilize=kw.get("stabilize"),
                                 stats=kw.get("stats"), window=kw.get("window") or (-1, -1),
                                 key_padding=kw.get("key_padding_mask"), softcap=kw.get("softcap", 0.0))
    return flash_attention(q, k, v, backend="triton", **kw)


def _inputs(shape, dtype=torch.bfloat16, seed=None):
    """Fresh random q, k, v on every call, from a seed drawn from torch's generator (seeded afresh per test,
    `tests/conftest.py`); the seed is printed, so a failure's captured output names it."""
    seed = seed if seed is not None else fresh_seed()
    print(f"_inputs{tuple(shape)} {dtype}: seed {seed}")
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).to(DEVICE).requires_grad_() for _ in range(3)]


def _run(fn, q, k, v, dout):
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return [out.detach(), *grads]


def _fp64(q, k, v, causal):
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    return lambda _q, _k, _v: flash_attention(q64, k64, v64, causal=causal, precision="fp64", backend="reference"), \
        (q64, k64, v64)


def _max_err(a, b):
    return (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item()


def _assert_within_twice_the_reference(name, ours, ref, exact, dtype):
    """flash-attention's rule: max |ours - exact| <= 2 max |ref - exact| + atol. Its atol is the rounding of the
    reference's format at the tensor's scale; ours stores bf16/fp16 results, so the atol is one ulp of that format
    at the exact tensor's largest entry. Without it, fresh draws at (2, 4, 77, 16) broke the bare 2x in 2 of 2,400
    comparisons on correct code; with it, none did, the worst (error - atol) being 0.63x the reference's. That entry
    counts as at least 2^-10: a gradient that cancels to 0 exactly (one visible key: dS = P(dP - δ) = 0) is still
    a sum of O(1) terms rounded in fp32 (~3e-8 seen), where the reference's order cancels exactly."""
    atol = get_format(dtype).ulp(max(exact.abs().max().item(), 2.0**-10))
    err, ref_err = _max_err(ours, exact), _max_err(ref, exact)
    assert err <= 2 * ref_err + atol, (name, err, ref_err, atol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa2_within_twice_the_reference_error(shape, causal, dtype):
    q, k, v = _inputs(shape, dtype)
    dout = torch.randn(shape, device=DEVICE).to(dtype)
    ours = _run(lambda *t: _attention(*t, causal=causal), q, k, v, dout)
    ref = _run(lambda *t: flash_attention(*t, causal=causal, precision="fa2", backend="reference"), q, k, v, dout)
    f, leaves = _fp64(q, k, v, causal)
    exact = _run(f, *leaves, dout.cpu().double())
    for name, a, r, e in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
        assert torch.isfinite(a).all(), name
        _assert_within_twice_the_reference(name, a, r, e, dtype)


def _assert_within_twice_the_references_error_against_fp64(ours, q, k, v, dout, seed, stabilize, **kw):
    """`ours` (out, dq, dk, dv), each finite and within twice the error of the reference (bf16 inputs, its FA2
    numerics, `stabilize`) against plain fp64 attention with the same `kw`; returns the fp64 leaves."""
    ref = _run(functools.partial(flash_attention, backend="reference", stabilize=stabilize, **kw), q, k, v, dout)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    exact = _run(lambda *t: flash_attention(*t, precision="fp64", backend="reference", **kw), *leaves,
                 dout.cpu().double())
    for name, a, r, e in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
        assert torch.isfinite(a).all(), (name, f"seed {seed}")
        _assert_within_twice_the_reference(name, a, r, e, torch.bfloat16)
    return leaves


SOFTCAP_CASES = {  # Tq, Tk, causal, window, kv heads (of 4)
    "causal": (77, 77, True, None, 4),
    "not causal, GQA": (77, 77, False, None, 2),
    "Tk > Tq, a window": (45, 93, True, (20, 0), 4),
}


@pytest.mark.parametrize("stabilize", [None, SFA()], ids=["plain", "sfa"])
@pytest.mark.parametrize("case", list(SOFTCAP_CASES))
def test_softcap_runs_in_the_kernels_within_twice_the_reference_error(case, stabilize):
    """Gemma 2's cap, softcap · tanh(S / softcap), at a cap the scores reach (q scaled up): outputs and gradients
    within twice the reference's error against fp64 with the same cap, and the log-sum-exp of the capped scores."""
    Tq, Tk, causal, window, kv_heads = SOFTCAP_CASES[case]
    seed = fresh_seed()
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    D, cap = 16 if INTERPRET else 64, 5.0
    q = (4 * torch.randn(2, 4, Tq, D, generator=g)).to(torch.bfloat16).to(DEVICE).requires_grad_()
    k, v = (torch.randn(2, kv_heads, Tk, D, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
            for _ in range(2))
    dout = torch.randn(2, 4, Tq, D, generator=g).to(torch.bfloat16).to(DEVICE)
    kw = dict(causal=causal, window=window, softcap=cap)
    ours = _run(functools.partial(_attention, stabilize=stabilize, **kw), q, k, v, dout)
    leaves = _assert_within_twice_the_references_error_against_fp64(ours, q, k, v, dout, seed, stabilize, **kw)
    if not INTERPRET:  # the public API's log-sum-exp from the kernels
        _, lse = flash_attention(q, k, v, backend="triton", return_lse=True, **kw)
        _, exact_lse = flash_attention(*leaves, precision="fp64", backend="reference", return_lse=True, **kw)
        seen = torch.isfinite(exact_lse)
        assert torch.allclose(lse.cpu().double()[seen], exact_lse.detach()[seen], atol=2e-2), f"seed {seed}"


ATOMIC_DQ_CASES = {  # Tq, Tk, causal, window, kv heads (of 4), the group summed in the dK/dV program, softcap
    "causal, several tiles": (130, 130, True, None, 4, True, 0.0),
    "not causal, GQA in the program": (77, 77, False, None, 2, True, 0.0),
    "GQA, each head's share": (77, 77, True, None, 1, False, 0.0),
    "Tk > Tq, a window, softcap": (45, 93, True, (20, 0), 4, True, 5.0),
}


@pytest.mark.parametrize("case", list(ATOMIC_DQ_CASES))
def test_the_backward_adding_dq_with_atomics_is_within_twice_the_reference_error(case):
    """`KernelOptions(atomic_dq=True)`: no dQ kernel; δ from its own kernel and dQ added by the dK/dV programs. All
    three gradients within twice the reference's error against fp64, the forward untouched, and dK and dV the default
    backward's: bit for bit where the programs add the same terms in the same order, within one bf16 rounding where
    a program sums a GQA group (the atomic form's three loops each walk the group's heads, the default's one loop
    walks each head's tiles in turn)."""
    Tq, Tk, causal, window, kv_heads, in_program, cap = ATOMIC_DQ_CASES[case]
    seed = fresh_seed()
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    D = 16 if INTERPRET else 64
    q = torch.randn(2, 4, Tq, D, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
    k, v = (torch.randn(2, kv_heads, Tk, D, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
            for _ in range(2))
    dout = torch.randn(2, 4, Tq, D, generator=g).to(torch.bfloat16).to(DEVICE)
    kw = dict(causal=causal, window=window, softcap=cap)
    with kernel_options(group_sum_in_program=in_program):
        with kernel_options(atomic_dq=True):
            ours = _run(functools.partial(_attention, **kw), q, k, v, dout)
        default = _run(functools.partial(_attention, **kw), q, k, v, dout)
    _assert_within_twice_the_references_error_against_fp64(ours, q, k, v, dout, seed, None, **kw)
    assert torch.equal(ours[0], default[0]), f"out, seed {seed}"
    for name, a, b in zip(["dk", "dv"], ours[2:], default[2:]):
        if kv_heads < 4 and in_program:  # one rounding of a reordered fp32 sum: at most one bf16 ulp apart
            torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6 * b.abs().max().item(), msg=f"{name}, seed {seed}")
        else:
            assert torch.equal(a, b), (name, f"seed {seed}")


def test_the_options_in_force_at_the_forward_choose_its_backward(monkeypatch):
    """`KernelOptions.atomic_dq` and `group_sum_in_program` are read when the forward runs and kept for its
    backward, wherever that runs."""
    from stableflash.attention.triton import launch

    chosen = []
    backward = launch.backward
    monkeypatch.setattr(launch, "backward", lambda *a, **kw: chosen.append((kw["atomic_dq"], kw["group_sum"]))
                        or backward(*a, **kw))
    _, _, q, k, v, _ = _grouped_inputs(1, 4, 40, 40, 16 if INTERPRET else 64, 2)
    with kernel_options(atomic_dq=True, group_sum_in_program=False):
        out = _attention(q, k, v)
    out.float().sum().backward()
    out = _attention(q, k, v)
    with kernel_options(atomic_dq=True, group_sum_in_program=False):
        out.float().sum().backward()
    assert chosen == [(True, False), (False, True)]


@pytest.mark.parametrize("causal", [True, False])
def test_fa2_with_the_dp_p_delta_within_twice_the_reference_error(causal):
    # δ = rowsum(dP ∘ P) recomputed over the keys (the isolation study's δ formula) in native numerics
    shape = SHAPES[-1]
    policy = resolve("fa2").with_delta("dp_p")
    q, k, v = _inputs(shape)
    dout = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
    ours = _run(lambda *t: _attention(*t, causal=causal, precision=policy), q, k, v, dout)
    ref = _run(lambda *t: flash_attention(*t, causal=causal, precision=policy, backend="reference"), q, k, v, dout)
    f, leaves = _fp64(q, k, v, causal)
    exact = _run(f, *leaves, dout.cpu().double())
    for name, a, r, e in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
        _assert_within_twice_the_reference(name, a, r, e, torch.bfloat16)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["fp32", "fp32+dpp", "paper+operands32"])
def test_fp32_matmul_operands_within_twice_the_reference_error(shape, name):
    # P̄, P and dS fed to the matmuls in fp32 (three tf32 products per dot on the GPU, exact fp32 under the
    # interpreter), against the reference of the same policy; outputs in the policy's dtype, gradients in the inputs'
    policy = {"fp32": resolve("fp32"), "fp32+dpp": resolve("fp32").with_delta("dp_p"),
              "paper+operands32": resolve("paper").with_sites(pbar_operand="fp32", p_operand="fp32", ds_operand="fp32")}[name]
    q, k, v = _inputs(shape)
    dout = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
    ours = _run(lambda *t: _attention(*t, precision=policy), q, k, v, dout)
    ref = _run(lambda *t: flash_attention(*t, precision=policy, backend="reference"), q, k, v, dout)
    f, leaves = _fp64(q, k, v, True)
    exact = _run(f, *leaves, dout.cpu().double())
    for what, a, r, e in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
        assert a.dtype == r.dtype, what
        _assert_within_twice_the_reference(what, a, r, e, a.dtype)


@pytest.mark.parametrize("shape", SHAPES[-2:])
@pytest.mark.parametrize("name", EMULATED_VARIANTS)
@pytest.mark.parametrize("stabilize", [None, SFA()])
def test_emulation_agrees_bit_for_bit_with_the_reference(shape, name, stabilize):
    policy = emulated_variant(name)
    q, k, v = _inputs(shape)
    dout = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
    ours = _run(lambda *t: _attention(*t, precision=policy, stabilize=stabilize), q, k, v, dout)
    ref = _run(lambda *t: flash_attention(*t, precision=policy, stabilize=stabilize, backend="reference"), q, k, v, dout)
    for what, a, r in zip(["out", "dq", "dk", "dv"], ours, ref):
        equal = (a == r).float().mean().item()
        # the issue asks 95% of outputs; gradients also see 1-ulp exp/log differences through P
        assert equal >= (0.95 if what == "out" else 0.80), (what, equal)


@pytest.mark.parametrize("name", NARROW_VARIANTS)
def test_narrow_formats_and_rounding_toward_zero_agree_bit_for_bit_with_the_reference(name):
    """e8m6-e8m3 (bf16's exponent, fewer fraction bits), rounding toward zero and stochastic rounding at the P̄V path's
    sites and at ℓ's and δ's, against the reference of the same policy and seed, with SFA."""
    policy = emulated_variant(name)
    q, k, v = _inputs(SHAPES[-1])
    dout = torch.randn(SHAPES[-1], device=DEVICE).to(torch.bfloat16)
    for stabilize in (None, SFA()):
        torch.manual_seed(11)  # stochastic rounding draws its seed from torch's generator: the same for both
        ours = _run(functools.partial(_attention, precision=policy, stabilize=stabilize), q, k, v, dout)
        torch.manual_seed(11)
        ref = _run(functools.partial(flash_attention, precision=policy, stabilize=stabilize, backend="reference"), q, k,
                   v, dout)
        for what, a, r in zip(["out", "dq", "dk", "dv"], ours, ref):
            equal = (a == r).float().mean().item()
            assert equal >= (0.95 if what == "out" else 0.80), (name, stabilize, what, equal)


@pytest.mark.parametrize("site", list(SITES))
def test_rounding_toward_zero_at_any_one_site_is_the_references(site):
    """Toward zero at each site of a Precision alone, on `paper`: outputs and gradients bit for bit with the
    reference (the threshold of the other emulation tests); O's site rounded to nearest once, in the store."""
    policy = PRESETS["paper"].with_rounding("toward_zero", (site,))
    q, k, v = _inputs((1, 2, 100, 16 if INTERPRET else 64))
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    ours = _run(functools.partial(_attention, precision=policy), q, k, v, dout)
    ref = _run(functools.partial(flash_attention, precision=policy, backend="reference"), q, k, v, dout)
    for what, a, r in zip(["out", "dq", "dk", "dv"], ours, ref):
        equal = (a == r).float().mean().item()
        assert equal >= (0.95 if what == "out" else 0.80), (site, what, equal)


@pytest.mark.parametrize("mode", ["nearest", "toward_zero", "stochastic"])
def test_o_in_a_narrow_format_is_the_references(mode):
    """O's site in e8m4 (bf16's exponent, 4 fraction bits; held in fp32 as the reference holds it), in each mode:
    outputs and gradients bit for bit with the reference for the same seed."""
    policy = PRESETS["paper"].with_sites(out="e8m4")
    policy = policy if mode == "nearest" else policy.with_rounding(mode, ("out",))
    q, k, v = _inputs((1, 2, 100, 16 if INTERPRET else 64))
    dout = torch.randn(q.shape, device=DEVICE)
    torch.manual_seed(5)
    ours = _run(functools.partial(_attention, precision=policy), q, k, v, dout)
    torch.manual_seed(5)
    ref = _run(functools.partial(flash_attention, precision=policy, backend="reference"), q, k, v, dout)
    assert ours[0].dtype == ref[0].dtype == torch.float32
    for what, a, r in zip(["out", "dq", "dk", "dv"], ours, ref):
        assert (a == r).float().mean().item() >= (0.95 if what == "out" else 0.80), (mode, what)


def test_stochastic_rounding_of_o_and_delta_is_the_references_for_the_same_seed():
    """O's site and δ's (the backward draws a seed of its own) rounded stochastically in the kernels, with the bits of
    each element's position: the reference's values for the same seed, other values than nearest rounding's."""
    narrow = PRESETS["paper"].with_sites(delta="e8m4", delta_terms="bf16")
    policy = narrow.with_rounding("stochastic", ("pv", "acc", "out", "delta_terms", "delta"))
    q, k, v = _inputs((1, 2, 100, 16 if INTERPRET else 64))
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    torch.manual_seed(5)
    ours = _run(functools.partial(_attention, precision=policy), q, k, v, dout)
    torch.manual_seed(5)
    ref = _run(functools.partial(flash_attention, precision=policy, backend="reference"), q, k, v, dout)
    nearest = _run(functools.partial(flash_attention, precision=narrow, backend="reference"), q, k, v, dout)
    for what, a, r, n in zip(["out", "dq", "dk", "dv"], ours, ref, nearest):
        assert (a == r).float().mean().item() >= (0.95 if what == "out" else 0.80), what
        if what != "dv":  # dV reads neither O nor δ
            assert (r != n).float().mean().item() > 0.05, what


@triton.jit(do_not_specialize=["seed"])
def _round_vector(X, Y, N, seed, CODE: tl.constexpr, SITE: tl.constexpr, BLOCK: tl.constexpr):
    """Y = X rounded elementwise over N fp32 values as a site rounds them (element i at row i of head 0): the
    emulation kernels' rounding alone."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N)
    tl.store(Y + offs, _round_at(x, CODE, seed, SITE, 0, offs, 0, 0), mask=offs < N)


def test_narrow_formats_round_as_the_reference_does_value_by_value():
    """The kernels' rounding to e8mX, toward zero and stochastic (bits from the element's position), on the fp32 bits,
    against `numerics.round_to` in float64 with the same noise: random values over the whole fp32 range, subnormals,
    the largest finite values, ±0 and ±inf."""
    from stableflash.attention.triton.spec import FORMAT_CODES, MODE_CODES
    from stableflash.numerics.rounding import counter_bits, counter_noise, round_to
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-2**31, 2**31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.4028234e38, -3.4028234e38, 1e-40, -1e-45,
                            1.1754943e-38, 1.5, 2.5, 1.0 + 2**-5])
    x = torch.cat([bits.view(torch.float32), special]).to(DEVICE)
    x = x[torch.isfinite(x) | torch.isinf(x)]
    site, seed = 5, 1234567
    rows = torch.arange(x.numel())
    for fmt in ("bf16", "e8m6", "e8m5", "e8m4", "e8m3"):
        for mode in ("nearest", "toward_zero", "stochastic"):
            y = torch.empty_like(x)
            code = FORMAT_CODES[fmt] + 8 * MODE_CODES[mode]
            _round_vector[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), seed, CODE=code, SITE=site, BLOCK=1024)
            noise = counter_noise(counter_bits(seed, site, torch.zeros(()), rows, torch.zeros(()), 0), fmt)
            want = round_to(x.cpu(), fmt, mode, noise=noise if mode == "stochastic" else None, dtype=torch.float32)
            same = (y.cpu() == want) | (y.cpu().isnan() & want.isnan())
            assert same.all(), (fmt, mode, x.cpu()[~same][:4], y.cpu()[~same][:4], want[~same][:4])
            assert (torch.signbit(y.cpu()) == torch.signbit(want)).all(), (fmt, mode, "sign")


def _grouped_inputs(B, H, Tq, Tk, D, groups):
    """Fresh q (B, H, Tq, D), k and v (B, H / groups, Tk, D) and dO, and the generator after them (for masks); the
    seed is printed and returned, for the failure messages."""
    seed = fresh_seed()
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
    k, v = (torch.randn(B, H // groups, Tk, D, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, H, Tq, D, generator=g).to(torch.bfloat16).to(DEVICE)
    return seed, g, q, k, v, dout


@pytest.mark.parametrize("precision, in_program", [("fa2", True), ("fa2", False), ("paper", True)])
@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_query_attention_reads_each_key_value_head_for_its_group(precision, in_program, groups):
    """k and v with H / groups heads (4: multi-query), read in place by the kernels: outputs and gradients (dK, dV
    summed over each group, natively in the programs or, `group_sum_in_program=False`, afterwards) within twice the
    reference's error against fp64; the emulated `paper` bit for bit with the reference (which sums each group in
    its dK and dV sites' format) where a group is two heads (one sum, in either order)."""
    B, H, T, D = 2, 4, 77, 16 if INTERPRET else 64
    _, _, q, k, v, dout = _grouped_inputs(B, H, T, T, D, groups)
    stats = AttentionStats(H)
    with kernel_options(group_sum_in_program=in_program):
        ours = _run(functools.partial(_attention, precision=precision, stats=stats), q, k, v, dout)
    ref = _run(functools.partial(flash_attention, precision=precision, backend="reference"), q, k, v, dout)
    exact_fn, leaves = _fp64(q, k, v, True)
    exact = _run(exact_fn, *leaves, dout.cpu().double())
    assert [t.shape for t in ours] == [q.shape, q.shape, k.shape, v.shape]
    for name, a, r, e in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
        _assert_within_twice_the_reference(name, a, r, e, torch.bfloat16)
        if precision == "paper" and groups == 2:
            assert (a == r).float().mean().item() >= (0.95 if name == "out" else 0.80), name
    assert stats.rows.tolist() == [B * T] * H


MASKED_CASES = {  # Tq, Tk, causal, window, key padding, query heads per key/value head
    "shorter queries, causal": (45, 77, True, None, False, 1),
    "longer queries, causal (rows that see no key)": (77, 45, True, None, False, 1),
    "longer keys, not causal": (45, 77, False, None, False, 1),
    "sliding window, causal": (77, 77, True, (16, 0), False, 1),
    "window both sides": (77, 77, False, (8, 5), False, 1),
    "key padding, causal, GQA": (77, 77, True, None, True, 2),
    "everything": (50, 77, True, (20, -1), True, 2),
    # several tiles a side: tiles inside the band with no padded key run unmasked
    "long rows, window, key padding": (200, 211, True, (150, -1), True, 1),
}


def _masked_runs(q, k, v, dout, masks: dict, **kw):
    """Our kernels and the reference (each with `kw`, each with statistics) and fp64 on the CPU, under the same masks:
    (ours, ref, exact, our statistics, the reference's)."""
    stats, ref_stats = AttentionStats(q.shape[1]), AttentionStats(q.shape[1])
    ours = _run(functools.partial(_attention, stats=stats, **kw, **masks), q, k, v, dout)
    ref = _run(functools.partial(flash_attention, backend="reference", stats=ref_stats, **kw, **masks), q, k, v, dout)
    keep = masks["key_padding_mask"]
    cpu_masks = {**masks, "key_padding_mask": None if keep is None else keep.cpu()}
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    exact = _run(lambda *t: flash_attention(*t, precision="fp64", backend="reference", **cpu_masks), *leaves,
                 dout.cpu().double())
    return ours, ref, exact, stats, ref_stats


@pytest.mark.parametrize("head_dim", [64] if INTERPRET else [64, 128])  # 128: TMA loads among the candidates
@pytest.mark.parametrize("stabilize", [None, SFA()], ids=["plain", "sfa"])
@pytest.mark.parametrize("case", list(MASKED_CASES))
def test_masked_calls_run_in_the_kernels(case, stabilize, head_dim):
    """Tk != Tq (causal aligned to the bottom right), windows and key padding in the native kernels: outputs and
    gradients within twice the reference's error against fp64 under the same mask; rows and keys that see nothing
    give zeros; the statistics count every query row."""
    Tq, Tk, causal, window, padded, groups = MASKED_CASES[case]
    B, H, D = 2, 4, 16 if INTERPRET else head_dim
    seed, g, q, k, v, dout = _grouped_inputs(B, H, Tq, Tk, D, groups)
    keep = None
    if padded:
        keep = torch.rand(B, Tk, generator=g) > 0.3
        keep[1] = False  # a batch row with no real key: every query row of it sees nothing
        keep = keep.to(DEVICE)
    ours, ref, exact, stats, ref_stats = _masked_runs(q, k, v, dout, dict(causal=causal, window=window,
                                                                         key_padding_mask=keep), stabilize=stabilize)
    assert [t.shape for t in ours] == [q.shape, q.shape, k.shape, v.shape]
    for name, a, r, e in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
        assert torch.isfinite(a).all(), (name, f"seed {seed}")
        _assert_within_twice_the_reference(name, a, r, e, torch.bfloat16)
    empty = (exact[0] == 0).all(-1)  # query rows that see no key: O = 0 and dQ = 0
    assert (ours[0].cpu()[empty] == 0).all() and (ours[1].cpu()[empty] == 0).all(), f"seed {seed}"
    if padded:
        assert (ours[0][1] == 0).all() and (ours[1][1] == 0).all() and (ours[2][1] == 0).all()
    assert stats.rows.tolist() == [B * Tq] * H
    # the largest score is of visible keys only (a hidden key's score is often larger): the reference's
    assert torch.allclose(stats.max_score.cpu(), ref_stats.max_score.cpu(), rtol=1e-5), f"seed {seed}"


@pytest.mark.parametrize("mask", ["no key padded", "a window wider than the rows", "packed, one sequence"])
def test_a_mask_that_hides_nothing_gives_the_plain_kernels_bits(mask, monkeypatch):
    """A causal call whose mask hides nothing more runs the masked form (every visited tile masked) and gives the
    plain call's bits: the mask is the identity where the plain kernels skip it, and both visit the same tiles in the
    same order (outputs and gradients; one 64x64 tile for both, several tiles a side, a ragged end)."""
    from stableflash.attention import triton as backend

    launch = _fixed_tile(monkeypatch)
    B, H, T, D = (1 if mask.startswith("packed") else 2), 2, 211, 16 if INTERPRET else 64
    seed, _, q, k, v, dout = _grouped_inputs(B, H, T, T, D, 1)
    policy = resolve("fa2")

    def masked(q, k, v):
        if mask == "packed, one sequence":
            segments = launch.packed_segments([0, T], [0, T], q.device)
            return backend.attention(q, k, v, causal=True, scale=D**-0.5, policy=policy, segments=segments)
        if mask == "no key padded":
            return _attention(q, k, v, key_padding_mask=torch.ones(B, T, dtype=torch.bool, device=q.device))
        return _attention(q, k, v, window=(T + 5, 0))

    assert launch.band_of(q, k, True, (T + 5, 0), None) is not None  # the masked form, not the plain one
    plain = _run(_attention, q, k, v, dout)
    for name, a, b in zip(["out", "dq", "dk", "dv"], _run(masked, q, k, v, dout), plain):
        assert torch.equal(a, b), (name, f"seed {seed}")


@pytest.mark.parametrize("longer", [0, 123], ids=["one logical tile", "several logical tiles"])
@pytest.mark.parametrize("precision", ["paper", "bf16"])
@pytest.mark.parametrize("case", ["longer queries, causal (rows that see no key)", "window both sides", "everything"])
def test_masked_calls_under_emulated_policies_match_the_reference(case, precision, longer):
    """Tk != Tq, windows and key padding in the emulation kernels: outputs and gradients within twice the reference's
    error against fp64, and mostly bit for bit with the reference under the same policy (the threshold the unmasked
    emulation tests use); `longer` adds 123 positions, so that `bf16`'s 128-row logical tiles span two physical
    ones and a window's tile is visited for the whole logical tile, as the reference visits it."""
    Tq, Tk, causal, window, padded, groups = MASKED_CASES[case]
    Tq, Tk = Tq + longer, Tk + longer
    B, H, D = 2, 4, 16 if INTERPRET else 64
    seed, g, q, k, v, dout = _grouped_inputs(B, H, Tq, Tk, D, groups)
    keep = None
    if padded:
        keep = torch.rand(B, Tk, generator=g) > 0.3
        keep[1, : Tk // 2] = False  # a row's first half all padding: its windowed queries there see nothing
        keep = keep.to(DEVICE)
    ours, ref, exact, stats, ref_stats = _masked_runs(q, k, v, dout, dict(causal=causal, window=window,
                                                                         key_padding_mask=keep), precision=precision)
    for name, a, r, e in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
        assert torch.isfinite(a).all(), (name, f"seed {seed}")
        _assert_within_twice_the_reference(name, a, r, e, torch.bfloat16)
        equal = (a == r).float().mean().item()
        assert equal >= (0.95 if name == "out" else 0.80), (name, equal, f"seed {seed}")
    assert stats.rows.tolist() == [B * Tq] * H
    assert torch.equal(stats.repeated_max_rows.cpu(), ref_stats.repeated_max_rows.cpu()), f"seed {seed}"
    assert torch.allclose(stats.max_score.cpu(), ref_stats.max_score.cpu(), rtol=1e-5), f"seed {seed}"


PACKED_LENGTHS = {  # queries and keys per sequence: odd lengths, one of 1; then other key lengths, none, no queries
    "self-attention": ([30, 1, 77, 13], [30, 1, 77, 13]),
    "other key lengths": ([30, 1, 77, 13, 0], [45, 3, 50, 0, 7]),
    "a long sequence": ([7, 170, 20], [7, 170, 20]),  # tiles inside one sequence's band run unmasked
    # many more queries than keys: whole query tiles see no key (causal to the bottom right)
    "more queries than keys": ([150, 5, 130], [20, 70, 3]),
    # flash-attn's decoding shape, and multi-head (a dK/dV program per query head): with a window, key tiles that no
    # query sees, whose empty loops once read out of bounds on the GPU (`common._seen_range`)
    "one query each, many keys": ([1, 1, 1, 1], [147, 130, 139, 128]),
}
PACKED_KV_HEADS = {"one query each, many keys": 4}  # else 2 of the 4 query heads' (GQA)


@pytest.mark.parametrize("lengths", list(PACKED_LENGTHS))
@pytest.mark.parametrize("causal, window", [(True, None), (True, (9, 0)), (False, (6, 4)), (False, None),
                                           (True, (-1, 3)), (False, (0, -1))])
def test_packed_sequences_run_in_one_kernel_call(causal, window, lengths, monkeypatch):
    """flash_attn_varlen_func's packed batch in one masked call of the kernels, GQA (or MHA), each sequence causal to
    its own bottom right: outputs and gradients within twice the per-sequence reference's error against fp64."""
    from stableflash.attention import triton as backend
    from stableflash.attention.flash_attn import flash_attn_varlen_func
    from stableflash.attention.triton import launch

    q_offsets, k_offsets = ([0, *torch.tensor(n).cumsum(0).tolist()] for n in PACKED_LENGTHS[lengths])
    longest_q, longest_k = (max(n) for n in PACKED_LENGTHS[lengths])
    H, D = 4, 16 if INTERPRET else 64
    seed = fresh_seed()
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_offsets[-1], H, D, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
    kv_heads = PACKED_KV_HEADS.get(lengths, 2)
    k, v = (torch.randn(k_offsets[-1], kv_heads, D, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()
            for _ in range(2))
    dout = torch.randn(q_offsets[-1], H, D, generator=g).to(torch.bfloat16).to(DEVICE)
    cu_q, cu_k = (torch.tensor(o, dtype=torch.int32, device=DEVICE) for o in (q_offsets, k_offsets))
    window = window or (-1, -1)
    forwards = []
    forward = launch.forward
    monkeypatch.setattr(launch, "forward", lambda *a, **kw: forwards.append(1) or forward(*a, **kw))

    def ours_fn(q, k, v):
        if INTERPRET:  # the public function takes the kernels on CUDA only: the backend as it calls it
            heads = [t.transpose(0, 1)[None] for t in (q, k, v)]
            out = backend.attention(*heads, causal=causal, scale=D**-0.5, policy=resolve("fa2"), window=window,
                                    segments=launch.packed_segments(q_offsets, k_offsets, q.device))
            return out[0].transpose(0, 1)
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, longest_q, longest_k, causal=causal,
                                      window_size=window)

    def per_sequence(precision, backend_name):
        return lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q.to(q.device), cu_k.to(q.device), longest_q,
                                                      longest_k, causal=causal, window_size=window,
                                                      precision=precision, backend=backend_name)

    ours = _run(ours_fn, q, k, v, dout)
    assert len(forwards) == 1, f"{len(forwards)} kernel calls for one packed batch"
    ref = _run(per_sequence("fa2", "reference"), q, k, v, dout)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    exact = _run(per_sequence("fp64", "reference"), *leaves, dout.cpu().double())
    for name, a, r, e in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
        assert torch.isfinite(a).all(), (name, f"seed {seed}")
        _assert_within_twice_the_reference(name, a, r, e, torch.bfloat16)
    empty = (exact[0] == 0).all(-1)  # queries that see no key (a sequence without keys, causal ones): O = 0
    assert (ours[0].cpu()[empty] == 0).all(), f"seed {seed}"


def test_masked_calls_compile_without_graph_breaks():
    """Tk != Tq, a window and key padding through torch.compile(fullgraph=True): the ops run the same kernels with the
    same tiles as eagerly, so the same bits."""
    torch._dynamo.reset()
    seed, g, q, k, v, _ = _grouped_inputs(2, 4, 45, 77, 16 if INTERPRET else 64, 2)
    keep = (torch.rand(2, 77, generator=g) > 0.2).to(DEVICE)

    def f(q, k, v):
        return _attention(q, k, v, causal=True, window=(20, -1), key_padding_mask=keep).float().square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if INTERPRET else "inductor")
    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    again = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(eager, again):
        assert torch.equal(a, b), f"seed {seed}"


@pytest.mark.skipif(INTERPRET, reason="the public API takes the kernels on CUDA only")
def test_the_bthd_layout_runs_in_the_kernels_without_a_copy():
    B, T, H, D = 2, 77, 3, 64
    q, k, v = (torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    ours = flash_attention(q, k, v, layout="bthd", backend="triton")
    again = flash_attention(*(t.transpose(1, 2) for t in (q, k, v)), backend="triton").transpose(1, 2)
    assert ours.shape == q.shape and ours.is_contiguous() and torch.equal(ours, again)


@pytest.mark.parametrize("precision", ["fa2", "paper"])
def test_sfa_error_is_no_larger_than_the_plain_kernels(precision):
    # random rows still hold a few near-ties (bf16 scores especially), which SFA shifts: the max error can move
    # by an ulp either way (it once did by 1.24x), so compare the norm error. Its ratio SFA/plain under `paper`,
    # 40 fresh draws under the interpreter: median 1.002-1.003, max 1.009; one test run drew 1.016. SFA removes
    # a bias on tied rows (the next test); on random rows it costs ~0.3% of error. Hence 3%.
    q, k, v = _inputs(SHAPES[-1])
    exact = _fp64(q, k, v, True)[0](None, None, None).detach()
    plain = _attention(q, k, v, precision=precision)
    sfa = _attention(q, k, v, precision=precision, stabilize=SFA())
    assert rel_err(sfa.detach().cpu(), exact) <= 1.03 * rel_err(plain.detach().cpu(), exact)


@pytest.mark.parametrize("precision,magnitude", [("paper-eager", 2.0), ("paper-eager", 8.0), ("paper", 8.0)])
def test_sfa_removes_most_of_the_bias_on_tied_maxima(precision, magnitude):
    # with ties SFA trades the biased rounding of P̄ = 1 for unbiased rounding of every entry:
    # the mean signed error shrinks; the spread does not (the reference behaves the same way). Under the
    # compiled `paper` numerics (fp32 accumulator) at magnitude 2 the mean error is not SFA's to remove: it
    # keeps 87% of it (the reference's figure), so that case is not asserted.
    q, k, v = (t.to(DEVICE) for t in tied_inputs(4, T=128, D=64, heads=2, magnitude=magnitude))
    exact = flash_attention(*(t.cpu().double() for t in (q, k, v)), causal=False, precision="fp64", backend="reference")
    bias = {}
    for stabilize in (None, SFA()):
        ours = _attention(q, k, v, causal=False, precision=precision, stabilize=stabilize)
        ref = flash_attention(q, k, v, causal=False, precision=precision, stabilize=stabilize, backend="reference")
        assert _max_err(ours, exact) <= 2 * _max_err(ref, exact) + 1e-6
        bias[stabilize is None] = (ours.cpu().double() - exact).mean().item()
    assert abs(bias[False]) < 0.6 * abs(bias[True]), bias


def _assert_finite_on_large_logits(head_dim=64, dtype=torch.bfloat16, **kw):
    """Outputs and gradients finite on scores of ~1e4 with ties and, where the dtype holds them (bf16), ~1e10 (all
    keys equal) and 2e11 to 8e11."""
    cases = []
    if dtype == torch.bfloat16:
        cases.append((torch.full((1, 2, 64, head_dim), 133120.0, dtype=dtype), {}))
        # scores 2e11 to 8e11, one maximum per row, non-causal so that 64-key tiles need no mask: there Triton had
        # contracted the forward's exp2(fl(qk * scale) - m) into exp2(fma(qk, scale, -m)), which overflows (NaN)
        rows = (2.0 ** 17 * (1 + torch.arange(64) / 64)).to(dtype)
        cases.append((rows[None, None, :, None].expand(1, 2, 64, head_dim).contiguous(), {"causal": False}))
    g = torch.Generator().manual_seed(1)
    cases.append(((torch.randn(1, 2, 96, head_dim, generator=g) * 12).round().to(dtype), {}))  # ~1e4, with ties
    for q, case_kw in cases:
        q = q.to(DEVICE).requires_grad_()
        out = _attention(q, q, q, **{**kw, **case_kw})
        out.float().sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(q.grad).all(), case_kw


@pytest.mark.parametrize("precision", ["fa2", "paper", "bf16"])
@pytest.mark.parametrize("stabilize", [None, SFA(), ClampPbar()])
def test_large_logits_give_no_nan(precision, stabilize):
    _assert_finite_on_large_logits(precision=precision, stabilize=stabilize)


def test_rows_with_no_visible_key_give_zero_and_zero_gradients():
    q, k, v = _inputs((1, 1, 70, 16 if INTERPRET else 64), seed=3)
    with torch.no_grad():
        q[0, 0, 5] = 1.0
        k[0, 0, :] = k[0, 0, :].abs() + 1.0
        k[0, 0, 40:] = -math.inf  # row 5 (causal) still sees keys 0..5; no row sees 40..
        q[0, 0, 7] = -1.0  # row 7: every visible score is -inf... only if all keys are -inf for it
    ours = _attention(q, k, v, causal=True)
    ref = flash_attention(q, k, v, causal=True, precision="fa2", backend="reference")
    both_nan = torch.isnan(ours) & torch.isnan(ref)
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    assert _max_err(torch.where(both_nan, 0, ours), torch.where(both_nan, 0, ref)) < 5e-2


@pytest.mark.parametrize("T,causal", [(128, False), (100, True)])  # whole tiles; a ragged last tile
def test_stats_match_the_reference_and_count_ties(T, causal):
    q, k, v = (t.to(DEVICE) for t in tied_inputs(3, T=T, D=64, heads=2))
    for precision in ("paper", "fa2"):
        ours, ref = AttentionStats(2), AttentionStats(2)
        _attention(q, k, v, causal=causal, precision=precision, stats=ours)
        flash_attention(q, k, v, causal=causal, precision=precision, backend="reference", stats=ref)
        assert ours.counts.tolist() == ref.counts.tolist(), precision  # every column (`stats.STAT_COLUMNS`)
        if not causal:  # every row repeats a positive maximum
            assert ours.repeated_max_rows.tolist() == ours.repeated_max_rows_positive.tolist() == [T, T]
        if precision == "fa2":  # P̄V in fp32: no row is biasable
            assert ours.biasable_rows.tolist() == [0, 0]
        assert torch.allclose(ours.max_score.cpu(), ref.max_score.cpu(), rtol=1e-2)
    sfa, sfa_ref = AttentionStats(2), AttentionStats(2)
    _attention(q, k, v, causal=causal, precision="paper", stabilize=SFA(), stats=sfa)
    flash_attention(q, k, v, causal=causal, precision="paper", stabilize=SFA(), backend="reference", stats=sfa_ref)
    # SFA leaves P̄ = 1 only where the maximum is not repeated (causal: the first row's single key)
    assert sfa.pbar_ones.tolist() == sfa_ref.pbar_ones.tolist() == ([1, 1] if causal else [0, 0])


@pytest.mark.parametrize("tiles", [512, 64], ids=["the official tiles", "several tiles per row"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("precision", ["paper", "fa2"])
def test_the_official_sfa_rule_is_the_references_bit_for_bit(precision, causal, tiles):
    """`SFA.official()` in the emulation kernels (under fa2's numerics too): its near-maximum test, and tiles no row of
    the query tile sees visited (m = max(m, 0) there), on random rows (some with a negative maximum) and on tied ones,
    at odd lengths; outputs and gradients bit for bit with the reference, and the statistics' counts equal.

    Tied rows' gradients are sums that cancel (every query, or every key, a multiple of one vector), so the kernel's
    and torch's summation orders show in their last bits more often than on random rows: over 40 draws of dO on an
    H100 their dK matched in 75.6-100% of entries, where random rows' gradients matched in >= 98%
    (`results/emulation-agreement/`). Without the rule, tied rows' gradients fall below their bar of 60%
    (`test_the_tied_rows_bar_tells_a_missing_rule`), so it still tells a wrong rule from a different order."""
    policy = resolve(precision).replace(block_m=tiles, block_n=tiles)
    official = SFA.official()
    tied = [tuple(t.to(DEVICE).requires_grad_() for t in make(3, T=77, D=64, heads=2))
            for make in (tied_inputs, tied_below_zero_inputs)]
    random_rows = _inputs((1, 2, 130 if INTERPRET else 1100, 64))
    for inputs in (random_rows, *tied):
        dout = torch.randn(inputs[0].shape, device=DEVICE).to(torch.bfloat16)
        stats, ref_stats = AttentionStats(2), AttentionStats(2)
        ours = _run(functools.partial(_attention, causal=causal, precision=policy, stabilize=official, stats=stats),
                    *inputs, dout)
        ref = _run(functools.partial(flash_attention, causal=causal, precision=policy, stabilize=official,
                                     backend="reference", stats=ref_stats), *inputs, dout)
        gradient_bar = 0.80 if inputs is random_rows else 0.60
        for what, a, r in zip(["out", "dq", "dk", "dv"], ours, ref):
            equal = (a == r).float().mean().item()
            assert equal >= (0.95 if what == "out" else gradient_bar), (what, equal, inputs is random_rows)
        assert stats.counts.tolist() == ref_stats.counts.tolist()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("precision", ["paper", "fa2"])
def test_the_tied_rows_bar_tells_a_missing_rule(precision, causal):
    """The kernels without SFA against the reference with its official rule, on the tied rows of
    `test_the_official_sfa_rule_is_the_references_bit_for_bit`: dQ and dK each match in under its 60% bar."""
    policy = resolve(precision).replace(block_m=64, block_n=64)
    for make in (tied_inputs, tied_below_zero_inputs):
        inputs = tuple(t.to(DEVICE).requires_grad_() for t in make(3, T=77, D=64, heads=2))
        dout = torch.randn(inputs[0].shape, device=DEVICE).to(torch.bfloat16)
        ours = _run(functools.partial(_attention, causal=causal, precision=policy, stabilize=None), *inputs, dout)
        ref = _run(functools.partial(flash_attention, causal=causal, precision=policy, stabilize=SFA.official(),
                                     backend="reference"), *inputs, dout)
        for what, a, r in list(zip(["out", "dq", "dk", "dv"], ours, ref))[1:3]:
            assert (a == r).float().mean().item() < 0.60, (make.__name__, what)


@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_v_and_its_product_in_a_narrow_format_are_the_references(bits, mode):
    """The bias-against-noise study's arms: V as P̄V reads it and P̄V in e8mN, P̄V rounded to nearest (arm B) or
    stochastically (arm C); outputs, gradients and the statistics (biasable rows among them) as the reference's."""
    fmt = f"e8m{bits}"
    policy = PRESETS["paper"].with_sites(v_operand=fmt, pv=fmt)
    policy = policy if mode == "nearest" else policy.with_rounding("stochastic", ("pv",))
    q, k, v = (t.to(DEVICE).requires_grad_() for t in tied_inputs(2, T=77, D=64, heads=2))
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    stats, ref_stats = AttentionStats(2), AttentionStats(2)
    torch.manual_seed(3)
    ours = _run(functools.partial(_attention, causal=False, precision=policy, stats=stats), q, k, v, dout)
    torch.manual_seed(3)
    ref = _run(functools.partial(flash_attention, causal=False, precision=policy, backend="reference",
                                 stats=ref_stats), q, k, v, dout)
    for what, a, r in zip(["out", "dq", "dk", "dv"], ours, ref):
        equal = (a == r).float().mean().item()
        assert equal >= (0.95 if what == "out" else 0.80), (what, equal)
    assert stats.counts.tolist() == ref_stats.counts.tolist()
    assert min(stats.biasable_rows.tolist()) > 0


def test_stats_accumulate_over_calls_and_on_overridden_heads():
    """A second call doubles every count and keeps the maxima; a per-head override runs each group of heads on its
    own, and each head's counts are those of the same head run alone."""
    q, k, v = (t.to(DEVICE) for t in tied_inputs(3, T=100, D=64, heads=3))
    stats, ref = AttentionStats(3), AttentionStats(3)
    flash_attention(q, k, v, precision="fa2", backend="reference", stats=ref)
    for calls in (1, 2):
        _attention(q, k, v, precision="fa2", stats=stats)
        assert stats.counts.tolist() == (ref.counts * calls).tolist() and stats.rows.tolist() == [100 * calls] * 3
        assert torch.allclose(stats.max_score.cpu(), ref.max_score.cpu(), rtol=1e-2)
    # a length no other test uses is autotuned here on the GPU: its trial runs must leave the counts as they were
    shorter, ref_short = [t[:, :, :91].contiguous() for t in (q, k, v)], AttentionStats(3)
    flash_attention(*shorter, precision="fa2", backend="reference", stats=ref_short)
    _attention(*shorter, precision="fa2", stats=stats)
    assert stats.counts.tolist() == (2 * ref.counts + ref_short.counts).tolist()
    mixed, alone = AttentionStats(3), [AttentionStats(1) for _ in range(3)]
    _attention(q, k, v, precision=resolve("paper").with_heads([0, 2], "fa2"), stats=mixed)
    for h, precision in enumerate(("fa2", "paper", "fa2")):
        _attention(*(t[:, h:h + 1].contiguous() for t in (q, k, v)), precision=precision, stats=alone[h])
    assert mixed.counts.tolist() == [s.counts[0].tolist() for s in alone]
    assert mixed.max_score.tolist() == [s.max_score.item() for s in alone]


def _copied_key_inputs(D, batch: int = 2):
    """(batch, 3, 200, D) random inputs whose keys 150..169 copy keys 20..39 (ties across 64-key tiles for the rows
    whose maximum is among those) and 56..63 copy 48..55 (ties within the first tile)."""
    q, k, v = (t.detach() for t in _inputs((batch, 3, 200, D)))
    k[:, :, 150:170] = k[:, :, 20:40]
    k[:, :, 56:64] = k[:, :, 48:56]
    return q, k, v


def _fixed_tile(monkeypatch, tma: bool = False):
    """Launch the native kernels with one 64x64 tile (pointer or TMA loads) instead of autotuning."""
    from stableflash.attention.triton import launch, tuning

    def run_tuned(tunable, grid, args, meta, **_):
        launch._launch(tunable.kernel, grid, args, {**meta, "TMA": tma}, tuning.config(64, 64, 4, 2))

    monkeypatch.setattr(launch, "_launch_tuned", run_tuned)
    if tma:
        launch._allow_device_descriptors()
    return launch


@pytest.mark.parametrize("causal", [True, False])
def test_pbar_one_counts_on_random_rows_match_the_reference_with_the_same_tiles(causal, monkeypatch):
    """P̄ = 1 entries of random rows: each row's maximum wherever a key tile raises the running maximum, plus near-ties.
    The kernel counts per score only on tiles where some row's second largest score is near the maximum (one exp2
    per row elsewhere); with copied keys some tiles take each branch. Counts depend on the key tiles, so the kernel
    runs 64-key tiles and the reference the `fa2` preset with 64-key tiles."""
    from stableflash.attention.triton.spec import spec_name

    launch = _fixed_tile(monkeypatch)
    D = 16 if INTERPRET else 64
    q, k, v = _copied_key_inputs(D, batch=1 if INTERPRET else 2)  # one batch row: the interpreter is slow
    name = spec_name(resolve("fa2"), None, torch.bfloat16, D, 200)
    with kernel_options(hopper_forward=False):
        _, _, _, counts, _ = launch.forward(q, k, v, causal, D**-0.5, name, True, 1e-3)
    ref = AttentionStats(3)
    flash_attention(q, k, v, causal=causal, precision=resolve("fa2").replace(block_m=64, block_n=64),
                    backend="reference", stats=ref)
    assert counts[:, STAT_COLUMNS.index("pbar_ones")].tolist() == ref.pbar_ones.tolist()
    assert min(ref.pbar_ones.tolist()) > q.shape[0] * 200  # at least one per row (its first maximum), and ties on top


@pytest.mark.parametrize("causal", [True, False])
def test_tma_loads_give_the_pointer_loads_bits(causal, monkeypatch):
    """TMA only changes how the streamed tiles reach shared memory (K and V in the forward and dQ kernels, Q and dO
    in dK/dV's): outputs, statistics and gradients bit for bit, with and without SFA, on a ragged T (descriptors
    read rows past T as 0) and on a model's strided heads."""
    from stableflash.attention.triton.spec import spec_name

    D = 16 if INTERPRET else 64
    q, k, v = _copied_key_inputs(D, batch=1 if INTERPRET else 2)
    B, T, H = 2, 77, 3  # the backward on a model's heads: (B, T, H, D) memory viewed as (B, H, T, D)
    qkv, dout = (torch.randn(B, T, n * H * D).to(torch.bfloat16).to(DEVICE) for n in (3, 1))
    hq, hk, hv = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
    dout = dout.view(B, T, H, D).transpose(1, 2)
    results = []
    for tma in (False, True):
        with monkeypatch.context() as patch, kernel_options(hopper_forward=False):
            launch = _fixed_tile(patch, tma)
            run = []
            for stabilize, stats in ((None, False), (SFA(), True)):
                name = spec_name(resolve("fa2"), stabilize, torch.bfloat16, D, 200)
                run += launch.forward(q, k, v, causal, D**-0.5, name, stats, SFA().eps)
            name = spec_name(resolve("fa2"), None, torch.bfloat16, D, T)
            out, _, lse, _, _ = launch.forward(hq, hk, hv, causal, D**-0.5, name, False, 0.0)
            run += launch.backward(dout, hq, hk, hv, out, lse, causal, D**-0.5, name)
            gk, gv = hk[:, :1], hv[:, :1]  # grouped: the dK/dV program reads its three query heads by one descriptor
            out, _, lse, _, _ = launch.forward(hq, gk, gv, causal, D**-0.5, name, False, 0.0)
            run += launch.backward(dout, hq, gk, gv, out, lse, causal, D**-0.5, name)
            results.append(run)
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"output {i}"
    assert results[0][-3].abs().sum() > 0


def test_per_head_override_and_strided_inputs():
    B, T, H, D = 2, 77, 3, (16 if INTERPRET else 64)
    qkv = torch.randn(B, T, 3 * H * D).to(torch.bfloat16).to(DEVICE)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))  # strided, as in GPT
    policy = resolve("paper").with_heads([1], "fa2")
    ours = _attention(q, k, v, precision=policy)
    contiguous = _attention(q.contiguous(), k.contiguous(), v.contiguous(), precision=policy)
    assert torch.equal(ours, contiguous)
    head1 = _attention(q[:, 1:2].contiguous(), k[:, 1:2].contiguous(), v[:, 1:2].contiguous(), precision="fa2")
    assert torch.equal(ours[:, 1:2].float(), head1.float())


def _launched(monkeypatch) -> list:
    """The kernels launched with a fixed tile from now on (`launch._launch`: picks, emulation, the Gluon forward)."""
    from stableflash.attention.triton import launch

    kernels, run = [], launch._launch
    monkeypatch.setattr(launch, "_launch", lambda kernel, *a: kernels.append(kernel) or run(kernel, *a))
    return kernels


@pytest.mark.skipif(INTERPRET, reason="the load path is chosen by the GPU's autotuner")
def test_head_dim_128_tunes_the_load_path_and_misaligned_heads_keep_pointers():
    """At D = 128 the native kernels' autotuner also tries TMA loads, which need 16-byte aligned rows: heads at an
    aligned address are tuned over both ("either"), heads 2 bytes off over pointer loads only; both give the same
    attention (within a tile's rounding: each path autotunes its own tile)."""
    from stableflash.attention.triton import launch
    from stableflash.attention.triton.spec import spec_name
    from stableflash.attention.triton.tuning import TILE_PICKS

    B, H, T, D = 2, 3, 333, 128
    aligned = [torch.randn(B, H, T, D).to(torch.bfloat16).to(DEVICE) for _ in range(4)]
    shifted = []  # the same values, stored 2 bytes past a 16-byte boundary
    for t in aligned:
        storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=DEVICE)
        shifted.append(storage[1:].view(B, H, T, D).copy_(t))
    assert launch.tma_streamable(*aligned) and not launch.tma_streamable(*shifted)
    results = []
    saved = TILE_PICKS.state_dict()
    try:
        for q, k, v, dout in (aligned, shifted):
            TILE_PICKS.clear()
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            results.append(_run(functools.partial(_attention, precision="fa2"), q, k, v, dout))
            picks = {key[0]: (key[1], config) for key, config in TILE_PICKS.items()}
            # on sm_90 aligned heads may run the Gluon forward (TMA only), which the autotuner does not tile
            spec = launch.spec_named(spec_name(resolve("fa2"), None, torch.bfloat16, D, T))
            gluon = launch.hopper_forward_tile(spec, q, k, v, False) is not None
            assert ("attn_fwd" in picks) != gluon and {"attn_bwd_dq", "attn_bwd_dkdv"} <= set(picks)
            candidates = "either" if q.data_ptr() % 16 == 0 else "pointers"
            assert all(c == candidates and (c == "either" or not config.kwargs["TMA"]) for c, config in picks.values())
    finally:
        TILE_PICKS.clear()
        TILE_PICKS.load_state_dict(saved)
    for name, a, b in zip(["out", "dq", "dk", "dv"], *results):
        assert torch.isfinite(b).all() and rel_err(b.float().cpu(), a.float().cpu()) < 1e-2, name


def _hopper_or_skip():
    from stableflash.attention.triton import launch

    if launch.hopper is None or not launch._is_hopper(torch.cuda.current_device()):
        pytest.skip("the Gluon forward runs on sm_90 GPUs only")
    return launch


@pytest.mark.skipif(INTERPRET, reason="the Gluon forward runs on sm_90 GPUs only")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gluon_forward_on_hopper_matches_the_reference_at_its_tiles(D, causal, dtype, monkeypatch):
    """On sm_90 the native forward is the Gluon kernel where `hopper.FORWARD_TILES` has a tile (`fa2` plain at D = 64
    and 128, SFA and the statistics at 128), here from any length (the table's lengths are where it measured faster):
    outputs and gradients (the Triton backward reads its log-sum-exp) within twice the reference's error against
    fp64, and the statistics equal to the reference's, whose `fa2` tiles are 128x128 as the Gluon kernel's at D = 128
    (SFA's shift and the counts are per key tile). Keys 3 and 5 are one large key, so most rows repeat their
    maximum. The Triton forward (`hopper_forward=False`) agrees within rounding. Huge logits give no NaN."""
    from stableflash.attention.triton import hopper
    from stableflash.attention.triton.spec import spec_name

    launch = _hopper_or_skip()
    monkeypatch.setattr(hopper, "FORWARD_TILES", {key: choice and choice._replace(min_seq_len=1)
                                                  for key, choice in hopper.FORWARD_TILES.items()})
    q, k, v = _inputs((2, 3, 333, D), dtype)
    with torch.no_grad():
        k[:, :, 3] = k[:, :, 5] = 4 * q.mean(dim=2)
    dout = torch.randn_like(q)
    for stabilize, stats in ((None, None), (SFA(), AttentionStats(3, eps=SFA().eps))):
        spec = launch.spec_named(spec_name(resolve("fa2"), stabilize, dtype, D, 333))
        tile = launch.hopper_forward_tile(spec, q, k, v, stats is not None)
        gluon = tile is not None
        assert gluon or (D == 64 and stabilize is not None)  # the table as measured: SFA at D = 64 stays in Triton
        with monkeypatch.context() as patch:
            launched = _launched(patch)
            ours = _run(functools.partial(_attention, causal=causal, stabilize=stabilize, stats=stats), q, k, v, dout)
        assert (hopper._attn_fwd in launched) == gluon
        ref_stats = AttentionStats(3, eps=stats.eps) if stats else None
        ref = _run(functools.partial(flash_attention, causal=causal, precision="fa2", stabilize=stabilize,
                                     backend="reference", stats=ref_stats), q, k, v, dout)
        exact_fn, leaves = _fp64(q, k, v, causal)
        exact = _run(exact_fn, *leaves, dout.cpu().double())
        for name, a, b, c in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
            _assert_within_twice_the_reference(name, a, b, c, dtype)
        if stats is not None and gluon:  # at the reference's tiles: the same rows, P̄ = 1 entries and maxima
            assert stats.rows.tolist() == ref_stats.rows.tolist() == [2 * 333] * 3  # counted by the kernel
            assert stats.repeated_max_rows.tolist() == ref_stats.repeated_max_rows.tolist()
            assert stats.pbar_ones.tolist() == ref_stats.pbar_ones.tolist() and stats.pbar_ones.sum() > 0
            assert torch.allclose(stats.max_score.cpu(), ref_stats.max_score.cpu(), rtol=1e-2)
        with kernel_options(hopper_forward=False):
            triton_forward = _run(functools.partial(_attention, causal=causal, stabilize=stabilize), q, k, v, dout)
        for name, a, b in zip(["out", "dq", "dk", "dv"], ours, triton_forward):
            assert rel_err(a.float().cpu(), b.float().cpu()) < 1e-2, name
        _assert_finite_on_large_logits(D, dtype, causal=causal, stabilize=stabilize)


@pytest.mark.skipif(INTERPRET, reason="the Gluon forward runs on sm_90 GPUs only")
@pytest.mark.parametrize("D", [64, 128])
def test_the_gluon_forward_reads_each_key_value_head_for_its_group(D, monkeypatch):
    """Grouped-query attention (k and v of H / 4 heads) runs the Gluon forward too, reading each group's key/value
    head in place: outputs and gradients within twice the reference's error against fp64, with and without SFA."""
    from stableflash.attention.triton import hopper

    _hopper_or_skip()
    monkeypatch.setattr(hopper, "FORWARD_TILES", {key: choice and choice._replace(min_seq_len=1)
                                                  for key, choice in hopper.FORWARD_TILES.items()})
    B, H, T = 2, 8, 333
    seed, _, q, k, v, dout = _grouped_inputs(B, H, T, T, D, 4)
    exact_fn, leaves = _fp64(q, k, v, True)
    exact = _run(exact_fn, *leaves, dout.cpu().double())
    for stabilize in (None, SFA()):
        if hopper.FORWARD_TILES.get((D, stabilize is not None)) is None:
            continue
        with monkeypatch.context() as patch:
            launched = _launched(patch)
            ours = _run(functools.partial(_attention, stabilize=stabilize), q, k, v, dout)
        assert hopper._attn_fwd in launched, f"seed {seed}"
        ref = _run(functools.partial(flash_attention, precision="fa2", stabilize=stabilize, backend="reference"),
                   q, k, v, dout)
        for name, a, r, e in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
            _assert_within_twice_the_reference(name, a, r, e, torch.bfloat16)


@pytest.mark.parametrize("precision", ["fa2", "paper"])
def test_outputs_and_gradients_follow_the_inputs_memory_order(precision):
    """Heads viewed out of (B, T, H·D) activations get O and dQ/dK/dV back in that memory order (so the model's
    transpose back is free), with the values contiguous inputs give."""
    B, T, H, D = 2, 77, 3, (16 if INTERPRET else 64)
    qkv = torch.randn(B, T, 3 * H * D).to(torch.bfloat16).to(DEVICE)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2).requires_grad_() for t in qkv.split(H * D, dim=2))
    dout = torch.randn(B, T, H, D).to(torch.bfloat16).to(DEVICE).transpose(1, 2)  # as the model's grad arrives
    fn = functools.partial(_attention, precision=precision)
    strided = _run(fn, q, k, v, dout)
    contiguous = _run(fn, *(t.detach().contiguous().requires_grad_() for t in (q, k, v)), dout.contiguous())
    for name, a, b in zip(["out", "dq", "dk", "dv"], strided, contiguous):
        assert a.transpose(1, 2).is_contiguous() and b.is_contiguous(), name
        assert torch.equal(a, b), name


def test_repeated_calls_follow_new_inputs_and_reuse_their_tiles():
    """Calls of one shape after another take the tile picked for it (no new pick) and compute on their own inputs."""
    from stableflash.attention.triton.tuning import TILE_PICKS

    D = 16 if INTERPRET else 64
    sizes = []
    for T in (300, 301, 300, 300):
        q, k, v = _inputs((2, 3, T, D))
        dout = torch.randn_like(q)
        got = _run(_attention, q, k, v, dout)
        fn, leaves = _fp64(q, k, v, causal=True)
        want = _run(fn, *leaves, dout.cpu().double())
        for a, b in zip(got, want):
            assert rel_err(a.cpu(), b) < 1e-2
        sizes.append(len(TILE_PICKS))
    assert sizes[2] == sizes[3] == sizes[1], "the same shape again must not add picks"


def test_unsupported_arguments_name_the_argument():
    from stableflash.attention.triton.spec import spec_name

    with pytest.raises(ValueError, match=r"q: the triton kernels compile head dims \(16, 32, 64, 128, 256\)"):
        spec_name(resolve("fa2"), None, torch.bfloat16, 48, 8)
    with pytest.raises(ValueError, match="delta_formula"):
        spec_name(resolve("paper").with_delta("do_o_recomputed"), None, torch.bfloat16, 32, 8)


@pytest.mark.parametrize("layout,precision,D", [("contiguous", "paper", 64), ("model heads", "paper", 64),
                                                ("model heads", "fa2", 64), ("model heads", "fa2", 128)])
def test_ops_trace_without_graph_breaks(layout, precision, D):
    """torch.compile(fullgraph=True) through the ops: the same kernels and tiles as eagerly, so the same bits; and the
    ops pass `torch.library.opcheck` (schema, autograd registration, fake tensors, AOT dispatch). At D = 128 the
    native kernels' candidate tiles include TMA loads (device-side descriptors, whose scratch the launch provides)."""
    from stableflash.attention.triton import ops
    from stableflash.attention.triton.spec import spec_name

    if INTERPRET and precision == "fa2":
        pytest.skip("one precision suffices under the interpreter")
    torch._dynamo.reset()
    q, k, v = _inputs((2, 3, 200, D))
    if layout == "model heads":  # views of one (B, T, 3·H·D) tensor, as GPT makes them: outputs come back strided
        qkv = torch.cat([t.detach().transpose(1, 2).reshape(2, 200, 3 * D) for t in (q, k, v)], dim=2)
        q, k, v = (t.view(2, 200, 3, D).transpose(1, 2).requires_grad_() for t in qkv.split(3 * D, dim=2))
    key = spec_name(resolve(precision), SFA(), torch.bfloat16, D, 200)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.flash_fwd, (q, k, v, None, key, ops.Call(True, 0.125, 1e-3).encode()),
                          test_utils=checks)

    sfa = SFA()  # policies and stabilizers are built outside compiled code, as the model does

    def f(q, k, v):
        return _attention(q, k, v, stabilize=sfa, precision=precision).float().square().sum()

    # on the CPU (interpreter) inductor would need a C++ toolchain: trace with aot_eager there
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if INTERPRET else "inductor")
    eager_grads = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled_grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(eager_grads, compiled_grads):
        assert torch.equal(a, b)


# Padding inside the kernels and by hand give the same bits at the same tiles and kernels. Autotuned, the two calls
# are timed apart (D_IN is in the tuning key) and may pick other tiles, which sum in another order; the Gluon forward
# takes unpadded calls only. So these comparisons launch untuned, at each kernel's first candidate tile, with no tile
# picks: an earlier test in the same process may have tuned the call padded by hand (its key has no D_IN), and its
# pick would launch for that call alone. At D = 40 the inputs' strides (40, 160, ...) are not divisible by 16, which
# Triton's layouts follow: the launch states them multiples of 8 (`STRIDE8`), so the padded kernels lay out and sum
# as the full head dim's (research/tests/test_kernel_compile.py checks that on the compiled kernels).
@contextlib.contextmanager
def _same_tiles(**options):
    with no_tile_picks(), kernel_options(autotune=False, hopper_forward=False, **options):
        yield


def test_the_padded_comparisons_launch_with_no_tile_pick():
    """A pick that an earlier test recorded for the call padded by hand (the masked tests tune that very launch at
    Tq = 45, D = 128) is not launched inside `_same_tiles`, and is there again after it."""
    from stableflash.attention.triton import options
    from stableflash.attention.triton.tuning import NATIVE_FWD, TILE_PICKS

    pick = {"key": [NATIVE_FWD.name, "either", 45, "torch.bfloat16", ["HEAD_DIM", 128], ["MASK", True]],
            "kwargs": {"BLOCK_M": 128, "BLOCK_N": 64}, "num_warps": 8, "num_stages": 2}
    with no_tile_picks():
        TILE_PICKS.load_state_dict([pick])
        with _same_tiles():
            assert len(TILE_PICKS) == 0 and not options.current().autotune
        assert TILE_PICKS.state_dict() == [pick]


NARROW_HEADS = {  # head dim, kernels' width: padded to the next of `HEAD_DIMS`
    "D 8": (8, 16), "D 24": (24, 32), "D 40, GQA": (40, 64), "D 200, GQA": (200, 256),
} if INTERPRET else {"D 80": (80, 128), "D 96, GQA": (96, 128), "D 40": (40, 64), "D 160, GQA": (160, 256)}


@pytest.mark.parametrize("stabilize", [None, SFA()], ids=["plain", "sfa"])
@pytest.mark.parametrize("heads", list(NARROW_HEADS))
def test_head_dims_between_the_kernels_run_zero_padded_and_exact(heads, stabilize):
    """A head dim the kernels are not compiled for runs at the next one, padded inside the kernels: the same
    bits as a call on inputs padded by hand (zero columns change no kept value), outputs and gradients in the inputs'
    memory order and within twice the reference's error against fp64; the statistics count as at the padded width."""
    from stableflash.attention import triton as backend

    D, width = NARROW_HEADS[heads]
    kv_heads = 2 if "GQA" in heads else 4
    seed = fresh_seed()
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    # a model's heads: (B, T, H, D) in memory, viewed as (B, H, T, D)
    q = torch.randn(2, 45, 4, D, generator=g).to(torch.bfloat16).to(DEVICE).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 45, kv_heads, D, generator=g).to(torch.bfloat16).to(DEVICE).transpose(1, 2)
            .requires_grad_() for _ in range(2))
    dout = torch.randn(2, 4, 45, D, generator=g).to(torch.bfloat16).to(DEVICE)
    assert backend.supports(q) and backend.kernel_head_dim(D) == width
    stats, padded_stats = (AttentionStats(4, eps=SFA().eps) for _ in range(2))
    kw = dict(causal=True, scale=D**-0.5, policy=resolve("fa2"), stabilize=stabilize)

    def by_hand(q, k, v):
        wide = [torch.nn.functional.pad(t, (0, width - D)) for t in (q, k, v)]
        return backend.attention(*wide, stats=padded_stats, **kw)[..., :D]

    with _same_tiles():
        ours = _run(lambda q, k, v: backend.attention(q, k, v, stats=stats, **kw), q, k, v, dout)
        theirs = _run(by_hand, q, k, v, dout)
    assert ours[0].transpose(1, 2).is_contiguous() and ours[1].transpose(1, 2).is_contiguous()
    for name, a, b in zip(["out", "dq", "dk", "dv"], ours, theirs):
        assert torch.equal(a, b), (name, f"seed {seed}")
    assert torch.equal(stats.repeated_max_rows, padded_stats.repeated_max_rows), f"seed {seed}"
    _assert_within_twice_the_references_error_against_fp64(ours, q, k, v, dout, seed, stabilize, causal=True)


def test_stride8_is_stated_where_every_row_stride_is_a_multiple_of_8_and_triton_cannot_see_it():
    """`STRIDE8` tells a padded launch's kernels what Triton's specialisation (divisibility by 16) misses: every row
    stride, the outputs' included (laid out from the head dim), a multiple of 8. Never where one is not, and a call
    there still matches fp64 as well as the reference does."""
    from stableflash.attention import triton as backend
    from stableflash.attention.triton import launch

    def heads(rows: int, d: int = 40):  # a model's (B, T, H, rows) activations, heads of d columns viewed out
        return torch.randn(2, 45, 4, rows)[..., :d].transpose(1, 2)

    assert launch._head_dims(heads(40), heads(40)) == (64, {"D_IN": 40, "STRIDE8": True})
    assert launch._head_dims(heads(48), heads(48)) == (64, {"D_IN": 40, "STRIDE8": True})  # the outputs' 40
    assert launch._head_dims(heads(40), heads(44)) == (64, {"D_IN": 40})
    assert launch._head_dims(heads(36, 36)) == (64, {"D_IN": 36})
    assert launch._head_dims(heads(80, 80)) == (128, {"D_IN": 80})  # 16 divides every stride: Triton sees it
    assert launch._head_dims(heads(64, 64)) == (64, {})

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 37, 2, 44, generator=g).to(torch.bfloat16).to(DEVICE)[..., :40].transpose(1, 2)
               .requires_grad_() for _ in range(3))
    dout = torch.randn(1, 2, 37, 40, generator=g).to(torch.bfloat16).to(DEVICE)
    ours = _run(lambda q, k, v: backend.attention(q, k, v, causal=True, scale=40**-0.5, policy=resolve("fa2")),
                q, k, v, dout)
    _assert_within_twice_the_references_error_against_fp64(ours, q, k, v, dout, seed, None, causal=True)


@pytest.mark.parametrize("precision", ["fa2", "paper"])
def test_a_padded_head_dim_saves_no_padded_copy(precision):
    """The kernels pad a head dim inside themselves, the native and the emulation kernels alike: what the forward
    saves for the backward has the inputs' head dim, never the padded one, and the bits are padding by hand's."""
    from stableflash.attention import triton as backend

    D, width = (24, 32) if INTERPRET else (80, 128)
    q, k, v = _inputs((1, 2, 40, D))
    dout = torch.randn_like(q)
    widths = []

    def note(t):
        widths.append(t.shape[-1] if t.dim() == 4 else None)
        return t

    kw = dict(causal=True, scale=D**-0.5, policy=resolve(precision))

    def by_hand(q, k, v):
        return backend.attention(*(torch.nn.functional.pad(t, (0, width - D)) for t in (q, k, v)), **kw)[..., :D]

    with _same_tiles():
        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            out = backend.attention(q, k, v, **kw)
        assert D in widths and width not in widths, widths
        ours = torch.autograd.grad(out, (q, k, v), dout)
        wide = by_hand(q, k, v)
        theirs = torch.autograd.grad(wide, (q, k, v), dout)
    for name, a, b in zip(["out", "dq", "dk", "dv"], (out, *ours), (wide, *theirs)):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("draw", range(6))
def test_padding_inside_the_kernels_gives_padding_by_hands_bits_with_every_feature(draw):
    """Random calls at a head dim between the compiled ones, each feature drawn: production or emulated numerics,
    Tq != Tk, windows, key padding, packed sequences, GQA (summed in the program or after), dQ by atomics, softcap,
    SFA, statistics. The kernels padding inside themselves give the bits of the same call on inputs padded by hand,
    outputs and gradients, and the same statistics. The seed is printed and named in each failure."""
    from stableflash.attention import triton as backend
    from stableflash.attention.triton import launch

    seed = fresh_seed()
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    D, width = pick([(8, 16), (24, 32), (40, 64)] if INTERPRET else [(80, 128), (96, 128), (40, 64), (160, 256)])
    H, H_kv = pick([(4, 4), (4, 2), (4, 1)])
    precision = pick(["fa2", "fa2", "paper", "bf16"])  # packing and softcap: production numerics only
    packed = precision == "fa2" and pick([False, True])
    B = 1 if packed else pick([1, 2])
    Tq, Tk = (37, 37) if packed else (pick([17, 45, 70]), pick([17, 45, 70]))
    causal, window = pick([True, False]), pick([(-1, -1), (12, -1), (9, 4)])
    stabilize, softcap = pick([None, SFA()]), pick([0.0, 0.0, 9.0]) if precision == "fa2" else 0.0
    # dQ by atomics adds in no fixed order on a GPU (the interpreter runs the programs one after another)
    options = dict(atomic_dq=pick([False, True]) if INTERPRET else False, group_sum_in_program=pick([False, True]))
    q = torch.randn(B, Tq, H, D, generator=g).to(torch.bfloat16).to(DEVICE).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, Tk, H_kv, D, generator=g).to(torch.bfloat16).to(DEVICE).transpose(1, 2).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, H, Tq, D, generator=g).to(torch.bfloat16).to(DEVICE)
    keep = segments = None
    if packed:
        cut = int(torch.randint(1, Tq - 1, (1,), generator=g))
        segments = launch.packed_segments([0, cut, Tq], [0, cut, Tk], DEVICE)
    elif pick([False, True]):
        keep = (torch.rand(B, Tk, generator=g) > 0.3).to(DEVICE)
    stats, by_hand_stats = (AttentionStats(H, eps=SFA().eps) for _ in range(2))
    kw = dict(causal=causal, scale=D**-0.5, policy=resolve(precision), stabilize=stabilize, window=window,
              key_padding=keep, segments=segments, softcap=softcap)
    case = (f"seed {seed}: {precision}, D {D}, heads {H}/{H_kv}, T {Tq}/{Tk}, packed {packed}, causal {causal}, "
            f"window {window}, keep {keep is not None}, softcap {softcap}, sfa {stabilize is not None}, {options}")

    def by_hand(q, k, v):
        wide = [torch.nn.functional.pad(t, (0, width - D)) for t in (q, k, v)]
        return backend.attention(*wide, stats=by_hand_stats, **kw)[..., :D]

    with _same_tiles(**options):
        ours = _run(lambda q, k, v: backend.attention(q, k, v, stats=stats, **kw), q, k, v, dout)
        theirs = _run(by_hand, q, k, v, dout)
    for name, a, b in zip(["out", "dq", "dk", "dv"], ours, theirs):
        assert torch.equal(a, b), (name, case)
    for column in STAT_COLUMNS:
        assert torch.equal(getattr(stats, column), getattr(by_hand_stats, column)), (column, case)


def test_head_dims_above_the_widest_kernel_are_refused_by_name():
    from stableflash.attention import triton as backend

    q = torch.randn(1, 2, 8, 320, dtype=torch.bfloat16)
    assert not backend.supports(q) and backend.kernel_head_dim(320) is None and backend.kernel_head_dim(0) is None
    with pytest.raises(ValueError, match="q: the triton backend takes head dims up to 256, got 320"):
        backend.attention(q, q, q, causal=True, scale=0.1, policy=resolve("fa2"))


@pytest.mark.parametrize("precision", ["fa2", "paper"])
def test_head_dim_256_runs_in_the_kernels(precision):
    """D = 256 (Gemma's) has tiles of its own (`tuning.WIDE_HEAD_DIM`; the emulation kernels' 32x32): causal GQA
    with SFA, outputs and gradients within twice the reference's error against fp64; under `paper`, mostly the
    reference's bits, as the other emulated tests hold them."""
    seed, g, q, k, v, dout = _grouped_inputs(1, 4, 70, 70, 256, 2)
    ours = _run(functools.partial(_attention, causal=True, stabilize=SFA(), precision=precision), q, k, v, dout)
    ref = _run(functools.partial(flash_attention, causal=True, stabilize=SFA(), precision=precision,
                                 backend="reference"), q, k, v, dout)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    exact = _run(lambda *t: flash_attention(*t, causal=True, precision="fp64", backend="reference"), *leaves,
                 dout.cpu().double())
    for name, a, r, e in zip(["out", "dq", "dk", "dv"], ours, ref, exact):
        assert torch.isfinite(a).all(), (name, f"seed {seed}")
        _assert_within_twice_the_reference(name, a, r, e, torch.bfloat16)
        if precision == "paper":
            assert (a == r).float().mean().item() >= (0.95 if name == "out" else 0.80), (name, f"seed {seed}")


def test_the_kernels_ops_export_save_and_load_with_the_eager_calls_bits():
    """torch.export through the two ops (their fakes trace it; the call's scalars travel as one string), saved and
    loaded again: the same output as eagerly, SFA and a window at a padded head dim."""
    import io

    from stableflash.attention import triton as backend

    q, k, v = (t.detach() for t in _inputs((1, 2, 40, 24 if INTERPRET else 80)))

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return backend.attention(q, k, v, causal=True, scale=0.2, policy=resolve("fa2"), stabilize=SFA(),
                                     window=(11, -1))

    buffer = io.BytesIO()
    torch.export.save(torch.export.export(Attention(), (q, k, v)), buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    assert torch.equal(loaded.module()(q, k, v), Attention()(q, k, v))


def test_only_the_output_carries_a_gradient_and_none_is_zero_filled():
    """The forward op's other outputs (its saved O, log-sum-exp, statistics) take no gradient: an eager
    forward+backward (after the first, which tunes) allocates no zero tensor for theirs (a GPU memset each), and a
    loss on them alone gives the inputs none. The gradients still match the reference's."""
    from stableflash.attention import triton as backend
    from stableflash.attention.triton import ops
    from stableflash.attention.triton.spec import spec_name

    q, k, v = _inputs((1, 2, 40, 16))
    dout = torch.randn_like(q)

    def call(q, k, v):
        return backend.attention(q, k, v, causal=True, scale=0.25, policy=resolve("fa2"))

    _run(call, q, k, v, dout)  # a first call autotunes on a GPU, whose timing runs clear the L2 cache with zero_
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        grads = _run(call, q, k, v, dout)
    filled = [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zero_", "aten::fill_")]
    assert not filled, filled
    reference = _run(lambda q, k, v: flash_attention(q, k, v, causal=True, scale=0.25, backend="reference",
                                                     precision="fa2"), q, k, v, dout)
    assert all(rel_err(a, b) < 0.02 for a, b in zip(grads[1:], reference[1:]))
    name = spec_name(resolve("fa2"), None, torch.bfloat16, 16, 40)
    _, _, lse, _, _ = ops.flash_fwd(q, k, v, None, name, ops.Call(True, 0.25, None).encode())
    lse.sum().backward()
    assert q.grad is None and k.grad is None and v.grad is None


def test_a_padded_head_dim_compiles_whole_with_the_eager_calls_bits():
    """torch.compile(fullgraph=True) through the padding and the ops: the same bits as eagerly, gradients included."""
    from stableflash.attention import triton as backend

    torch._dynamo.reset()
    q, k, v = _inputs((1, 2, 40, 24 if INTERPRET else 80))
    dout = torch.randn_like(q)

    def call(q, k, v):
        return backend.attention(q, k, v, causal=True, scale=0.2, policy=resolve("fa2"), stabilize=SFA())

    eager = _run(call, q, k, v, dout)
    compiled = _run(torch.compile(call, fullgraph=True), q, k, v, dout)
    for name, a, b in zip(["out", "dq", "dk", "dv"], eager, compiled):
        assert torch.equal(a, b), name
