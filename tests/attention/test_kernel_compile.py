"""The kernels compile for the H200 (sm_90) on any machine, no GPU needed, and every launch gives each
kernel parameter a value.

Guards what the interpreter cannot see: Triton's compiler rejected the fp32-operand variant on the GPU
(an early `return` under a constexpr `if` left a bf16 dot of fp32 operands in the compiled code), while
the interpreter ran it fine; and the GPU launch cache once failed on a parameter left at its default.
"""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from stableflash import SFA  # noqa: E402
from stableflash.attention.precision import resolve  # noqa: E402
from stableflash.attention.triton import offline, ops  # noqa: E402
from stableflash.attention.triton.offline import compile_function, compile_kernel, constexprs, resource_usage  # noqa: E402
from stableflash.attention.triton.spec import build_spec  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("policy, kernel, config", [
    ("fp32", "fwd", ops._EMU_CONFIG), ("fp32", "dkdv", ops._EMU_CONFIG), ("fp32", "dq", ops._EMU_CONFIG),
    ("fa2+dp_p", "delta_dpp", ops._EMU_CONFIG), ("paper+dp_p", "delta_dpp", ops._EMU_CONFIG),
    ("fa2", "fwd", ops._FWD_CONFIGS[0]),
])
def test_kernel_compiles_for_sm90(policy, kernel, config):
    name, _, knob = policy.partition("+")
    pol = resolve(name).with_delta("dp_p") if knob else resolve(name)
    key = ops.register_spec(build_spec(pol, None, torch.bfloat16, 1000))
    usage = resource_usage(compile_kernel(kernel, constexprs(key, kernel, 64, config), config))
    assert 0 < usage["registers"] <= 255


def _ptx(preset: str, stabilize, kernel: str, config) -> str:
    """The sm_90 PTX of one kernel for a preset at D = 64, T = 4096."""
    key = ops.register_spec(build_spec(resolve(preset), stabilize, torch.bfloat16, 4096))
    return compile_kernel(kernel, constexprs(key, kernel, 64, config), config).asm["ptx"]


@pytest.mark.slow
@pytest.mark.parametrize("kernel, config", [("fwd", ops._cfg(128, 128, 8, 3)), ("dkdv", ops._DKDV_CONFIGS[0]),
                                            ("dq", ops._DQ_CONFIGS[0])])
def test_native_kernels_keep_wgmmas_asynchronous(kernel, config):
    """ptxas runs a kernel's wgmmas one after another when it cannot prove a register read outside their lifetime
    (the Gluon study's first schedule did); Triton's own kernels must not be among them. SFA + statistics at D = 128,
    the heaviest of the native specialisations."""
    key = ops.register_spec(build_spec(resolve("fa2"), SFA(), torch.bfloat16, 4096))
    compiled = compile_kernel(kernel, constexprs(key, kernel, 128, config, stats=kernel == "fwd"), config)
    assert "wgmma.mma_async" in compiled.asm["ptx"] and offline.wgmma_serialization(compiled) is None


@pytest.mark.slow
def test_offline_compile_specialises_like_a_launch():
    """Without the launch's alignment hints Triton loads scalars and skips the cp.async pipeline, and the resource
    figures describe code the GPU never runs (they did until 2026-11-30)."""
    ptx = _ptx("fa2", None, "fwd", ops._cfg(128, 64, 8, 3))
    assert "cp.async" in ptx and "ld.global.b16" not in ptx


@pytest.mark.slow
@pytest.mark.parametrize("stabilize", [None, SFA()])
def test_native_forward_scales_scores_without_contraction(stabilize):
    """Scores are fl(qk·scale) before exp2(s − m): contracted into exp2(fma(qk, scale, −m)), a row's maximum gets the
    rounding residual of m, and exp2 of it overflows from scores of ~2^31 (NaN in unmasked tiles until 2026-11-30).
    A contraction per score puts at least one `fma.rn.f32` per score a thread holds into the PTX."""
    ptx = _ptx("fa2", stabilize, "fwd", ops._cfg(64, 64, 4, 3))
    scores_per_thread = 64 * 64 // (4 * 32)
    assert len(re.findall(r"\bfma\.rn\.f32", ptx)) < scores_per_thread


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["paper", "fp32"])
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_emulated_kernels_round_every_product(preset, kernel):
    """Under emulation a product and the sum after it are two roundings, as in the reference; an FMA makes them one.
    Triton contracts wherever a policy keeps a site in fp32 (`_round` is then the identity) unless the product is
    `mul.rn`; it did at 64-124 sites per kernel until 2026-11-30. (libdevice's exp and log keep their own
    `fma.rn.ftz`, part of computing them.)"""
    ptx = _ptx(preset, None, kernel, ops._emu_config(preset == "fp32", 64))
    assert not re.findall(r"\bfma\.rn\.f32", ptx)


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("precision,stabilize,stats", [("fa2", None, False), ("fa2", "sfa", True),
                                                       ("paper", "sfa", True), ("paper+dp_p", None, False)])
