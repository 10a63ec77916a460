"""Precision policies: hashing, knobs, and the config's one path to a policy."""

import dataclasses
import pickle
import subprocess
import sys

import pytest

from stableflash.attention.precision import PRESETS, resolve
from stableflash.attention.stabilize import SFA


def test_policies_hash_by_value_also_after_a_pickle_from_another_process():
    """The kernels' registry keys on the policy itself; its hash is cached, so a pickle must not carry it (string
    hashes differ between processes)."""
    policy = resolve("paper").with_pv_fp32().replace(block_m=256)
    code = ("import pickle, sys; from stableflash.attention.precision import resolve; "
            "p = resolve('paper').with_pv_fp32().replace(block_m=256); hash(p); sys.stdout.buffer.write(pickle.dumps(p))")
    blob = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
    restored = pickle.loads(blob)
    assert restored == policy and hash(restored) == hash(policy) and {policy: 1}[restored] == 1
    assert hash(pickle.loads(pickle.dumps(SFA(beta=3.0)))) == hash(SFA(beta=3.0))


def test_a_config_gives_the_policy_its_knobs_describe():
    from stableflash.train.config import AttentionConfig

    cfg = AttentionConfig(precision="paper", pv_fp32=True, delta="dp_p", sites={"qk": "fp32"}, heads=(1,))
    policy = cfg.policy()
    assert policy.name == "paper+delta=dp_p+qk=fp32+pv32+heads[1]"
    assert (policy.pv, policy.delta_formula, policy.qk, policy.head_override[0]) == ("fp32", "dp_p", "fp32", (1,))
    assert AttentionConfig().policy() is PRESETS["fa2"]
    # the knobs change their part whatever the table says: an isolation experiment on a run with a narrowed P̄V
    narrowed = {site: "e8m4" for site in ("pbar_operand", "pv", "acc_scaled", "acc")}
    pv32 = AttentionConfig(precision="paper", sites=narrowed, pv_fp32=True).policy()
    assert (pv32.pbar_operand, pv32.pv, pv32.acc_scaled, pv32.acc) == ("e8m4", "fp32", "fp32", "fp32")
    forward = AttentionConfig(precision="paper", sites=narrowed, forward_precision="fp32").policy()
    assert forward.pv == "fp32" and forward.pbar_operand == "fp32"
    with pytest.raises(ValueError, match=r"attention.sites.qk: expected 'input' or a format name"):
        AttentionConfig(sites={"qk": "fp31"})
    with pytest.raises(ValueError, match=r"attention.layers.1: unknown keys"):
        AttentionConfig(layers={"1": {"precison": "paper"}})
    with pytest.raises(ValueError, match=r"attention.precision: expected one of"):
        AttentionConfig(layers={"1": {"precision": "papr"}})


def test_one_pass_takes_another_presets_formats():
    from stableflash.attention.precision import BACKWARD_SITES, FORWARD_SITES, PRESETS, SITES

    assert FORWARD_SITES + BACKWARD_SITES == tuple(SITES) and FORWARD_SITES[-1] == "lse"
    base, fa2 = PRESETS["bf16"], PRESETS["fa2"]
    fwd = base.with_pass_of("forward", "fa2")
    assert all(getattr(fwd, s) == getattr(fa2, s) for s in FORWARD_SITES)
    assert all(getattr(fwd, s) == getattr(base, s) for s in BACKWARD_SITES)
    assert (fwd.block_n, fwd.tile_sum_clamp) == (base.block_n, base.tile_sum_clamp)  # not a site: stays
    bwd = base.with_pass_of("backward", fa2)
    assert all(getattr(bwd, s) == getattr(fa2, s) for s in BACKWARD_SITES) and bwd.qk == "bf16"
    with pytest.raises(ValueError, match="which: expected 'forward' or 'backward'"):
        base.with_pass_of("sideways", "fa2")


def test_rounding_modes_per_site():
    import torch

    from stableflash import flash_attention
    from stableflash.attention.precision import PRESETS, PV_PATH

    with pytest.raises(ValueError, match="Precision.rounding_sites"):
        PRESETS["paper"].replace(rounding="stochastic", rounding_sites=("pv", "bogus"))
    seed = 17
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 96, 16, generator=gen) for _ in range(3))
    v = v.abs() + 0.25  # one sign: truncation then biases O downward
    q, k, v = (t.bfloat16() for t in (q, k, v))
    exact = flash_attention(q.double(), k.double(), v.double(), precision="fp64", backend="reference")
    paper = PRESETS["paper"]

    def error(policy):
        return (flash_attention(q, k, v, precision=policy, backend="reference").double() - exact).mean().item()

    toward_zero = paper.with_rounding("toward_zero", PV_PATH)
    assert toward_zero.rounding_sites == PV_PATH and "toward_zero" in toward_zero.name
    assert error(toward_zero) < -4 * abs(error(paper))
    torch.manual_seed(1)
    a = flash_attention(q, k, v, precision=paper.with_rounding("stochastic", PV_PATH), backend="reference")
    torch.manual_seed(1)
    b = flash_attention(q, k, v, precision=paper.with_rounding("stochastic", PV_PATH), backend="reference")
    assert torch.equal(a, b)
    # sites outside the list round to nearest: a mode on dQ alone leaves the forward as it was
    only_qk = paper.with_rounding("toward_zero", ("dq",))
    assert torch.equal(flash_attention(q, k, v, precision=only_qk, backend="reference"),
                       flash_attention(q, k, v, precision=paper, backend="reference"))


