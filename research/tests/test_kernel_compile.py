"""The shipped kernels compile for the H200 (sm_90) on any machine, no GPU needed: what the interpreter cannot see.

In the default run, whose interpreter replaces the JIT functions, these run in a child process without it
(`test_kernel_compile_in_ci.py`); alone, `python -m pytest research/tests/test_kernel_compile.py`. Guards
found on the GPU: a bf16 dot of fp32 operands that did not compile, Triton's FMA contraction of the scaled scores (NaN
from scores of ~2^31) and of the emulated products (one rounding where the reference makes two), and wgmmas that
ptxas serialises.
"""

import os
import re
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
# the kernels must be Triton's JIT functions, not the interpreter's: in the default run (tests/conftest.py turns the
# interpreter on without a GPU) these are skipped here and run in test_kernel_compile_in_ci.py's child
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiles for sm_90: test_kernel_compile_in_ci.py runs it without the interpreter")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline_compile import compile_function, compile_kernel, constexprs, memory_instructions, resource_usage, wgmma_serialization  # noqa: E402

from stableflash import SFA  # noqa: E402
from stableflash.attention.precision import resolve  # noqa: E402
from stableflash.attention.triton import hopper, launch, tuning  # noqa: E402
from stableflash.attention.triton.spec import spec_name  # noqa: E402


def _name(policy: str, stabilize=None, head_dim: int = 64, T: int = 4096) -> str:
    base, _, knob = policy.partition("+")
    pol = resolve(base).with_delta("dp_p") if knob == "dp_p" else resolve(base)
    return spec_name(pol, stabilize, torch.bfloat16, head_dim, T)


def _compile(policy, kernel, config, stabilize=None, head_dim=64, stats=False):
    name = _name(policy, stabilize, head_dim)
    return compile_kernel(name, kernel, constexprs(name, kernel, head_dim, config, stats=stats), config)


@pytest.mark.parametrize("policy, kernel, config", [
    ("fp32", "fwd", tuning.emulation_config(True, 64)), ("fp32", "dkdv", tuning.emulation_config(True, 64)),
    ("fp32", "dq", tuning.emulation_config(True, 64)), ("paper+dp_p", "delta_dpp", tuning.emulation_config(False, 64)),
    ("fa2", "fwd", tuning.FWD_CONFIGS[0]), ("fa2", "dq", tuning.DQ_CONFIGS[0]), ("fa2", "dkdv", tuning.DKDV_CONFIGS[0]),
])
def test_kernel_compiles_for_sm90(policy, kernel, config):
    if policy == "fa2":  # the native kernels' tiles carry the load path
        config = triton.Config({**config.kwargs, "TMA": False}, num_warps=config.num_warps, num_stages=config.num_stages)
    usage = resource_usage(_compile(policy, kernel, config))
    assert 0 < usage["registers"] <= 255


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("kernel, config", [("fwd", tuning.FWD_CONFIGS[0]), ("dq", tuning.DQ_CONFIGS[0]),
                                            ("dkdv", tuning.DKDV_CONFIGS[0])])
def test_the_masked_native_kernels_compile_for_sm90(kernel, config, tma, packed, monkeypatch):
    """The masked form (Tk != Tq, a band, key padding or packed sequences) with SFA and the statistics, at D = 128
    (where TMA loads are among the candidates), keeping its wgmmas asynchronous; dK/dV summing a GQA group of 4 in
    its programs."""
    import offline_compile

    if packed:  # the sequences' (3, T) int32 in place of the padding bytes
        monkeypatch.setitem(offline_compile._POINTERS, "KEEP", "*i32")
    config = triton.Config({**config.kwargs, "TMA": tma}, num_warps=config.num_warps, num_stages=config.num_stages)
    name = _name("fa2", SFA(), head_dim=128)
    consts = {**constexprs(name, kernel, 128, config, causal=False, stats=kernel == "fwd"), "MASK": True, "PAD": True,
              "SEG": packed, **({"GROUP": 4} if kernel == "dkdv" else {})}
    compiled = compile_kernel(name, kernel, consts, config)
    assert 0 < resource_usage(compiled)["registers"] <= 255
    assert "wgmma.mma_async" in compiled.asm["ptx"] and wgmma_serialization(compiled) is None


