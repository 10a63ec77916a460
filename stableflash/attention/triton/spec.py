"""`KernelSpec`: what the fused kernels are specialised on, derived from a `Precision`.

A policy becomes a set of compile-time rounding codes (0 keeps fp32, 1 rounds to
bf16, 2 to fp16) for every site and for every elementwise operation between
sites, where the reference rounds to the operands' promoted dtype.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from stableflash.attention.precision import PRESETS, SITES, Precision
from stableflash.attention.stabilize import SFA, ClampPbar
from stableflash.numerics.formats import get_format

LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128)
INPUT_DTYPES = (torch.bfloat16, torch.float16)
PHYSICAL_TILE = 64  # emulated logical tiles are built from tiles of this size
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's CPU interpreter is on (the tests' CPU path): read once, here."""
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NATIVE_TILE = PRESETS["fa2"].block_m


def _promote(a: int, b: int) -> int:
    return a if a == b else 0


def _rescaled_acc_code(code: dict) -> int:
    """O*c rounds to the operands' promoted dtype, then to the `acc_scaled` site (one of the two is fp32)."""
    promoted = _promote(code["acc"], code["rescale"])
    return code["acc_scaled"] or promoted


@dataclass(frozen=True)
class KernelSpec:
    emu: bool
    """False: production FA2 numerics (the `fa2` preset); True: every site rounded as the policy says."""
    ops_fp32: bool
    """Matmul operands in exact fp32 (a policy whose P̄/P/dS operands are fp32)."""
    codes: tuple[tuple[str, int], ...]
    out_dtype: torch.dtype
    save_fp32_o: bool
    delta_dpp: bool
    """δ = rowsum(dP ∘ P) from a pass over the keys (the `dp_p` formula) instead of rowsum(dO ∘ O)."""
    logical_m: int
    logical_n: int
    tile_clamp: float
    stab: int
    beta: float
    eps: float
    low: float
    high: float
    bounded: bool
    clamp_ceiling: float

    def code(self, name: str) -> int:
        return dict(self.codes)[name]


@functools.lru_cache(maxsize=1024)  # asked on every `backend="auto"` call on CUDA
def unsupported_reason(policy: Precision, stabilize, dtype: torch.dtype) -> str | None:
    """Why the fused kernels cannot run this combination, or None if they can."""
    if dtype not in INPUT_DTYPES:
        return f"inputs must be bfloat16 or float16, got {dtype}"
    if policy.head_override is not None:
        return None  # the API splits heads and asks again per policy
    if policy.compute != "fp32":
        return "compute must be fp32"
    if policy.rounding != "nearest":
        return "rounding must be 'nearest'"
    if policy.delta_formula == "do_o_recomputed":
        return "delta_formula 'do_o_recomputed' is reference-only"
    for site in SITES:
        if policy.dtype(site, dtype) not in _CODES or policy.format(site, dtype).torch_dtype is None:
            return f"site {site} in {getattr(policy, site)} (kernels round to fp32, bf16 or fp16)"
    for site in ("pbar_operand", "p_operand", "ds_operand", "out"):
        if policy.dtype(site, dtype) not in (dtype, torch.float32):
            return f"matmul operand site {site} must be the input dtype or fp32"
    if policy.o_saved not in ("out", "fp32"):
        return "o_saved must be 'out' or 'fp32'"
    for name in ("block_m", "block_n"):
        block = getattr(policy, name)
        if block is not None and block % PHYSICAL_TILE:
            return f"{name}={block} must be a multiple of {PHYSICAL_TILE} (or None)"
    if isinstance(stabilize, SFA) and policy.dtype("row_max", dtype) == torch.float16:
        return "SFA with an fp16 row_max is reference-only"
    if isinstance(stabilize, SFA) and stabilize.official_rule:
        return "the official SFA rule (SFA.official()) is reference-only"
    promoted = _promote(_CODES[policy.dtype("acc", dtype)], _CODES[policy.dtype("rescale", dtype)])
    if promoted and _CODES[policy.dtype("acc_scaled", dtype)] not in (0, promoted):
        return "acc_scaled in a half format other than acc's and rescale's"
    return None


def _is_native(policy: Precision, dtype: torch.dtype) -> bool:
    fa2 = PRESETS["fa2"]
    same_sites = all(policy.dtype(s, dtype) == fa2.dtype(s, dtype) for s in SITES if s != "delta_terms")
    return (same_sites and policy.tile_sum_clamp is None
            and policy.block_m == _NATIVE_TILE and policy.block_n == _NATIVE_TILE)