def test_every_launch_gives_each_kernel_parameter_a_value(precision, stabilize, stats, head_dim):
    """The contract the GPU launch cache and inductor's tracing rely on (neither runs under the interpreter): each
    launch passes the kernel's runtime arguments positionally and every compile-time one by name, the tile or a
    default. Checked on recorded launches, without running a kernel. At D = 128 the native kernels' tiles also
    choose the load path (pointers or TMA), so the launch leaves TMA to them."""
    policy = resolve("paper").with_delta("dp_p") if precision == "paper+dp_p" else resolve(precision)
    key = ops.register_spec(build_spec(policy, SFA() if stabilize else None, torch.bfloat16, 100))
    launches = []
    record = lambda tuned, plain, grid, *args, config=None, **meta: launches.append((tuned, plain, grid, args, meta, config))  # noqa: E731
    q, k, v, dout = (torch.randn(2, 3, 100, head_dim, dtype=torch.bfloat16) for _ in range(4))
    out, _, lse, _, _ = ops.forward(q, k, v, True, 0.25, key, stats, 1e-3, launch=record)
    ops.backward(dout, q, k, v, out, lse, True, 0.25, key, launch=record)
    assert len(launches) == (4 if precision == "paper+dp_p" else 3)
    either = precision == "fa2" and head_dim == 128
    for tuned, plain, grid, args, meta, config in launches:
        if tuned is not None:
            assert {c.kwargs.get("TMA") for c in tuned.configs} == ({False, True} if either else {None})
            assert ("TMA" in meta) != either
        tile = config or (tuned.configs[0] if tuned is not None else ops._cfg(64, 64, 4, 3))
        assert not [p.name for p in plain.params[:len(args)] if p.is_constexpr], "a compile-time argument passed by position"
        assert set(meta) <= set(plain.arg_names), "an argument the kernel does not take"
        # inductor's wrap_triton rejects a launch that leaves a parameter to its default (it did on 2026-11-30)
        assert set(plain.arg_names[len(args):]) <= set(meta) | set(tile.kwargs), "a parameter left to its default"
        assert len(ops.trailing_constexprs(plain, len(args), meta, tile)) == len(plain.arg_names) - len(args)
        dims = grid(tile.kwargs)
        assert len(dims) == 2 and all(isinstance(d, int) and d > 0 for d in dims)


def test_tma_streamable_needs_16_byte_aligned_rows():
    """TMA descriptors need 16-byte aligned bases and strides: a model's heads qualify, a misaligned view does not
    (the launch then keeps pointer loads rather than letting the autotuner pick TMA)."""
    B, T, H, D = 2, 77, 3, 128
    qkv = torch.randn(B, T, 3 * H * D, dtype=torch.bfloat16)
    heads = [t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2)]
    assert ops.tma_streamable(*heads)
    assert ops.tma_streamable(torch.randn(B, H, T, D, dtype=torch.bfloat16))
    shifted = torch.randn(B * H * T * D + 1, dtype=torch.bfloat16)[1:].view(B, H, T, D)  # base 2 bytes past 16
    assert not ops.tma_streamable(shifted)
    odd_rows = torch.randn(B, H, T, D + 4, dtype=torch.bfloat16)[..., :D]  # row stride 264 bytes
    assert not ops.tma_streamable(odd_rows)


