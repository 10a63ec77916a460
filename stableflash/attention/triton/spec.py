"""`KernelSpec`: what the fused kernels are specialised on, derived from a `Precision`; the one registry of them.

A policy becomes a compile-time rounding code for every site and for every elementwise operation between sites,
where the reference rounds to the operands' promoted dtype: `format + 8 * mode`, the format 0 (fp32: no rounding),
1 bf16, 2 fp16, 3-6 e8m6-e8m3 (bf16's exponent, fewer fraction bits), the mode 0 nearest-even, 1 toward zero,
2 stochastic (its bits from `numerics.rounding.counter_bits` of the element's position: the reference's bits). The policy
of production FA2 (the `fa2` preset, its tiles included) runs the native kernels (`native.py`, `hopper.py`); every
other supported policy the emulation kernels (`emulation.py`).

`spec_name(policy, stabilize, dtype, head_dim, seq_len)` validates and builds a spec once per argument tuple and
returns its name, a string: what the `torch.library` ops can carry. Under torch.compile it runs once, at trace time,
and its result is a constant of the graph; for that it takes the policy and stabilizer by their `key` strings, as
dynamo cannot pass dataclass instances to such a function. `spec_named` maps the name back.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from stableflash.attention import stabilize as stabilizers
from stableflash.attention.precision import PRESETS, SITES, Precision, rounds_backward_stochastically
from stableflash.attention.stabilize import SFA, ClampPbar
from stableflash.attention.stats import tail_limit
from stableflash.numerics.formats import get_format

LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128, 256)
"""The head dims the kernels compile for; a smaller one runs padded to the next (`kernel_head_dim`) inside the
kernels (`D_IN`)."""
INPUT_DTYPES = (torch.bfloat16, torch.float16)
PHYSICAL_TILE = 64  # emulated logical tiles are built from tiles of this size
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's CPU interpreter is on (the tests' CPU path): read once, here."""
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # storage dtypes, which elementwise ops round to
FORMAT_CODES = {"fp32": 0, "bf16": 1, "fp16": 2, "e8m6": 3, "e8m5": 4, "e8m4": 5, "e8m3": 6}
MODE_CODES = {"nearest": 0, "toward_zero": 1, "stochastic": 2}
STOCHASTIC_SITES = ("pbar_operand", "pv", "acc_scaled", "acc", "tile_sum", "row_sum", "row_sum_saved", "out",
                    "delta_terms", "delta")
"""The sites the kernels round stochastically (the forward's P̄V path, ℓ and O, and δ = rowsum(dO ∘ O)), with bits
from the element's position."""
_BF16_VALUED = {"bf16", "e8m6", "e8m5", "e8m4", "e8m3"}  # formats whose every value is a bf16 value
_NATIVE_TILE = PRESETS["fa2"].block_m


def native_scales(scale: float, softcap: float) -> tuple[float, float]:
    """The native kernels' (scale, softcap) arguments (`common.scores`): the scale in base-2 units; under a cap
    (softcap > 0) the natural scale over the cap, and the cap in base-2 units."""
    if softcap > 0:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


def _promote(a: int, b: int) -> int:
    return a if a == b else 0


def _operand_in_input_dtype(site_format: str, input_format: str) -> bool:
    """Whether a matmul operand of this format is exact in the input dtype (e8m4 values are bf16 values), so that
    the matmul runs on the input dtype's tensor cores; else its operands are fp32."""
    return site_format == input_format or (input_format == "bf16" and site_format in _BF16_VALUED)


_FWD_CODES = ("R_QK", "R_SCORES", "R_ROW_MAX", "R_SUB", "R_PBAR", "R_PBAR_OP", "R_V_OP", "R_TILE_SUM", "R_PV",
              "R_RESCALE", "R_L1", "R_L2", "R_ROW_SUM", "R_A1", "R_A2", "R_ACC", "R_L_SAVED", "R_DIV", "R_OUT", "R_LSE",
              "R_LSE_ADD", "R_THRESHOLD")
_P_CODES = ("R_QK", "R_SCORES", "R_P_SUB", "R_P", "R_DP")
_DS_CODES = ("R_DS1", "R_DS2", "R_DS", "R_DS_OP")