def test_narrow_bf16_formats_dose_the_pv_error():
    """e8m6 ... e8m3 (bf16's exponent, fewer fraction bits) at P̄V's path: the error grows with each bit taken."""
    import torch

    from stableflash import flash_attention
    from stableflash.attention.precision import PRESETS, PV_PATH
    from stableflash.attention.triton.spec import unsupported_reason
    from stableflash.numerics import get_format

    assert [get_format(f"e8m{b}").fraction_bits for b in (6, 5, 4, 3)] == [6, 5, 4, 3]
    seed = 23
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 80, 16, generator=gen) for _ in range(3))
    v = v.abs() + 0.25
    q, k, v = (t.bfloat16() for t in (q, k, v))
    exact = flash_attention(q.double(), k.double(), v.double(), precision="fp64", backend="reference")
    fp32 = PRESETS["fp32"]

    def dosed(fmt, mode="nearest"):
        policy = fp32.with_sites(**{s: fmt for s in ("pv", "acc")})
        if mode != "nearest":
            policy = policy.with_rounding(mode, PV_PATH)
        return flash_attention(q, k, v, precision=policy, backend="reference").double() - exact

    errors = [dosed(f"e8m{b}").abs().mean().item() for b in (6, 5, 4, 3)]
    assert errors == sorted(errors) and errors[-1] > 4 * errors[0], errors
    assert dosed("e8m3", "toward_zero").mean() < -4 * dosed("e8m3").mean().abs()
    torch.manual_seed(5)
    a = dosed("e8m3", "stochastic")
    torch.manual_seed(5)
    assert torch.equal(a, dosed("e8m3", "stochastic"))
    assert unsupported_reason(fp32.with_sites(pv="e8m4"), None, torch.bfloat16) is None  # the kernels run them
    assert unsupported_reason(fp32.with_rounding("stochastic", PV_PATH), None, torch.bfloat16) is None
    assert "stochastic" in unsupported_reason(fp32.with_rounding("stochastic"), None, torch.bfloat16)  # every site
    assert "fp16" in unsupported_reason(PRESETS["fa2"].with_rounding("toward_zero"), None, torch.float16)


def test_only_production_fa2_numerics_run_the_native_kernels():
    """The native kernels compute fa2 as such: a policy that differs only by a site in e8m4 (stored in fp32, as fa2
    stores P̄V) or by a rounding mode must go to the emulation kernels, which round as it says."""
    import torch

    pytest.importorskip("triton")
    from stableflash.attention.precision import PV_PATH
    from stableflash.attention.triton.spec import build_spec

    assert build_spec(PRESETS["fa2"], None, torch.bfloat16, 256).native
    for policy in (PRESETS["fa2"].with_sites(pv="e8m4"), PRESETS["fa2"].with_rounding("toward_zero", PV_PATH)):
        assert not build_spec(policy, None, torch.bfloat16, 256).native, policy.name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_policy_and_its_key_give_each_other_back(name):
    """The key torch.compile holds as a constant names the policy exactly, a per-head override and a tuple of rounding
    sites included."""
    from stableflash.attention.precision import Precision

    for policy in (resolve(name), resolve(name).with_delta("dp_p"),
                   dataclasses.replace(resolve("fa2"), rounding="toward_zero", rounding_sites=("pv", "acc"),
                                       head_override=((0, 2), resolve(name)), tile_sum_clamp=1e-10)):
        back = Precision.from_key(policy.key)
        assert back == policy and back.key == policy.key


def test_a_policy_built_inside_compiled_code_traces_whole():
    """A model that builds its policy in its forward (a preset with another δ formula) compiles with fullgraph=True."""
    import torch

    from stableflash import flash_attention

    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True, precision=resolve("paper").with_delta("dp_p"), backend="reference")

    torch._dynamo.reset()
    assert torch.equal(torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v), attend(q, k, v))


@pytest.mark.parametrize("clamp", [-1.0, float("inf"), float("nan"), "1e-10"])
def test_a_tile_sum_clamp_must_be_a_finite_number(clamp):
    with pytest.raises(ValueError, match="Precision.tile_sum_clamp: expected None or a finite number >= 0"):
        dataclasses.replace(resolve("fa2"), tile_sum_clamp=clamp)
