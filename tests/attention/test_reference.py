"""The reference against float64 math attention, the presets against their definitions."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import rel_err, tied_inputs

from stableflash import SFA, Precision, flash_attention
from stableflash.attention import PRESETS, SITES
from stableflash.attention.precision import BACKWARD_SITES

ROOT = Path(__file__).resolve().parents[2]


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


@pytest.mark.parametrize("T", [77, 300, 513])
@pytest.mark.parametrize("D", [16, 40, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_fp32_reference_matches_fp64_math(T, D, causal):
    g = torch.Generator().manual_seed(T * D + causal)
    q, k, v = (torch.randn(1, 2, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(1, 2, T, D, generator=g, dtype=torch.float64)
    exact_in = [t.clone().requires_grad_() for t in (q, k, v)]
    exact = flash_attention(*exact_in, causal=causal, backend="math")
    exact_grads = _grads(exact, exact_in, dout)
    ours_in = [t.float().requires_grad_() for t in (q, k, v)]
    ours = flash_attention(*ours_in, causal=causal, precision="fp32", backend="reference")
    ours_grads = _grads(ours, ours_in, dout.float())
    assert ours.dtype == torch.float32
    assert rel_err(ours, exact) < 1e-5
    for a, b in zip(ours_grads, exact_grads):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("preset", ["fp32", "fa2", "paper"])
def test_autocast_does_not_change_the_reference(preset):
    # training runs under bf16 autocast; the policy alone must decide the rounding (autocast once ran the
    # reference's matmuls in bf16, and the fp32 policy's gradients were off by ~4%)
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(2, 3, 70, 16, generator=g).mul(s).bfloat16() for s in (3, 3, 1, 1))

    def run(autocast: bool):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = flash_attention(*leaves, causal=True, precision=PRESETS[preset], backend="reference")
        out.backward(do.to(out.dtype))
        return [out, *(t.grad for t in leaves)]

    for plain, autocast in zip(run(False), run(True)):
        assert plain.dtype == autocast.dtype and torch.equal(plain, autocast)


def test_fp64_reference_passes_gradcheck():
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    policy = PRESETS["fp64"].replace(block_m=4, block_n=3)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, precision=policy, backend="reference"), inputs)


def test_grouped_query_gradients_are_summed_in_the_policys_format():
    """GQA on bf16 inputs under fp64 numerics: dK and dV are the exact gradients rounded once to bf16, each group's
    sum taken in fp64 (summed after each head's share was rounded to bf16, they were off by up to several units);
    GQA passes gradcheck in fp64, per-head policies included."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 21, 16, generator=g).mul(3).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 2, 33, 16, generator=g).mul(3).bfloat16().requires_grad_() for _ in range(2))
    dout = torch.randn(2, 6, 21, 16, generator=g, dtype=torch.float64)
    out = flash_attention(q, k, v, causal=False, softcap=5.0, precision="fp64", backend="reference")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = leaves[0] @ leaves[1].repeat_interleave(3, 1).transpose(-1, -2) / 4
    exact = torch.softmax(5 * torch.tanh(s / 5), -1) @ leaves[2].repeat_interleave(3, 1)
    for name, ours, want in zip("qkv", grads, torch.autograd.grad(exact, leaves, dout)):
        unit = torch.finfo(torch.bfloat16).eps * torch.exp2(want.abs().clamp_min(1e-30).log2().floor())
        assert ((ours.double() - want).abs() <= unit / 2 + 1e-12).all(), name
    inputs = [torch.randn(1, 4, 9, 4, generator=g, dtype=torch.float64, requires_grad=True)] + \
        [torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    for policy in (PRESETS["fp64"].replace(block_m=4, block_n=3), PRESETS["fp64"].with_heads([1], "fp64")):
        assert torch.autograd.gradcheck(
            lambda q, k, v, policy=policy: flash_attention(q, k, v, causal=False, precision=policy,
                                                           backend="reference"), inputs)


@pytest.mark.parametrize("num_ties", [2, 3])
def test_fp64_sfa_is_exact_attention(num_ties):
    q, k, v = (t.double() for t in tied_inputs(num_ties, T=96, magnitude=6.0))
    dout = torch.randn_like(q)
    exact_in = [t.clone().requires_grad_() for t in (q, k, v)]
    exact = flash_attention(*exact_in, causal=False, backend="math")
    exact_grads = _grads(exact, exact_in, dout)
    for sfa in (SFA(beta=2.0), SFA(beta=8.0, bounded=False)):
        sfa_in = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*sfa_in, causal=False, precision="fp64", stabilize=sfa, backend="reference")
        assert rel_err(out, exact) < 1e-10
        for a, b in zip(_grads(out, sfa_in, dout), exact_grads):
            assert rel_err(a, b) < 1e-10


def _literal_bf16(q, k, v, scale, block=512):
    """The `bf16` preset's op sequence written out in bf16 torch ops."""
    B, H, T, D = q.shape
    out = torch.empty_like(q)
    for i0 in range(0, T, block):
        qi = q[:, :, i0:i0 + block]
        m = torch.full((B, H, qi.shape[2], 1), -math.inf, dtype=torch.bfloat16)
        l = torch.zeros_like(m)
        o = torch.zeros_like(qi)
        for j0 in range(0, min(i0 + block, T), block):
            kj, vj = k[:, :, j0:j0 + block], v[:, :, j0:j0 + block]
            s = (qi @ kj.transpose(-1, -2)) * scale
            rows = torch.arange(i0, i0 + qi.shape[2])[:, None]
            cols = torch.arange(j0, j0 + kj.shape[2])[None, :]
            s = s.masked_fill(cols > rows, -math.inf)
            m_new = torch.maximum(s.amax(-1, keepdim=True), m)
            p = torch.exp(s - m_new)
            tile_sum = p.sum(-1, keepdim=True).clamp(min=1e-10)
            pv = p @ vj
            c = torch.exp(m - m_new)
            l = c * l + tile_sum
            o = o * c + pv
            m = m_new
        out[:, :, i0:i0 + block] = o / l
    return out


def test_bf16_preset_matches_literal_op_sequence_bitwise():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 1024, 64, generator=g).bfloat16() for _ in range(3))
    ours = flash_attention(q, k, v, precision="bf16", backend="reference")
    literal = _literal_bf16(q, k, v, scale=1 / 8)
    assert ours.dtype == torch.bfloat16
    equal = (ours == literal).float().mean().item()
    assert equal >= 0.99, f"only {equal:.4f} of outputs bit-equal"