@dataclass(frozen=True, eq=False)
class KernelSpec:
    name: str
    native: bool
    """True: production FA2 numerics (`native.py`); False: every site rounded as the policy says (`emulation.py`)."""
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
    """0 plain, 1 SFA, 2 ClampPbar."""
    beta: float
    eps: float
    """SFA's eps in the kernels' score units (base 2 natively)."""
    low: float
    high: float
    bounded: bool
    clamp_ceiling: float
    official: bool
    """SFA by the paper's code's rule (`SFA.official()`): emulation kernels only."""
    tail_limit: float
    """`stats.tail_limit` of P̄V's format: the statistics' test of a biasable row."""
    stochastic: bool
    """Some site rounds stochastically: each forward call draws a seed (`numerics.rounding.draw_seed`)."""
    backward_stochastic: bool
    """Some backward site does: each backward draws a seed of its own as it starts, where the reference draws it."""

    @property
    def units(self) -> float:
        """Score units per natural unit: the native kernels work in base 2."""
        return LOG2E if self.native else 1.0

    def code(self, name: str) -> int:
        return dict(self.codes)[name]

    @functools.cached_property
    def forward_constants(self) -> dict:
        """The forward kernel's compile-time arguments but the launch's (HEAD_DIM, CAUSAL, STATS, tile, TMA)."""
        shared = dict(STAB=self.stab, BETA=self.beta, LOW=self.low, HIGH=self.high, BOUNDED=self.bounded,
                      CLAMP_CEIL=self.clamp_ceiling)
        if self.native:
            # SFA's native forward on a (heads, query tiles) grid, the plain one on (query tiles, heads): each the
            # faster of the two for it (results/kernel-variants/)
            return dict(shared, HEADS_FIRST=self.stab == 1)
        codes = dict(self.codes)
        return dict(shared, OPS_FP32=self.ops_fp32, SAVE_OS=self.save_fp32_o, TILE_CLAMP=self.tile_clamp,
                    OFFICIAL=self.official, TAIL_LIMIT=self.tail_limit, **{n: codes[n] for n in _FWD_CODES})

    @functools.cached_property
    def delta_constants(self) -> dict | None:
        """The `dp_p` δ pass's compile-time arguments; None where the dQ kernel computes δ = rowsum(dO ∘ O)."""
        if not self.delta_dpp:
            return None
        codes = dict(self.codes)
        return dict(OPS_FP32=self.ops_fp32, **{n: codes[n] for n in (*_P_CODES, "R_DPP", "R_TERMS", "R_DELTA")})

    @functools.cached_property
    def dq_constants(self) -> dict:
        if self.native:
            return {}
        codes = dict(self.codes)
        here = not self.delta_dpp
        return dict(OPS_FP32=self.ops_fp32, DELTA_HERE=here, R_TERMS=codes["R_TERMS"] if here else 0,
                    R_DELTA=codes["R_DELTA"] if here else 0,
                    **{n: codes[n] for n in (*_P_CODES, *_DS_CODES, "R_DQ_PART", "R_DQ")})

    @functools.cached_property
    def dkdv_constants(self) -> dict:
        if self.native:
            return {}
        codes = dict(self.codes)
        return dict(OPS_FP32=self.ops_fp32,
                    **{n: codes[n] for n in (*_P_CODES, "R_P_OP", *_DS_CODES, "R_DV_PART", "R_DV", "R_DK_PART", "R_DK")})


@functools.lru_cache(maxsize=1024)  # asked on every `backend="auto"` call on CUDA
def unsupported_reason(policy: Precision, stabilize, dtype: torch.dtype) -> str | None:
    """Why the fused kernels cannot run this combination, or None if they can."""
    if dtype not in INPUT_DTYPES:
        return f"inputs must be bfloat16 or float16, got {dtype}"
    if policy.head_override is not None:
        other = policy.head_override[1]
        return unsupported_reason(policy.replace(head_override=None), stabilize, dtype) or unsupported_reason(
            other, stabilize, dtype)
    if policy.compute != "fp32":
        return "compute must be fp32"
    if policy.rounding not in MODE_CODES:
        return f"rounding must be one of {sorted(MODE_CODES)}, got {policy.rounding!r}"
    if policy.delta_formula == "do_o_recomputed":
        return "delta_formula 'do_o_recomputed' is reference-only"
    for site in SITES:
        name = policy.format(site, dtype).name
        if name not in FORMAT_CODES:
            return f"site {site} in {getattr(policy, site)} (kernels round to fp32, bf16, fp16 or e8m6-e8m3)"
        if name == "fp16" and _mode(policy, site) != "nearest":
            return f"site {site}: fp16 rounds to nearest only in the kernels"
    if policy.rounding != "nearest" and not policy.rounding_sites and any(
            policy.dtype(site, dtype) == torch.float16 for site in SITES):
        return "elementwise operations in fp16 round to nearest only in the kernels"
    if policy.rounding == "stochastic" and (not policy.rounding_sites
                                            or not set(policy.rounding_sites) <= set(STOCHASTIC_SITES)):
        return f"stochastic rounding runs in the kernels at the sites {STOCHASTIC_SITES} (with_rounding(..., sites))"
    if (policy.rounding == "stochastic" and policy.delta_formula != "do_o"
            and {"delta_terms", "delta"} & set(policy.rounding_sites)):
        return "stochastic δ runs in the kernels with delta_formula 'do_o' only"
    if dtype == torch.float16:
        for site in ("pbar_operand", "v_operand", "p_operand", "ds_operand", "out"):
            if policy.dtype(site, dtype) not in (dtype, torch.float32):
                return f"matmul operand site {site} must be the input dtype or fp32"
    elif policy.format("out", dtype).name not in ("fp32", *_BF16_VALUED):
        return "the output site must be bf16, a narrower format with its exponent (e8m6-e8m3), or fp32"
    if policy.o_saved not in ("out", "fp32"):
        return "o_saved must be 'out' or 'fp32'"
    for name in ("block_m", "block_n"):
        block = getattr(policy, name)
        if block is not None and block % PHYSICAL_TILE:
            return f"{name}={block} must be a multiple of {PHYSICAL_TILE} (or None)"
    if isinstance(stabilize, SFA) and policy.format("row_max", dtype).name not in ("fp32", "bf16"):
        return "SFA with a row_max in another format than fp32 or bf16 is reference-only"
    if isinstance(stabilize, SFA) and _mode(policy, "row_max") != "nearest":
        return "SFA with a row_max rounded other than to nearest is reference-only"
    promoted = _promote(_CODES[policy.dtype("acc", dtype)], _CODES[policy.dtype("rescale", dtype)])
    if promoted and _site_code(policy, "acc_scaled", dtype) not in (0, _op_code(policy, promoted)):
        return "acc_scaled in another format or mode than acc's and rescale's half format"
    return None