_SM90_SHARED_BYTES = 232_448
_WIDE = [("fwd", c) for c in tuning.WIDE_FWD_CONFIGS] + [("dq", c) for c in tuning.WIDE_DQ_CONFIGS] + \
    [("dkdv", c) for c in tuning.WIDE_DKDV_CONFIGS]


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "masked GQA"])
@pytest.mark.parametrize("kernel, config", _WIDE, ids=[f"{k} {c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}"
                                                      for k, c in _WIDE])
def test_every_wide_head_candidate_fits_an_h200(kernel, config, masked):
    """D = 256's candidates (`tuning.WIDE_*_CONFIGS`), SFA with the statistics, causal or in the masked form with a
    softcap and a GQA group of 4 (Gemma 2's window, cap and groups): within an H200's shared memory and registers,
    spilling at most 512 bytes, wgmmas asynchronous. A candidate that did not fit would fail at launch, and the first
    of each list launches untuned."""
    config = triton.Config({**config.kwargs, "TMA": False}, num_warps=config.num_warps, num_stages=config.num_stages)
    name = _name("fa2", SFA(), head_dim=256)
    consts = constexprs(name, kernel, 256, config, causal=not masked, stats=kernel == "fwd")
    if masked:
        consts.update(MASK=True, PAD=True, SOFTCAP=True, **({"GROUP": 4} if kernel == "dkdv" else {}))
    usage = resource_usage(compiled := compile_kernel(name, kernel, consts, config))
    assert usage["shared_bytes"] <= _SM90_SHARED_BYTES and 0 < usage["registers"] <= 255, usage
    assert usage["spill_stack_bytes"] <= 512, usage
    assert "wgmma.mma_async" in compiled.asm["ptx"] and wgmma_serialization(compiled) is None


@pytest.mark.parametrize("kernel", ["fwd", "delta_dpp", "dq", "dkdv"])
@pytest.mark.parametrize("preset", ["paper+dp_p", "fp32"])
def test_the_emulation_kernels_fit_an_h200_at_head_dim_256(preset, kernel):
    """The emulation kernels' one tile at D = 256 (`tuning.emulation_config`: 32x32) fits shared memory and registers,
    bf16 and fp32 operands alike (they spill there; these kernels are for exactness, not speed)."""
    name = _name(preset, head_dim=256)
    if kernel == "delta_dpp" and preset == "fp32":
        pytest.skip("fp32 computes δ in the dQ kernel")
    config = tuning.emulation_config(preset == "fp32", 256)
    usage = resource_usage(compile_kernel(name, kernel, constexprs(name, kernel, 256, config), config))
    assert usage["shared_bytes"] <= _SM90_SHARED_BYTES and 0 < usage["registers"] <= 255, usage


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("kernel, config", [("fwd", tuning.FWD_CONFIGS[0]), ("dq", tuning.DQ_CONFIGS[0]),
                                            ("dkdv", tuning.DKDV_CONFIGS[0])])
def test_softcap_compiles_for_sm90_in_the_packed_form(kernel, config, tma, monkeypatch):
    """The cap's tanh and slope (`common.scores`) in the packed masked form at D = 128, fp16 (the case of flash-attn's
    tests that lost a worker's CUDA context on the H200): it compiles, its wgmmas stay asynchronous."""
    import offline_compile

    monkeypatch.setitem(offline_compile._POINTERS, "KEEP", "*i32")
    for tensor in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ"):
        monkeypatch.setitem(offline_compile._POINTERS, tensor, "*fp16")
    config = triton.Config({**config.kwargs, "TMA": tma}, num_warps=config.num_warps, num_stages=config.num_stages)
    name = spec_name(resolve("fa2"), None, torch.float16, 128, 4096)
    consts = {**constexprs(name, kernel, 128, config, causal=False), "MASK": True, "PAD": True, "SEG": True,
              "SOFTCAP": True}
    compiled = compile_kernel(name, kernel, consts, config)
    assert 0 < resource_usage(compiled)["registers"] <= 255
    assert "wgmma.mma_async" in compiled.asm["ptx"] and wgmma_serialization(compiled) is None