def _study(name: str):
    """A study script of benchmarks/ as a module."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("head_dim,causal,loader_warp,sfa,stats,tile", [
    (64, True, False, False, False, None), (128, True, False, False, False, None),
    (128, False, False, False, False, None), (128, True, True, False, False, None), (64, True, False, True, False, None),
    (64, True, True, True, True, None), (128, True, False, True, True, None),
    (128, True, False, True, True, (64, 64, 3, 4, True)), (64, True, False, False, False, (64, 128, 3, 4, True)),
    (128, True, False, False, False, (128, 128, 3, 4, True, True)), (64, False, False, True, True, (128, 128, 4, 4, True, True))])
def test_gluon_forward_study_keeps_wgmmas_in_flight_across_the_softmax(head_dim, causal, loader_warp, sfa, stats, tile):
    """The Gluon study (benchmarks/gluon_forward.py) compiles for sm_90 without spills, within the H200's shared
    memory; its key loop issues S_{j+1} and P̄_jV_j, waits for S_{j+1} alone and leaves P̄_jV_j running through the
    next softmax, and ptxas keeps the wgmmas asynchronous: the overlap Triton's language cannot express
    (docs/kernel-notes.md). A partial wait across the loop's back edge made ptxas serialise them all (C7514)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    study = _study("gluon_forward")
    tile = study.Tile(*tile) if tile else study.tile_for(head_dim)
    consts, _ = study.launch_constants(head_dim, torch.bfloat16, 4096, causal, loader_warp, SFA() if sfa else None,
                                       1e-3 if stats else None, tile)
    compiled = compile_function(study._attn_fwd_hopper, consts, {"num_warps": consts["num_warps"]},
                                source_type=GluonASTSource)
    ptx = compiled.asm["ptx"]
    assert offline.wgmma_serialization(compiled) is None
    # per computing warpgroup pair or group: groups S_0 (prologue), S_{j+1} and P̄_jV_j (loop), the last P̄V; waits:
    # prologue, two in the loop (one of them partial: P̄_jV_j through the softmax), the end
    pingpong = tile.pingpong
    copies = 2 if pingpong else 1  # the computing code, once per computing partition
    waits = sorted(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx))
    assert ptx.count("wgmma.commit_group") == 4 * copies and waits == sorted(["0", "0", "0", "1"] * copies)
    assert "cp.async.bulk.tensor" in ptx  # K and V by TMA
    # with a loader warp, the computing warps synchronise among themselves only (a named barrier of 256 threads);
    # with pingpong each warpgroup is a partition of its own (a named barrier of 128 threads each)
    assert ("bar.sync \t0, 256;" in ptx) == (loader_warp and not pingpong)
    assert (len(set(re.findall(r"bar\.sync \t(\d+), 128;", ptx))) == 2) == pingpong
    # SFA's pair reduction adds min/max work per score: about 6.5 per score a thread holds, 2.1 for the row maximum
    scores_per_thread = tile.block_m // copies * tile.block_n // (32 * tile.warps)
    assert (len(re.findall(r"\b(?:max|min)(?:\.NaN)?\.f32", ptx)) > 4 * scores_per_thread * copies) == sfa
    assert ("atom.global" in ptx or "red.global" in ptx) == stats  # the statistics' per-head counters
    usage = resource_usage(compiled)
    assert usage["spill_stack_bytes"] == 0 and usage["shared_bytes"] <= 232_448


def _ops_hopper_launches():
    """(head dim, SFA, statistics, tile) for every Gluon forward `ops.forward` launches on sm_90."""
    return [(head_dim, sfa, stats, choice.tile) for (head_dim, softmax_work), choice in ops.hopper.FORWARD_TILES.items()
            if choice is not None for sfa, stats in ([(True, True), (True, False), (False, True)] if softmax_work
                                                     else [(False, False)])]


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,sfa,stats,tile", _ops_hopper_launches())
def test_the_gluon_forwards_ops_launches_compile_unserialised(head_dim, sfa, stats, tile):
    """Each tile of `hopper.FORWARD_TILES`, with the constants `ops.forward` gives it: compiled for sm_90, the wgmmas
    stay asynchronous, no spills, within the H200's shared memory."""
    from triton.experimental.gluon._runtime import GluonASTSource

    spec = build_spec(resolve("fa2"), SFA() if sfa else None, torch.bfloat16, 4096)
    assert ops.hopper_forward_tile(spec, head_dim, stats, 4096) == tile
    consts, config = ops._hopper_constants(ops.register_spec(spec), head_dim, torch.bfloat16, True, tile, stats)
    compiled = compile_function(ops.hopper._attn_fwd_hopper, {**consts, "num_warps": config.num_warps},
                                {"num_warps": config.num_warps}, source_type=GluonASTSource)
    assert offline.wgmma_serialization(compiled) is None
    usage = resource_usage(compiled)
    assert usage["spill_stack_bytes"] == 0 and usage["shared_bytes"] <= 232_448