def _mode(policy: Precision, site: str) -> str:
    """The rounding mode of `site`: the policy's where it covers every site or lists this one, else nearest."""
    return policy.rounding if not policy.rounding_sites or site in policy.rounding_sites else "nearest"


def _site_code(policy: Precision, site: str, dtype: torch.dtype) -> int:
    fmt = FORMAT_CODES[policy.format(site, dtype).name]
    return fmt + 8 * MODE_CODES[_mode(policy, site)] if fmt else 0  # to fp32: no rounding, in any mode


def _op_code(policy: Precision, storage_code: int) -> int:
    """An elementwise operation's rounding to its operands' promoted storage dtype: the policy's mode where it covers
    every site (and so every operation), else nearest."""
    mode = policy.rounding if not policy.rounding_sites else "nearest"
    return storage_code + 8 * MODE_CODES[mode] if storage_code else 0


def is_native(policy: Precision, dtype: torch.dtype) -> bool:
    """Whether `policy` is production FA2's numerics, which the native kernels compute."""
    fa2 = PRESETS["fa2"]
    same_sites = all(policy.format(s, dtype) == fa2.format(s, dtype) for s in SITES if s != "delta_terms")
    return (same_sites and policy.rounding == "nearest" and policy.tile_sum_clamp is None and policy.o_saved == "out"
            and policy.delta_formula == "do_o" and policy.block_m == _NATIVE_TILE and policy.block_n == _NATIVE_TILE)


_REGISTRY: dict[str, KernelSpec] = {}


def spec_name(policy: Precision, stabilize, dtype: torch.dtype, head_dim: int, seq_len: int) -> str:
    """The name of the kernels' specialisation for these arguments, validated, built and registered once; a
    ValueError names the argument the kernels cannot take."""
    return _spec_name(policy.key, stabilizers.key_of(stabilize), dtype, head_dim, seq_len)


def spec_named(name: str) -> KernelSpec:
    return _REGISTRY[name]


@torch.compiler.assume_constant_result
def _spec_name(policy_key: str, stabilize_key: str | None, dtype: torch.dtype, head_dim: int, seq_len: int) -> str:
    # by the policy's and stabilizer's keys: under torch.compile this runs once, at trace time, and dynamo cannot
    # pass dataclass instances to it
    return _build(policy_key, stabilize_key, dtype, head_dim, seq_len)


def kernel_head_dim(head_dim: int) -> int | None:
    """The kernels' head dim for inputs of `head_dim`: the smallest of `HEAD_DIMS` that holds it (None above 256).
    Zero columns change no score, probability or output column that is kept, as flash-attn pads its own head dims."""
    return next((width for width in HEAD_DIMS if width >= head_dim), None) if head_dim >= 1 else None


@functools.lru_cache(maxsize=1024)
def _build(policy_key: str, stabilize_key: str | None, dtype: torch.dtype, head_dim: int, seq_len: int) -> str:
    policy, stabilize = Precision.from_key(policy_key), stabilizers.from_key(stabilize_key)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q: the triton kernels compile head dims {HEAD_DIMS} (`attention` pads the others up to "
                         f"one), got {head_dim}")
    reason = unsupported_reason(policy, stabilize, dtype)
    if reason is not None:
        raise ValueError(f"precision: the triton backend cannot run policy {policy.name!r}: {reason}; "
                         "use backend='reference'")
    spec = build_spec(policy, stabilize, dtype, seq_len)
    return _REGISTRY.setdefault(spec.name, spec).name