@pytest.mark.parametrize("kernel, config", [("fwd", tuning.config(128, 128, 8, 3, TMA=False)),
                                            ("dkdv", tuning.config(32, 128, 4, 3, TMA=False)),
                                            ("dq", tuning.config(128, 32, 4, 3, TMA=False))])
def test_native_kernels_keep_wgmmas_asynchronous(kernel, config):
    """ptxas runs a kernel's wgmmas one after another when it cannot prove a register read outside their lifetime;
    ours must not be among them. SFA + statistics at D = 128, the heaviest native specialisation."""
    compiled = _compile("fa2", kernel, config, SFA(), head_dim=128, stats=kernel == "fwd")
    assert "wgmma.mma_async" in compiled.asm["ptx"] and wgmma_serialization(compiled) is None


@pytest.mark.parametrize("head_dim, d_in", [(64, 40), (128, 80), (128, 96), (256, 160)])
@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("policy", ["fa2", "paper"])
def test_a_head_dim_padded_inside_the_kernels_compiles_like_the_full_one(policy, kernel, head_dim, d_in):
    """`D_IN`: the columns past the inputs' head dim masked in every load and store. SFA's kernels, native and
    emulated, compiled as a launch in a model's layout specialises them (strides that are multiples of d_in: at 40
    not divisible by 16, so known as multiples of 8 through `STRIDE8` alone), do the full head dim's float work on
    its layouts, op for op (so at the same tile a padded call's bits are padding by hand's), with its tensor-core
    products in the same order (wgmmas asynchronous), at most 16 bytes more spilled (natively on an 8-warp candidate
    tile; at D = 128 every dK/dV tile with pointer loads spills 24-1504 bytes at either width), and global loads and
    stores as wide as the full head dim's, one for one."""
    if policy == "paper":
        config = tuning.emulation_config(False, head_dim)
    elif head_dim == 256:
        config = {"fwd": tuning.WIDE_FWD_CONFIGS, "dq": tuning.WIDE_DQ_CONFIGS, "dkdv": tuning.WIDE_DKDV_CONFIGS}[kernel][0]
    else:
        config = {"fwd": tuning.config(128, 64, 8, 3), "dq": tuning.config(128, 64, 8, 3),
                  "dkdv": tuning.config(64, 128, 8, 3)}[kernel]
    if policy == "fa2":  # the native kernels' tiles carry the load path: pointers (no TMA where padded)
        config = triton.Config({**config.kwargs, "TMA": False}, num_warps=config.num_warps,
                               num_stages=config.num_stages)
    name = _name(policy, SFA(), head_dim)
    consts = constexprs(name, kernel, head_dim, config)
    whole = compile_kernel(name, kernel, consts, config)
    as_launched = {"D_IN": d_in} if d_in % 16 == 0 else {"D_IN": d_in, "STRIDE8": True}  # `launch._head_dims`
    compiled = compile_kernel(name, kernel, {**consts, **as_launched}, config, strides16=d_in % 16 == 0)
    assert _float_work(compiled) == _float_work(whole)
    # the tensor-core products the full head dim makes, in the same order (the emulation's 32x32 tiles at D = 256:
    # mma, not wgmma)
    assert _tensor_core_products(whole) and _tensor_core_products(compiled) == _tensor_core_products(whole)
    assert wgmma_serialization(compiled) is None
    usage, full = resource_usage(compiled), resource_usage(whole)
    assert usage["registers"] <= 255 and usage["spill_stack_bytes"] <= full["spill_stack_bytes"] + 16, (usage, full)
    assert memory_instructions(compiled) == memory_instructions(whole)


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_without_stride8_a_head_dim_of_40_loads_in_another_layout(kernel):
    """What `STRIDE8` is for: strides like 40, which Triton cannot prove divisible by 16, lay the native kernels'
    loads out one 16-bit value per thread, so they add in another order than the full head dim's (these kernels sum
    rows: δ, the softmax's row sums) and load narrower."""
    config = {"fwd": tuning.config(128, 64, 8, 3), "dq": tuning.config(128, 64, 8, 3),
              "dkdv": tuning.config(64, 128, 8, 3)}[kernel]
    config = triton.Config({**config.kwargs, "TMA": False}, num_warps=config.num_warps, num_stages=config.num_stages)
    name = _name("fa2", SFA(), 64)
    consts = constexprs(name, kernel, 64, config)
    whole = compile_kernel(name, kernel, consts, config)
    unhinted = compile_kernel(name, kernel, {**consts, "D_IN": 40}, config, strides16=False)
    assert _float_work(unhinted) != _float_work(whole)
    assert memory_instructions(unhinted) != memory_instructions(whole)