def test_ops_choose_the_gluon_forward_for_production_numerics_only():
    """The Gluon forward takes `fa2` numerics, plain or SFA, at the head dims and from the lengths its table names;
    emulated presets, ClampPbar, an fp32 saved O, other head dims and shorter rows keep the Triton forward."""
    from stableflash import ClampPbar

    def tile(precision="fa2", stabilize=None, head_dim=128, stats=False, T=4096):
        policy = resolve(precision) if isinstance(precision, str) else precision
        return ops.hopper_forward_tile(build_spec(policy, stabilize, torch.bfloat16, T), head_dim, stats, T)

    table = ops.hopper.FORWARD_TILES
    assert tile() == table[128, False].tile and tile(stabilize=SFA()) == table[128, True].tile
    assert tile(head_dim=64) == table[64, False].tile and table[64, True] is None
    assert tile(head_dim=64, stabilize=SFA()) is None and tile(head_dim=64, stats=True) is None
    # measured faster from T = 4096; at (16,12,1024,64) slower, elsewhere below 4096 not compared in one run
    assert tile(T=2048) is None and tile(head_dim=64, T=2048) is None and tile(stabilize=SFA(), T=2048) is None
    assert tile(head_dim=32) is None and tile(head_dim=16) is None
    assert tile("paper") is None and tile("bf16") is None and tile(stabilize=ClampPbar()) is None
    assert tile(resolve("fa2").with_o_fp32()) is None