@pytest.mark.parametrize("preset", ["fa2", "bf16", "paper"])
def test_low_precision_presets_within_bf16_error(preset):
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(1, 3, 257, 64, generator=g).bfloat16() for _ in range(4))
    exact_in = [t.double().requires_grad_() for t in (q, k, v)]
    exact = flash_attention(*exact_in, backend="math")
    exact_grads = _grads(exact, exact_in, dout.double())
    ours_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = flash_attention(*ours_in, precision=preset, backend="reference")
    assert rel_err(ours, exact) < 2e-2
    for a, b in zip(_grads(ours, ours_in, dout.to(ours.dtype)), exact_grads):
        assert rel_err(a, b) < 5e-2


def test_fa2_forward_error_is_bf16_output_rounding():
    # fa2 rounds O once: its error is at most the error of rounding the exact O to bf16, plus P̄'s cast
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=g).bfloat16() for _ in range(3))
    exact = flash_attention(*(t.double() for t in (q, k, v)), backend="math")
    fa2 = flash_attention(q, k, v, precision="fa2", backend="reference")
    assert rel_err(fa2, exact) < 2.5 * rel_err(exact.bfloat16(), exact)


# The official code as it trained (compiled), site by site: research/official_trace.py measured these against it
PAPER_COMPILED = {
    "qk": "bf16", "scores": "fp32", "row_max": "fp32", "pbar": "fp32", "pbar_operand": "bf16", "v_operand": "input",
    "tile_sum": "fp32",
    "pv": "bf16", "rescale": "fp32", "row_sum": "fp32", "acc_scaled": "fp32", "acc": "fp32", "out": "bf16",
    "row_sum_saved": "bf16", "lse": "fp32", "p": "fp32", "p_operand": "bf16", "dp": "bf16", "delta_terms": "fp32",
    "delta": "fp32", "ds": "fp32", "ds_operand": "bf16", "dv_part": "bf16", "dv": "fp32", "dk_part": "bf16",
    "dk": "fp32", "dq_part": "bf16", "dq": "fp32",
}


def test_paper_preset_pins_the_compiled_table():
    paper = PRESETS["paper"]
    assert set(PAPER_COMPILED) == set(SITES)
    for site, fmt in PAPER_COMPILED.items():
        assert getattr(paper, site) == fmt, site
    assert (paper.block_m, paper.block_n, paper.tile_sum_clamp) == (512, 512, 1e-10)
    docs = (ROOT / "docs/precision.md").read_text()
    assert "research/official_trace.py" in docs
    for site in SITES:
        assert f"| {site} |" in docs, site


def test_paper_eager_forward_matches_the_eager_trace():
    """The eager forward's dtypes as traced (results/paper-dtypes); its backward cannot run eagerly."""
    traced = json.loads((ROOT / "results/paper-dtypes/paper-dtypes.json").read_text())["sites"]
    eager = PRESETS["paper-eager"]
    for site in ("qk", "scores", "row_max", "pbar", "tile_sum", "pv", "rescale", "row_sum", "acc", "out", "lse"):
        assert getattr(eager, site) == traced[site], site
    assert eager.acc_scaled == "bf16"  # the in-place O *= c rounds to the bf16 buffer
    for site in BACKWARD_SITES:
        assert getattr(eager, site) == PAPER_COMPILED[site], site


