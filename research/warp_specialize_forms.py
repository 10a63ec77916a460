"""Which loop forms Triton's automatic warp specialisation accepts on sm_90, compiled offline (no GPU needed).

`tl.range(..., warp_specialize=True)` asks Triton to split a loop into a loader warp and computing warps, the
producer/consumer pipeline that issue 46 names for Hopper. Whether it does shows in the PTX: a specialised kernel
sets each warp group's register budget (`setmaxnreg`). Each form below is a toy of one trait of our dK/dV kernel
(`native._attn_bwd_dkdv`): a loop-invariant tile (K, V) that every product reads, streamed tiles (Q, dO) by TMA
descriptors, per-row vectors (log-sum-exp, δ) by pointers, and several loops over one stream (the causal
diagonal, the tiles below it, the ragged end).

With `--dkdv`, also our dK/dV kernel as the tree has it, at each candidate tile with TMA, D = 64 and 128, plain
and SFA: specialised or not, its registers and spills (results/kernel-variants/ holds a patch that merges its loops
into one specialised loop, to measure with this). With `--switches`, the kernel's other compile-time forms at each
candidate tile with TMA: causal or not, a key mask, padded key tags, dQ by atomics (the forms a call can reach,
which a specialised loop must survive too). Both compile the package on the path: run them in a patched copy of
the tree (PYTHONPATH=COPY) to study a patch.

    python research/warp_specialize_forms.py [--dkdv] [--switches] [--out results/kernel-variants/FILE.json]
"""

from __future__ import annotations

import argparse
import json

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
BLOCK = 64

FORMS = {
    "invariant tile by pointers": {"INVARIANT_TMA": False},
    "invariant tile by a descriptor": {"INVARIANT_TMA": True},
    "invariant tile by a descriptor, row vector by pointers": {"INVARIANT_TMA": True, "ROW_VECTOR": True},
    "two loops, the second specialised": {"INVARIANT_TMA": True, "TWO_LOOPS": True},
}


@triton.jit
def _form(A, B, L, C, N, BLOCK: tl.constexpr, INVARIANT_TMA: tl.constexpr, ROW_VECTOR: tl.constexpr,
          TWO_LOOPS: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK)
    if INVARIANT_TMA:
        a = tl.make_tensor_descriptor(A, [N * BLOCK, BLOCK], [BLOCK, 1], [BLOCK, BLOCK]).load([pid * BLOCK, 0])
    else:
        a = tl.load(A + (pid * BLOCK + rows[:, None]) * BLOCK + rows[None, :])
    stream = tl.make_tensor_descriptor(B, [N * BLOCK, BLOCK], [BLOCK, 1], [BLOCK, BLOCK])
    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
    start = 0
    if TWO_LOOPS:  # as the causal diagonal's tiles before the rest
        start = 1
        for i in range(0, 1):
            acc = tl.dot(a, stream.load([i * BLOCK, 0]), acc)
    for i in tl.range(start, N, warp_specialize=True):
        b = stream.load([i * BLOCK, 0])
        if ROW_VECTOR:
            b = (b.to(tl.float32) * tl.load(L + i * BLOCK + rows)[None, :]).to(b.dtype)
        acc = tl.dot(a, b, acc)
    tl.store(C + (pid * BLOCK + rows[:, None]) * BLOCK + rows[None, :], acc)


def _specialisation(compiled) -> str:
    """A specialised kernel sets its warp groups' register budgets (`setmaxnreg`); one warp group never does."""
    return "specialised" if "setmaxnreg" in compiled.asm["ptx"] else "not specialised"