_FLOAT_OP = re.compile(r"= (arith\.(?:add|sub|mul|div|max\w*|min\w*|neg|trunc|ext)f|math\.\w+|tt\.reduce|tt\.dot|"
                       r"ttng\.warp_group_dot\w*|ttg\.convert_layout)\b.*?: (.*?) loc\(")


def _float_work(compiled) -> list[tuple[str, str]]:
    """A kernel's float operations, reductions, products and layout conversions in program order (Triton's GPU IR),
    each with its operand and result types, layouts written out (the IR's layout names number them as met)."""
    ir = compiled.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (.*)$", ir, re.MULTILINE))
    return [(op, re.sub(r"#\w+", lambda m: layouts.get(m[0], m[0]), re.sub(r"%[\w#]+", "", types)))
            for op, types in _FLOAT_OP.findall(ir)]


def _tensor_core_products(compiled) -> list[str]:
    """A kernel's tensor-core instructions (wgmma or mma, with their shapes and types), in the PTX's order."""
    return re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", compiled.asm["ptx"])


_GLOBAL_ATOMIC = re.compile(r"^\s*(@%p\d+\s+)?(red|atom)(\.\w+)*\.global\.", re.MULTILINE)


@pytest.mark.parametrize("head_dim, tma", [(64, False), (128, False), (128, True)])
@pytest.mark.parametrize("group", [1, 4])
def test_the_dkdv_program_adding_dq_with_atomics_compiles_for_sm90(head_dim, tma, group):
    """`KernelOptions.atomic_dq`: the dK/dV program's third product (dSᵀ·K) and its fp32 atomic adds compile, the
    wgmmas stay asynchronous, and registers stay within the SM's."""
    config = tuning.config(64, 128, 8, 3, TMA=tma) if head_dim == 128 else tuning.config(32, 128, 4, 3, TMA=tma)
    name = _name("fa2", head_dim=head_dim)
    consts = {**constexprs(name, "dkdv", head_dim, config), "GROUP": group}
    plain = compile_kernel(name, "dkdv", consts, config).asm["ptx"]
    ptx = (compiled := compile_kernel(name, "dkdv", {**consts, "ATOMIC_DQ": True}, config)).asm["ptx"]
    assert _GLOBAL_ATOMIC.search(ptx) and not _GLOBAL_ATOMIC.search(plain)
    assert "wgmma.mma_async" in ptx and wgmma_serialization(compiled) is None
    assert 0 < resource_usage(compiled)["registers"] <= 255


def test_the_global_atomic_pattern_tells_an_atomic_from_a_copy():
    assert _GLOBAL_ATOMIC.search("\t@%p3 red.relaxed.gpu.global.add.f32 [%rd1], %r2;")
    assert _GLOBAL_ATOMIC.search("  atom.global.gpu.acq_rel.add.f32 %r1, [%rd1], %r2;")
    assert not _GLOBAL_ATOMIC.search("\t@%p1 cp.async.ca.shared.global [ %r1 + 0 ], [ %rd2 + 0 ], 0x10, %r3;")


@pytest.mark.parametrize("head_dim, paged, uniform, softcap", [(128, False, True, False), (128, True, False, False),
                                                              (80, False, False, True), (256, True, True, False)])