def _compiled_backward_study(kernel: str, causals=(True, False)):
    """The Gluon backward study's `kernel` compiled for sm_90 at every tile it times (bf16), with what every one of
    them must show: wgmmas asynchronous, within the H200's shared memory. Yields (head dim, tile, PTX)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    study = _study("gluon_backward")
    for head_dim, tiles in study.TILES[kernel].items():
        for tile in tiles:
            for causal in causals:
                consts = study.launch_constants(kernel, head_dim, torch.bfloat16, causal, tile)
                compiled = compile_function(study.KERNELS[kernel], consts, {"num_warps": tile.warps},
                                            source_type=GluonASTSource)
                assert offline.wgmma_serialization(compiled) is None, (kernel, head_dim, str(tile))
                assert resource_usage(compiled)["shared_bytes"] <= 232_448
                yield head_dim, tile, compiled.asm["ptx"]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_gluon_backward_study_keeps_its_wgmmas_asynchronous(kernel):
    """The Gluon backward study (benchmarks/gluon_backward.py) compiles for sm_90 at every tile it times, causal and
    not: per streamed tile it issues S and dP together, waits for S alone, then for dP, issues the accumulating
    matmuls (dV, dK; or dQ) and retires everything in the same iteration; pipelined, the next tile's S and dP go with
    them. ptxas keeps the wgmmas asynchronous, within the H200's shared memory (spills are for the GPU run to show:
    D = 128 at 64 streamed rows needs all 255 registers for dK and dV)."""
    groups = 2 + (2 if kernel == "dkdv" else 1)  # S, dP and the accumulating matmuls
    for _, tile, ptx in _compiled_backward_study(kernel):
        # once in the loop, and (pipelined) once more around it
        assert ptx.count("wgmma.commit_group") == groups * (2 if tile.pipelined else 1)
        waits = sorted(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx))
        if tile.pipelined:  # prologue: S, dP; loop: S, dP, all; after it: all
            assert waits == sorted(["1", "0", str(groups - 1), str(groups - 2), "0", "0"])
        else:  # S; dP (dV's matmul may run on) or dP; all
            assert waits == (["0", "1", "1"] if kernel == "dkdv" else ["0", "0", "1"])


@pytest.mark.slow
def test_gluon_one_kernel_backward_adds_dq_by_vector_atomics():
    """The study's one-kernel backward compiles for sm_90 at every tile it times: five matmuls per query tile (Sᵀ and
    dPᵀ, then dV, dK and dQ), ptxas keeps them asynchronous, dQ goes out by `red.global.add.v4.f32` (a quarter of
    the scalar atomics), within the H200's shared memory; its timing-only ablations drop what they say. The kernel
    itself asserts, at compile time, that four consecutive registers of dQ's accumulator are the group its buffer
    lays out side by side."""
    from triton.experimental.gluon._runtime import GluonASTSource

    for head_dim, tile, ptx in _compiled_backward_study("one"):
        assert ptx.count("wgmma.commit_group") == 5
        groups_per_thread = tile.streamed * head_dim // (32 * tile.warps) // 4  # dQ's tile, 4 per group
        assert ptx.count("red.global.add.v4.f32") == groups_per_thread, (head_dim, str(tile))
        assert "atom.global" not in ptx
    # the timing-only ablations leave out the atomics, then dQ's matmul (and dSᵀ's store)
    study = _study("gluon_backward")
    for work, matmuls in ((2, 5), (1, 4), (0, 4)):
        consts = study.launch_constants("one", 64, torch.bfloat16, True, study.Tile(64, 64, 3), work)
        ptx = compile_function(study.KERNELS["one"], consts, {"num_warps": 4}, source_type=GluonASTSource).asm["ptx"]
        assert ptx.count("wgmma.commit_group") == matmuls and "red.global" not in ptx


@pytest.mark.slow
def test_gluon_one_kernel_backward_with_a_reducer_warp_compiles_unserialised():
    """The one-kernel backward with dQ's reduction off the math warps (study kind "one-ws") compiles for sm_90 at
    every tile it times, its five matmuls asynchronous, within the H200's shared memory: with reducer warps, these
    add dQ by `red.v4` (four contiguous columns a lane) and registers are redistributed (240 or 256 for the math
    warps, 32 for the reducer); without, the math warps issue a TMA reduction per tile and wait only for it to have
    read its buffer."""
    for _, tile, ptx in _compiled_backward_study("one-ws", causals=(True,)):
        assert ptx.count("wgmma.commit_group") == 5
        if tile.reducer_warps == 0:  # TMA reductions from the math warps: no reducer, no atomics
            assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in ptx
            assert "cp.async.bulk.wait_group.read" in ptx and "red.global" not in ptx and "setmaxnreg" not in ptx
            continue
        assert "red.global.add.v4.f32" in ptx
        # the math warps raised to 240 registers (256 when they are one warpgroup), the reducer's set to 32
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(240|256);", ptx)
        assert re.search(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+32;", ptx)


def test_one_kernel_dq_buffer_returns_to_row_order():
    """`dq_from_fragments` undoes the fragment order the one-kernel backward adds dQ in: element (r, c), r = 16a +
    8b + g and c = 8j + 2t + e, at a·16D + 128j + 4(4g + t) + 2b + e of its head's buffer; first T rows, scaled."""
    study = _study("gluon_backward")
    heads, t_acc, head_dim, T = 3, 128, 64, 77
    want = torch.randn(heads, t_acc, head_dim)
    r = torch.arange(t_acc)[:, None]
    c = torch.arange(head_dim)[None, :]
    index = (r // 16) * 16 * head_dim + (c // 8) * 128 + (4 * (r % 8) + (c % 8) // 2) * 4 + 2 * ((r // 8) % 2) + c % 2
    buffer = torch.empty(heads, t_acc * head_dim)
    buffer[:, index.flatten()] = want.flatten(1)
    got = study.dq_from_fragments(buffer.view(heads, t_acc, head_dim), T, 0.5, torch.float32)
    assert torch.equal(got, want[:, :T] * 0.5)


def test_traced_launches_hand_the_gluon_forward_to_the_opaque_op(monkeypatch):
    """Inductor launches only Triton kernels: where the Gluon forward would run, the traced forward (`triton_op`)
    calls the opaque op instead, which runs it as a node of its own; elsewhere, and for launchers other than ours
    (a caller's recorder), the Triton forward is launched as before. The choice itself is faked (no sm_90 here)."""
    key = ops.register_spec(build_spec(resolve("fa2"), None, torch.bfloat16, 100))
    q, k, v = (torch.randn(1, 2, 100, 64, dtype=torch.bfloat16) for _ in range(3))
    handed = []
    monkeypatch.setattr(ops, "flash_fwd", lambda *args: handed.append(args) or "opaque")
    launched = []
    record = lambda tuned, plain, grid, *args, config=None, **meta: launched.append(plain)  # noqa: E731
    monkeypatch.setattr(ops, "_traced_launch", record)
    monkeypatch.setattr(ops, "_hopper_tile", lambda *args: ops.hopper.FORWARD_TILES[64, False].tile)
    assert ops.forward(q, k, v, True, 0.125, key, False, 1e-3, launch=ops._traced_launch) == "opaque"
    assert len(handed) == 1 and handed[0][3:] == (True, 0.125, key, False, 1e-3) and not launched
    ops.forward(q, k, v, True, 0.125, key, False, 1e-3, launch=lambda *a, **kw: launched.append("caller's"))
    assert launched == ["caller's"] and len(handed) == 1
    monkeypatch.setattr(ops, "_hopper_tile", lambda *args: None)
    ops.forward(q, k, v, True, 0.125, key, False, 1e-3, launch=ops._traced_launch)
    assert launched == ["caller's", ops.kernels._attn_fwd] and len(handed) == 1