def test_delta_formulas_agree_in_fp64_and_differ_in_bf16():
    q, k, v = tied_inputs(3, T=64)
    dout = -torch.rand_like(q.float()).bfloat16()
    grads = {}
    for formula in ("do_o", "dp_p", "do_o_recomputed"):
        for name in ("fp64", "paper"):
            policy = PRESETS[name].with_delta(formula)
            inputs = [t.double().requires_grad_() if name == "fp64" else t.clone().requires_grad_() for t in (q, k, v)]
            out = flash_attention(*inputs, causal=False, precision=policy, backend="reference")
            grads[formula, name] = _grads(out, inputs, dout.to(out.dtype))
    for formula in ("dp_p", "do_o_recomputed"):
        for a, b in zip(grads[formula, "fp64"], grads["do_o", "fp64"]):
            assert rel_err(a, b) < 1e-12
    assert not torch.equal(grads["dp_p", "paper"][0], grads["do_o", "paper"][0])


def test_tiling_off_is_one_tile_and_knobs_compose():
    p = PRESETS["paper"].tiling_off().with_pv_fp32()
    assert p.block_m is None and p.block_n is None and p.pv == "fp32" and p.acc == "fp32"
    o32 = PRESETS["paper"].with_o_fp32()
    assert o32.o_saved == "fp32"
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 130, 64, generator=g).bfloat16() for _ in range(3))
    a = flash_attention(q, k, v, precision=PRESETS["paper"].tiling_off(), backend="reference")
    b = flash_attention(q, k, v, precision=PRESETS["paper"].replace(block_m=1000, block_n=1000), backend="reference")
    assert torch.equal(a, b)


def test_per_head_override_matches_whole_policy_on_those_heads():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 70, 32, generator=g).bfloat16().requires_grad_() for _ in range(3))
    mixed = PRESETS["paper"].with_heads({1, 3}, "fp32")
    out = flash_attention(q, k, v, precision=mixed, backend="reference")
    full32 = flash_attention(q, k, v, precision="fp32", backend="reference")
    paper = flash_attention(q, k, v, precision="paper", backend="reference")
    assert torch.equal(out[:, [0, 2]], paper[:, [0, 2]])
    assert torch.equal(out[:, [1, 3]], full32[:, [1, 3]].bfloat16())
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="head_override"):
        flash_attention(q, k, v, precision=PRESETS["paper"].with_heads({9}, "fp32"), backend="reference")


def test_fp8_and_stochastic_sites_run():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 1, 40, 16, generator=g) for _ in range(3))
    exact = flash_attention(q.double(), k.double(), v.double(), backend="math")
    fp8 = PRESETS["fa2"].replace(pbar_operand="fp8_e4m3", name="fa2-fp8pbar")
    err8 = rel_err(flash_attention(q, k, v, precision=fp8, backend="reference"), exact)
    assert 1e-3 < err8 < 0.2
    sr = PRESETS["bf16"].replace(rounding="stochastic")
    assert rel_err(flash_attention(q, k, v, precision=sr, backend="reference"), exact) < 5e-2


def test_precision_validation():
    with pytest.raises(ValueError, match="Precision.pv"):
        Precision(pv="fp12")
    with pytest.raises(ValueError, match="delta_formula"):
        Precision(delta_formula="magic")
    with pytest.raises(ValueError, match="block_m"):
        Precision(block_m=0)
    with pytest.raises(ValueError, match="precision: unknown preset 'fp17'"):
        flash_attention(*(torch.randn(1, 1, 4, 8) for _ in range(3)), precision="fp17")


def test_backward_probabilities_sum_to_the_ties_when_lse_is_rounded_onto_the_max():
    from stableflash.attention.reference import backward_row_sums
    from stableflash.diagnose.mechanism import tied_maxima_inputs

    q, k, v, _ = tied_maxima_inputs(4, heads=2, keys=64, score_scale=5000.0)  # tied logits 5,000-10,000
    kw = dict(causal=False)
    # bf16 spaces values 32-64 apart there: lse = m + log 4 rounds back to m, and the 4 ties get P = 1 each
    assert backward_row_sums(q, k, v, policy=PRESETS["bf16"], **kw).median().item() == pytest.approx(4.0, rel=0.02)
    for name in ("paper", "fa2"):  # lse in fp32
        assert backward_row_sums(q, k, v, policy=PRESETS[name], **kw).sub(1).abs().max().item() < 0.02, name
    q, k, v = (torch.randn(1, 2, 33, 16, dtype=torch.float64) for _ in range(3))  # small logits, causal
    assert backward_row_sums(q, k, v, policy=PRESETS["fp64"]).sub(1).abs().max().item() < 1e-12


def test_the_docs_table_is_the_presets():
    """docs/precision.md's preset table, row by row, against PRESETS (so the docs cannot drift)."""
    docs = (ROOT / "docs/precision.md").read_text()
    header = next(line for line in docs.splitlines() if line.startswith("| site | what |"))
    names = [cell.strip() for cell in header.strip("|").split("|")[2:]]
    assert set(names) == set(PRESETS), names
    for site, what in SITES.items():
        assert f"| {site} | {what} | " + " | ".join(getattr(PRESETS[n], site) for n in names) + " |" in docs, site