def build_spec(policy: Precision, stabilize, dtype: torch.dtype, seq_len: int) -> KernelSpec:
    code = {site: _CODES[policy.dtype(site, dtype)] for site in SITES}
    input_code = _CODES[dtype]
    codes = dict(
        R_QK=code["qk"], R_SCORES=code["scores"], R_ROW_MAX=code["row_max"],
        R_SUB=_promote(code["scores"], code["row_max"]), R_PBAR=code["pbar"], R_PBAR_OP=code["pbar_operand"],
        R_TILE_SUM=code["tile_sum"], R_PV=code["pv"], R_RESCALE=code["rescale"],
        R_L1=_promote(code["rescale"], code["row_sum"]), R_ROW_SUM=code["row_sum"],
        R_A1=_rescaled_acc_code(code), R_ACC=code["acc"],
        R_L_SAVED=code["row_sum_saved"], R_DIV=_promote(code["acc"], code["row_sum_saved"]), R_LSE=code["lse"],
        R_LSE_ADD=_promote(code["lse"], code["row_max"]),
        R_TERMS=code["delta_terms"], R_DELTA=code["delta"],
        R_P_SUB=_promote(code["scores"], code["lse"]), R_P=code["p"], R_P_OP=code["p_operand"], R_DP=code["dp"],
        R_DPP=_promote(code["dp"], code["p"]),
        R_DS1=_promote(code["dp"], code["delta"]), R_DS=code["ds"], R_DS_OP=code["ds_operand"],
        R_DV_PART=code["dv_part"], R_DV=code["dv"], R_DK_PART=code["dk_part"], R_DK=code["dk"],
        R_DQ_PART=code["dq_part"], R_DQ=code["dq"],
    )
    codes["R_L2"] = _promote(codes["R_L1"], code["tile_sum"])
    codes["R_A2"] = _promote(code["acc_scaled"], code["pv"])
    codes["R_DS2"] = _promote(code["p"], codes["R_DS1"])
    emu = not _is_native(policy, dtype)
    ops_fp32 = any(code[s] != input_code for s in ("pbar_operand", "p_operand", "ds_operand", "out"))
    whole = math.ceil(seq_len / PHYSICAL_TILE) * PHYSICAL_TILE
    pbar_format = get_format(policy.dtype("pbar_operand", dtype))
    stab, beta, eps, low, high, bounded, ceiling = 0, 2.0, 0.0, 0.0, 0.0, True, 1.0
    if isinstance(stabilize, SFA):
        stab, beta, eps, bounded = 1, float(stabilize.beta), float(stabilize.eps), stabilize.bounded
        low, high = stabilize.shift_bounds(pbar_format)
    elif isinstance(stabilize, ClampPbar):
        stab, ceiling = 2, ClampPbar.ceiling(pbar_format)
    units = 1.0 if emu else LOG2E  # the native kernel works in base-2 units
    return KernelSpec(
        emu=emu, ops_fp32=ops_fp32, codes=tuple(sorted(codes.items())),
        out_dtype=policy.dtype("out", dtype), save_fp32_o=policy.o_saved == "fp32",
        delta_dpp=policy.delta_formula == "dp_p",
        logical_m=policy.block_m or whole, logical_n=policy.block_n or whole,
        tile_clamp=float(policy.tile_sum_clamp or 0.0), stab=stab, beta=beta, eps=eps * units,
        low=low * units, high=high * units, bounded=bounded, clamp_ceiling=ceiling,
    )


def emulated_variant(name: str) -> Precision:
    """A preset or one of its isolation knobs, by name ("paper", "paper+pv32", "bf16+bwdfa2", ...): the emulated
    policies the kernels are checked against the reference on (`EMULATED_VARIANTS`)."""
    base, _, knob = name.partition("+")
    policy = PRESETS[base]
    knobs = {"": lambda: policy, "pv32": policy.with_pv_fp32, "o32": policy.with_o_fp32, "notiling": policy.tiling_off,
             "dpp": lambda: policy.with_delta("dp_p"), "fwdfa2": lambda: policy.with_pass_of("forward", "fa2"),
             "bwdfa2": lambda: policy.with_pass_of("backward", "fa2"),
             "scores32": lambda: policy.with_sites(qk="fp32", scores="fp32", row_max="fp32", lse="fp32"),
             "lse32": lambda: policy.with_sites(lse="fp32")}
    if knob not in knobs:
        raise ValueError(f"name: expected PRESET or PRESET+KNOB with KNOB in {sorted(k for k in knobs if k)}, got {name!r}")
    return knobs[knob]()


EMULATED_VARIANTS = ("paper", "paper-eager", "bf16", "paper+pv32", "paper+o32", "paper+notiling", "paper+dpp", "bf16+fwdfa2",
                     "bf16+bwdfa2", "bf16+scores32", "bf16+lse32")