def compiles_specialised(switches: dict, num_warps: int) -> str:
    """"specialised", "not specialised" (compiled as one warp group) or "fails" (Triton's pass raised)."""
    constexprs = {"BLOCK": BLOCK, "INVARIANT_TMA": False, "ROW_VECTOR": False, "TWO_LOOPS": False, **switches}
    signature = {"A": "*bf16", "B": "*bf16", "L": "*fp32", "C": "*fp32", "N": "i32",
                 **{name: "constexpr" for name in constexprs}}
    source = ASTSource(_form, signature=signature, constexprs=constexprs,
                       attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    try:
        compiled = triton.compile(source, target=SM90, options={"num_warps": num_warps, "num_stages": 3})
    except RuntimeError:  # the warp-specialisation pass failed (it prints its module to stderr)
        return "fails"
    return _specialisation(compiled)


def dkdv_rows() -> list[dict]:
    """Our dK/dV kernel at each candidate tile, streamed by TMA, causal, at T = 4096."""
    import torch
    from offline_compile import compile_kernel, constexprs, resource_usage

    from stableflash import SFA
    from stableflash.attention.precision import resolve
    from stableflash.attention.triton import tuning
    from stableflash.attention.triton.spec import spec_name

    rows = []
    for head_dim in (64, 128):
        for stabilize in (None, SFA()):
            name = spec_name(resolve("fa2"), stabilize, torch.bfloat16, head_dim, 4096)
            for tile in tuning.DKDV_CONFIGS:
                config = triton.Config({**tile.kwargs, "TMA": True}, num_warps=tile.num_warps,
                                       num_stages=tile.num_stages)
                row = {"head_dim": head_dim, "call": "sfa" if stabilize else "fa2", **tile.kwargs,
                       "num_warps": tile.num_warps, "num_stages": tile.num_stages}
                try:
                    compiled = compile_kernel(name, "dkdv", constexprs(name, "dkdv", head_dim, config), config)
                except RuntimeError:
                    rows.append({**row, "result": "fails"})
                    continue
                rows.append({**row, "result": _specialisation(compiled), **resource_usage(compiled)})
    return rows


SWITCHES = tuple({"CAUSAL": causal, "MASK": mask, "PAD": pad, "ATOMIC_DQ": atomic}
                 for causal in (True, False) for mask, pad in ((False, False), (True, False), (True, True))
                 for atomic in (False, True))


def dkdv_switch_rows() -> list[dict]:
    """Our plain dK/dV kernel at each candidate tile under TMA, D = 64 and 128, in each form of `SWITCHES`:
    specialised, not, or "fails" (the pass aborts, which at run time fails the call)."""
    import torch
    from offline_compile import compile_kernel, constexprs

    from stableflash.attention.precision import resolve
    from stableflash.attention.triton import tuning
    from stableflash.attention.triton.spec import spec_name

    rows = []
    for head_dim in (64, 128):
        name = spec_name(resolve("fa2"), None, torch.bfloat16, head_dim, 4096)
        for tile in tuning.DKDV_CONFIGS:
            config = triton.Config({**tile.kwargs, "TMA": True}, num_warps=tile.num_warps, num_stages=tile.num_stages)
            for switches in SWITCHES:
                consts = {**constexprs(name, "dkdv", head_dim, config), **switches}
                try:
                    result = _specialisation(compile_kernel(name, "dkdv", consts, config))
                except RuntimeError:
                    result = "fails"
                rows.append({"head_dim": head_dim, **tile.kwargs, "num_warps": tile.num_warps,
                             "num_stages": tile.num_stages, **switches, "result": result})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dkdv", action="store_true", help="also our dK/dV kernel at its candidate tiles")
    parser.add_argument("--switches", action="store_true",
                        help="also the dK/dV kernel's masks, padding and atomic dQ at its candidate tiles")
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args()
    rows = [{"form": form, "num_warps": warps, "result": compiles_specialised(switches, warps)}
            for form, switches in FORMS.items() for warps in (4, 8)]
    for row in rows:
        print(f"{row['form']:58s} {row['num_warps']} warps: {row['result']}")
    kernel = dkdv_rows() if args.dkdv else []
    for row in kernel:
        usage = f", {row['registers']} registers, {row['spill_stack_bytes']} B spilled" if "registers" in row else ""
        print(f"dK/dV D={row['head_dim']} {row['call']} {row['BLOCK_M']}x{row['BLOCK_N']} {row['num_warps']} warps "
              f"{row['num_stages']} stages: {row['result']}{usage}")
    switched = dkdv_switch_rows() if args.switches else []
    for row in switched:
        forms = " ".join(f"{k}={int(row[k])}" for k in ("CAUSAL", "MASK", "PAD", "ATOMIC_DQ"))
        print(f"dK/dV D={row['head_dim']} {row['BLOCK_M']}x{row['BLOCK_N']} {row['num_warps']} warps "
              f"{row['num_stages']} stages {forms}: {row['result']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"triton": triton.__version__, "target": "sm_90", "forms": rows, "dkdv": kernel,
                       "dkdv_switches": switched}, f, indent=1)


if __name__ == "__main__":
    main()