def test_the_decoding_kernels_compile_for_sm90(head_dim, paged, uniform, softcap, monkeypatch):
    """The split-KV decoding kernel (GQA: 4 query heads per program) and its combine: they compile for sm_90, with
    tensor-core products and pipelined (cp.async) loads, the split kernel without spilling (the combine keeps 8 bytes
    of stack at D = 256)."""
    import offline_compile

    from stableflash.attention.triton import decoding

    for name, kind in {"O_PART": "*fp32", "LSE_PART": "*fp32", "FIRST": "*i64", "CACHE_ROWS": "*i64",
                       "TABLE": "*i32", "OUT": "*bf16", "SEEN": "i32" if uniform else "*i64"}.items():
        monkeypatch.setitem(offline_compile._POINTERS, name, kind)
    block_n, block_d = decoding._tiles(head_dim)
    split = compile_function(decoding._decode_split, {
        "GROUP": 4, "HEAD_DIM": head_dim, "BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_D": block_d, "PAGED": paged,
        "SOFTCAP": softcap, "UNIFORM": uniform}, {"num_warps": 4, "num_stages": 3})
    assert "mma" in split.asm["ptx"] and "cp.async" in split.asm["ptx"]
    assert resource_usage(split)["spill_stack_bytes"] == 0, resource_usage(split)
    combine = compile_function(decoding._decode_combine, {"HEAD_DIM": head_dim, "BLOCK_S": 16, "BLOCK_D": block_d},
                               {"num_warps": 4})
    assert resource_usage(combine)["spill_stack_bytes"] <= 8, resource_usage(combine)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_grouped_dkdv_program_compiles_like_mhas(head_dim):
    """GQA's dK/dV program sums its group of 4 query heads in one loop over (query head, query tile) pairs: its wgmmas
    stay asynchronous and it needs no more registers or spills than MHA's program at the same tile. (A loop per head
    around the tile loop serialised every wgmma and took 255 registers against MHA's 159 at 32x64, D = 64.)"""
    config = tuning.config(32, 64, 4, 3, TMA=False)
    name = _name("fa2", head_dim=head_dim)
    usage = {}
    for group in (1, 4):
        compiled = compile_kernel(name, "dkdv", {**constexprs(name, "dkdv", head_dim, config), "GROUP": group}, config)
        assert wgmma_serialization(compiled) is None, f"GROUP {group}"
        usage[group] = resource_usage(compiled)
    assert usage[4]["registers"] <= usage[1]["registers"] + 16, usage
    assert usage[4]["spill_stack_bytes"] <= usage[1]["spill_stack_bytes"], usage


@pytest.mark.parametrize("stabilize", [None, SFA()])
def test_native_forward_scales_scores_without_contraction(stabilize):
    """Scores are fl(qk·scale) before exp2(s − m): contracted into exp2(fma(qk, scale, −m)), a row's maximum gets the
    rounding residual of m, and exp2 of it overflows from scores of ~2^31. A contraction per score would put at least
    one `fma.rn.f32` per score a thread holds into the PTX."""
    ptx = _compile("fa2", "fwd", tuning.config(64, 64, 4, 3, TMA=False), stabilize).asm["ptx"]
    assert len(re.findall(r"\bfma\.rn\.f32", ptx)) < 64 * 64 // (4 * 32)


@pytest.mark.parametrize("preset", ["paper", "fp32"])
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_emulated_kernels_round_every_product(preset, kernel):
    """Under emulation a product and the sum after it are two roundings, as in the reference; an FMA makes them one.
    (libdevice's exp and log keep their own `fma.rn.ftz`, part of computing them.)"""
    ptx = _compile(preset, kernel, tuning.emulation_config(preset == "fp32", 64)).asm["ptx"]
    assert not re.findall(r"\bfma\.rn\.f32", ptx)


@pytest.mark.parametrize("preset", ["paper", "bf16"])
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_the_masked_emulation_kernels_compile_for_sm90(preset, kernel):
    """The emulation kernels' masked form (a band and key padding), still rounding every product on its own."""
    config = tuning.emulation_config(False, 64)
    name = _name(preset)
    consts = {**constexprs(name, kernel, 64, config, causal=False, stats=kernel == "fwd"), "MASK": True, "PAD": True}
    ptx = compile_kernel(name, kernel, consts, config).asm["ptx"]
    assert not re.findall(r"\bfma\.rn\.f32", ptx)