def build_spec(policy: Precision, stabilize, dtype: torch.dtype, seq_len: int) -> KernelSpec:
    """The spec of a supported policy (`unsupported_reason` is None), unregistered."""
    store = {site: _CODES[policy.dtype(site, dtype)] for site in SITES}  # storage dtypes, for the operations

    def op(a: int, b: int) -> int:  # an elementwise op on operands stored as `a` and `b`
        return _op_code(policy, _promote(a, b))

    code = {site: _site_code(policy, site, dtype) for site in SITES}
    l1 = _promote(store["rescale"], store["row_sum"])
    ds1 = _promote(store["dp"], store["delta"])
    promoted_acc = _promote(store["acc"], store["rescale"])
    codes = dict(
        R_QK=code["qk"], R_SCORES=code["scores"], R_ROW_MAX=code["row_max"],
        R_SUB=op(store["scores"], store["row_max"]), R_PBAR=code["pbar"], R_PBAR_OP=code["pbar_operand"],
        # V in its own dtype is exact: no rounding
        R_V_OP=0 if policy.format("v_operand", dtype) == get_format(dtype) else code["v_operand"],
        R_THRESHOLD=op(store["row_max"], store["row_max"]),  # the official SFA's rm - eps, an operation on m
        R_TILE_SUM=code["tile_sum"], R_PV=code["pv"], R_RESCALE=code["rescale"],
        R_L1=_op_code(policy, l1), R_L2=op(l1, store["tile_sum"]), R_ROW_SUM=code["row_sum"],
        # O*c rounds to the operands' promoted dtype, then to the `acc_scaled` site (one of the two is fp32)
        R_A1=code["acc_scaled"] or _op_code(policy, promoted_acc), R_A2=op(store["acc_scaled"], store["pv"]),
        R_ACC=code["acc"],
        R_L_SAVED=code["row_sum_saved"], R_DIV=op(store["acc"], store["row_sum_saved"]), R_OUT=code["out"],
        R_LSE=code["lse"],
        R_LSE_ADD=op(store["lse"], store["row_max"]),
        R_TERMS=code["delta_terms"], R_DELTA=code["delta"],
        R_P_SUB=op(store["scores"], store["lse"]), R_P=code["p"], R_P_OP=code["p_operand"], R_DP=code["dp"],
        R_DPP=op(store["dp"], store["p"]),
        R_DS1=_op_code(policy, ds1), R_DS2=op(store["p"], ds1), R_DS=code["ds"], R_DS_OP=code["ds_operand"],
        R_DV_PART=code["dv_part"], R_DV=code["dv"], R_DK_PART=code["dk_part"], R_DK=code["dk"],
        R_DQ_PART=code["dq_part"], R_DQ=code["dq"],
    )
    official = isinstance(stabilize, SFA) and stabilize.official_rule
    native = is_native(policy, dtype) and not official  # the official rule is emulated, also under fa2's numerics
    input_name = get_format(dtype).name
    ops_fp32 = any(not _operand_in_input_dtype(policy.format(s, dtype).name, input_name)
                   for s in ("pbar_operand", "v_operand", "p_operand", "ds_operand", "out"))
    whole = math.ceil(seq_len / PHYSICAL_TILE) * PHYSICAL_TILE
    pbar_format = policy.format("pbar_operand", dtype)
    stab, beta, eps, low, high, bounded, ceiling = 0, 2.0, 0.0, 0.0, 0.0, True, 1.0
    if isinstance(stabilize, SFA):
        stab, beta, eps, bounded = 1, float(stabilize.beta), float(stabilize.eps), stabilize.bounded
        low, high = stabilize.shift_bounds(pbar_format)
    elif isinstance(stabilize, ClampPbar):
        stab, ceiling = 2, ClampPbar.ceiling(pbar_format)
    units = LOG2E if native else 1.0  # the native kernels work in base-2 units
    fields = dict(
        native=native, ops_fp32=ops_fp32, codes=tuple(sorted(codes.items())),
        out_dtype=policy.dtype("out", dtype), save_fp32_o=policy.o_saved == "fp32",
        delta_dpp=policy.delta_formula == "dp_p",
        logical_m=policy.block_m or whole, logical_n=policy.block_n or whole,
        tile_clamp=float(policy.tile_sum_clamp or 0.0), stab=stab, beta=beta, eps=eps * units,
        low=low * units, high=high * units, bounded=bounded, clamp_ceiling=ceiling, official=official,
        tail_limit=tail_limit(policy.format("pv", dtype).fraction_bits),
        stochastic=policy.rounding == "stochastic",
        backward_stochastic=rounds_backward_stochastically(policy),
    )
    return KernelSpec(name=repr(sorted(fields.items())), **fields)
