"""Compile the fused kernels for a named GPU target on any machine, no GPU needed.

Triton lowers a kernel to a cubin for a given target anywhere; `cuobjdump -res-usage` (shipped in
Triton's wheel) reads its registers and spills. This answers "does this specialisation compile for
the H200 (sm_90)?" and "does it spill?" without device time (research/tests/test_kernel_compile.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from stableflash.attention.triton import emulation, native
from stableflash.attention.triton.spec import spec_named

SM90 = GPUTarget("cuda", 90, 32)
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
_POINTERS = {**{n: "*bf16" for n in ("Q", "K", "V", "O", "OS", "DO", "DK", "DV", "DQ")},
             **{n: "*fp32" for n in ("LSE", "DELTA", "STAT_MAX", "DQ_ACC")}, "STAT_COUNTS": "*i64", "KEEP": "*u8"}
_FLOATS = {"scale", "qk_scale", "eps", "softcap"}
KERNELS = {(True, "fwd"): native._attn_fwd, (True, "dq"): native._attn_bwd_dq, (True, "dkdv"): native._attn_bwd_dkdv,
           (False, "fwd"): emulation._attn_fwd, (False, "delta_dpp"): emulation._attn_bwd_delta_dpp,
           (False, "dq"): emulation._attn_bwd_dq, (False, "dkdv"): emulation._attn_bwd_dkdv}


def kernel_of(name: str, kernel: str):
    """The jit function `launch` runs as `kernel` ("fwd", "delta_dpp", "dq", "dkdv") for the spec `name`."""
    return KERNELS[spec_named(name).native, kernel]


def constexprs(name: str, kernel: str, head_dim: int, config: triton.Config, causal: bool = True,
               stats: bool = False) -> dict:
    """The compile-time arguments `launch` gives `kernel` for the registered spec `name` and a tile."""
    spec = spec_named(name)
    if kernel == "delta_dpp" and spec.delta_constants is None:
        raise ValueError(f"kernel: spec {name!r} computes δ inside the dQ kernel; it has no delta_dpp pass")
    own = {"fwd": {**spec.forward_constants, "STATS": stats}, "delta_dpp": spec.delta_constants,
           "dkdv": spec.dkdv_constants, "dq": spec.dq_constants}[kernel]
    return {**own, "HEAD_DIM": head_dim, "CAUSAL": causal, **config.kwargs}


def compile_kernel(name: str, kernel: str, consts: dict, config: triton.Config, target: GPUTarget = SM90,
                   strides16: bool = True, divisible: dict[str, bool] | None = None):
    """Compile one kernel specialisation for `target`; raises Triton's CompilationError if it does not compile.

    Specialised as a launch on a GPU specialises it: every pointer 16-byte aligned, every stride and logical tile
    length divisible by 16 (true for torch's allocations at head dims 64 and 128), and T too (as at T = 4096).
    Without these hints Triton can prove no alignment, loads scalar 16-bit values and skips the cp.async pipeline,
    so registers, spills and shared memory come out unlike the code the GPU runs. With `strides16` False the
    tensors' strides are not known divisible by 16, as a launch specialises those of a head dim like 40. `divisible`
    overrides the hint per runtime argument (a tuple's elements by their `_elements` names: {"T": False, "TK": True})."""
    return compile_function(kernel_of(name, kernel), consts, {"num_warps": config.num_warps, "num_stages": config.num_stages},
                            target, strides16=strides16, divisible=divisible)


_BUNDLES = {"band": ("KEEP", "stride_keep", "TK", "LEFT", "RIGHT")}
"""The kernels' tuple parameters that are not a tensor's strides, by their elements' names."""


def _elements(name: str) -> tuple[str, ...] | None:
    """The element names of a tuple parameter (`x_strides`: a tensor's three strides), None for a plain one."""
    if name.endswith("_strides"):
        return tuple(f"stride_{name[:-len('_strides')]}{i}" for i in range(3))
    return _BUNDLES.get(name)


def _kind(name: str) -> str:
    return _POINTERS.get(name, "fp32" if name in _FLOATS else "i32")


def _divisible(name: str, kind: str, strides16: bool = True, divisible: dict[str, bool] | None = None) -> bool:
    """Pointers, strides (not the key table's row stride; with `strides16` only) and lengths: 16-aligned, as a
    launch specialises them; `divisible` overrides by name."""
    if divisible and name in divisible:
        return divisible[name]
    stride = name.startswith("stride_") and name != "stride_keep"
    return kind.startswith("*") or stride and strides16 or name in ("T", "LT", "LQ", "LM")


def compile_function(fn, consts: dict, options: dict, target: GPUTarget = SM90, source_type=ASTSource,
                     strides16: bool = True, divisible: dict[str, bool] | None = None):
    """Compile a Triton (or, with Gluon's source type, a Gluon) kernel whose parameters follow our naming: pointers
    as in `_POINTERS`, the float scales in `_FLOATS`, every other runtime argument i32, tuples as `_elements` names
    them; hints as `compile_kernel`'s (`strides16` and `divisible` too)."""
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        elements = None if name in consts else _elements(name)
        if elements is None:
            signature[name] = "constexpr" if name in consts else _kind(name)
            if name not in consts and _divisible(name, signature[name], strides16, divisible):
                attrs[(index,)] = [["tt.divisibility", 16]]
            continue
        signature[name] = tuple(_kind(e) for e in elements)
        attrs.update({(index, i): [["tt.divisibility", 16]] for i, e in enumerate(elements)
                      if _divisible(e, _kind(e), strides16, divisible)})
    source = source_type(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    return triton.compile(source, target=target, options=options)


INSTRUCTION_START = r"^\s*(?:@!?%p\d+\s+)?"
"""Where a PTX instruction starts (re.MULTILINE): a line's indent and its predicate, negated or not."""


def memory_instructions(compiled) -> Counter:
    """How many of each global load, store and asynchronous copy (with its width) a kernel's PTX holds."""
    return Counter(re.findall(INSTRUCTION_START + r"((?:cp\.async\.c[ag]|ld\.global|st\.global)[\w.]*)",
                              compiled.asm["ptx"], re.MULTILINE))


def resource_usage(compiled) -> dict:
    """Registers per thread, spill (local stack) bytes and shared memory bytes of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([_CUOBJDUMP, "-res-usage", cubin.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", report)
    return {"registers": int(found[1]), "spill_stack_bytes": int(found[2]), "shared_bytes": compiled.metadata.shared}


def wgmma_serialization(compiled) -> str | None:
    """ptxas's reason for running every wgmma of a kernel one after another (its "Potential Performance Loss"
    notes, C7514/C7515: e.g. a register read it cannot prove outside an asynchronous wgmma's lifetime), or None if
    the wgmmas stay asynchronous. Triton's own compile hides these notes; a serialised kernel still runs
    correctly, only without the overlap its waits were written for."""
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([_PTXAS, "-v", f"-arch=sm_{compiled.metadata.target.arch}a", ptx, "-o",
                                 os.path.join(folder, "kernel.cubin")], capture_output=True, text=True)
    found = re.search(r"wgmma\.mma_async instructions are serialized due to (.*?) in the function",
                      report.stdout + report.stderr)
    return " ".join(found[1].split()) if found else None