def _hopper_launches():
    """(head dim, SFA, statistics, tile) for every Gluon forward `launch.forward` runs on sm_90."""
    return [(head_dim, sfa, stats, choice.tile) for (head_dim, softmax_work), choice in hopper.FORWARD_TILES.items()
            if choice is not None for sfa, stats in ([(True, True), (True, False), (False, True)] if softmax_work
                                                     else [(False, False)])]


@pytest.mark.parametrize("head_dim,sfa,stats,tile", _hopper_launches())
def test_the_gluon_forwards_launches_compile_unserialised(head_dim, sfa, stats, tile):
    """Each tile of `hopper.FORWARD_TILES`, with the constants `launch.forward` gives it: compiled for sm_90, the
    wgmmas stay asynchronous, no spills, within the H200's shared memory."""
    from triton.experimental.gluon._runtime import GluonASTSource

    name = _name("fa2", SFA() if sfa else None, head_dim)
    consts, config = launch._hopper_constants(name, head_dim, torch.bfloat16, True, tile, stats)
    compiled = compile_function(hopper._attn_fwd, {**consts, "num_warps": config.num_warps},
                                {"num_warps": config.num_warps}, source_type=GluonASTSource)
    assert wgmma_serialization(compiled) is None
    usage = resource_usage(compiled)
    assert usage["spill_stack_bytes"] == 0 and usage["shared_bytes"] <= 232_448


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("variant", ["paper+pv-e8m4-tz", "paper+stats-e8m5-tz", "paper+pv-e8m4-sr"])
def test_narrow_formats_and_toward_zero_compile_for_sm90(variant, kernel):
    """The e8mX, toward-zero and stochastic roundings are integer operations on the fp32 bits (the stochastic one's
    random bits a uint32 hash): they compile for the GPU, and the emulation kernels still round every product on
    its own."""
    from tests.attention.variants import emulated_variant

    name = spec_name(emulated_variant(variant), None, torch.bfloat16, 64, 4096)
    config = tuning.emulation_config(False, 64)
    ptx = compile_kernel(name, kernel, constexprs(name, kernel, 64, config), config).asm["ptx"]
    assert not re.findall(r"\bfma\.rn\.f32", ptx)


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("arm", ["B3", "C3", "B3-sfa-official"])
def test_the_bias_vs_noise_arms_compile_for_sm90(arm, kernel):
    """The study's kernels (docs/bias-vs-noise.md): V's operand and P̄V in e8m3, P̄V stochastic in C, the official SFA
    rule, each forward with the statistics (biasable rows); every product still rounded on its own."""
    from stableflash.diagnose.condition import arm_policy

    stabilize = SFA.official() if arm.endswith("official") else None
    name = spec_name(arm_policy(arm[:2]), stabilize, torch.bfloat16, 64, 4096)
    config = tuning.emulation_config(False, 64)
    ptx = compile_kernel(name, kernel, constexprs(name, kernel, 64, config, stats=kernel == "fwd"), config).asm["ptx"]
    assert not re.findall(r"\bfma\.rn\.f32", ptx)


def test_triton_warp_specialises_a_loop_only_in_the_forms_the_study_found():
    """`research/warp_specialize_forms.py`'s table, on the triton installed: 4 warps and the loop-invariant operand by
    a descriptor specialise; that operand by pointers fails the pass; 8 warps compile unspecialised. Should Triton
    lift a limit, this fails, and the dK/dV patch's premise (results/kernel-variants/) is to be measured again."""
    from warp_specialize_forms import FORMS, compiles_specialised

    assert compiles_specialised(FORMS["invariant tile by a descriptor"], 4) == "specialised"
    assert compiles_specialised(FORMS["invariant tile by pointers"], 4) == "fails"
    assert compiles_specialised(FORMS["invariant tile by a descriptor"], 8) == "not specialised"
