"""`Precision`: where flash attention rounds, as data.

Every intermediate of the tiled algorithm is a *site*; a policy names the
format each site's result is rounded to. Operations compute in `compute`
(fp32, or fp64 for the fp64 reference) and round once, as torch's kernels do.

Presets (see `PRESETS` and docs/precision.md):
- `fp64`, `fp32`: everything in that format (the high-precision references);
- `fa2`: production FlashAttention-2: fp32 statistics and accumulators, P̄ cast
  to the input dtype before P̄V, O rounded once at the end, fp32 log-sum-exp;
- `bf16`: a synthetic worst case: every tensor in bf16, each op rounding its own
  result, 512x512 tiles. No real implementation rounds the saved log-sum-exp to
  bf16, as this one does;
- `paper`: the analysed implementation as it trained, under torch.compile and
  CUDA autocast(bf16), traced against the official code run as an oracle
  (docs/precision.md gives the table, `research/official_trace.py` the command);
- `paper-eager`: the same code's forward run eagerly (each op rounding its result).

The isolation knobs of the seed's section 3.4.2 are methods returning a new
policy: `tiling_off()`, `with_delta(...)`, `with_pv_fp32()`, `with_o_fp32()`,
`with_heads(...)`. A training config's table of them: `stableflash.train.config.AttentionConfig.policy`.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from stableflash.numerics.formats import Format, get_format
from stableflash.numerics.rounding import ROUNDING_MODES

DeltaFormula = Literal["do_o", "dp_p", "do_o_recomputed"]
DELTA_FORMULAS = ("do_o", "dp_p", "do_o_recomputed")

# The sites, in the order the algorithm meets them, with what each one is.
SITES = {
    "qk": "S before scaling: the QK^T matmul result",
    "scores": "S = (QK^T) * scale",
    "row_max": "tile row max and running max m",
    "pbar": "P̄ = exp(S - m), as the tile sum and the statistics see it",
    "pbar_operand": "P̄ as the P̄V matmul reads it (FA2 casts it to the input dtype)",
    "v_operand": "V as the forward's P̄V matmul reads it ('input': V as given)",
    "tile_sum": "rowsum of P̄ over one tile",
    "pv": "P̄V, the tile's matmul result",
    "rescale": "c = exp(m_old - m_new)",
    "row_sum": "running row sum l = c*l + tile sum",
    "acc_scaled": "O*c, the accumulator rescaled before P̄V is added (an in-place multiply rounds it)",
    "acc": "running output accumulator O = O*c + P̄V",
    "out": "final O = O / l (what the backward's δ reads)",
    "row_sum_saved": "l as the log-sum-exp reads it (the official code keeps l in a bf16 buffer)",
    "lse": "saved log-sum-exp, log(l) + m",
    "p": "backward probabilities P = exp(S - lse)",
    "p_operand": "P as the dV = P^T dO matmul reads it",
    "dp": "dP = dO V^T",
    "delta_terms": "the products dO * O that δ sums",
    "delta": "δ = rowsum(dO * O) (or the formula `delta_formula` names)",
    "ds": "dS = P * (dP - δ)",
    "ds_operand": "dS as the dQ and dK matmuls read it",
    "dv_part": "one query tile's dV = P^T dO, as its matmul returns it",
    "dv": "dV accumulator",
    "dk_part": "one query tile's dK = dS^T Q, as its matmul returns it",
    "dk": "dK accumulator",
    "dq_part": "one key tile's dQ = dS K, as its matmul returns it",
    "dq": "dQ accumulator",
}
SITE_INDEX = {site: i for i, site in enumerate(SITES)}
"""A site's number: part of stochastic rounding's counter (`numerics.rounding.counter_bits`)."""
FORWARD_SITES = tuple(SITES)[:tuple(SITES).index("lse") + 1]
BACKWARD_SITES = tuple(SITES)[len(FORWARD_SITES):]
PV_PATH = ("pbar_operand", "pv", "acc_scaled", "acc")
"""The sites of P̄V and the accumulator it feeds: where the seed places the biased rounding."""


@dataclass(frozen=True)
class Precision:
    """Format of every rounding site of tiled flash attention, plus tiling and knobs.

    A site's value is a format name (`"bf16"`, `"fp32"`, `"fp64"`, `"fp16"`,
    `"fp8_e4m3"`, `"fp8_e5m2"`) or `"input"`, meaning the dtype of q/k/v.
    """

    name: str = "custom"
    compute: str = "fp32"
    """Format every operation computes in before its result is rounded."""
    qk: str = "fp32"
    scores: str = "fp32"
    row_max: str = "fp32"
    pbar: str = "fp32"
    pbar_operand: str = "fp32"
    v_operand: str = "input"
    tile_sum: str = "fp32"
    pv: str = "fp32"
    rescale: str = "fp32"
    row_sum: str = "fp32"
    acc_scaled: str = "fp32"
    acc: str = "fp32"
    out: str = "fp32"
    row_sum_saved: str = "fp32"
    lse: str = "fp32"
    p: str = "fp32"
    p_operand: str = "fp32"
    dp: str = "fp32"
    delta_terms: str = "fp32"
    delta: str = "fp32"
    ds: str = "fp32"
    ds_operand: str = "fp32"
    dv_part: str = "fp32"
    dv: str = "fp32"
    dk_part: str = "fp32"
    dk: str = "fp32"
    dq_part: str = "fp32"
    dq: str = "fp32"
    o_saved: str = "out"
    """Format of the O the backward reads for δ: `"out"` (the returned O) or a format."""
    block_m: int | None = 128
    """Query tile rows; None: one tile (tiling off)."""
    block_n: int | None = 128
    """Key tile columns; None: one tile (tiling off)."""
    tile_sum_clamp: float | None = None
    """Lower clamp on each tile's rowsum of P̄ (the `bf16` recipe clamps at 1e-10)."""
    delta_formula: DeltaFormula = "do_o"
    """`do_o`: rowsum(dO*O); `dp_p`: rowsum(dP*P); `do_o_recomputed`: O recomputed as PV in fp32."""
    rounding: str = "nearest"
    """Rounding mode: nearest (ties to even), toward_zero, up, down or stochastic (seeded by torch's generator)."""
    rounding_sites: tuple[str, ...] = ()
    """The sites `rounding` applies to; the others round to nearest. Empty: every site and elementwise op."""
    head_override: tuple[tuple[int, ...], Precision] | None = field(default=None, compare=True)
    """(heads, policy): these head indices are computed with the second policy."""

    def __post_init__(self):
        self._validate()
        # a repr, not JSON: torch.compile(fullgraph=True) traces it where a model builds its policy inline
        object.__setattr__(self, "_key", repr(self._record()))

    @property
    def key(self) -> str:
        """The policy as a string (`from_key` inverts it): what torch.compile can hold as a constant where a
        function is evaluated at trace time (it cannot pass a dataclass instance to one)."""
        key = getattr(self, "_key", None)
        if key is None:  # unpickled from an earlier version
            key = repr(self._record())
            object.__setattr__(self, "_key", key)
        return key

    @classmethod
    def from_key(cls, key: str) -> Precision:
        return cls._from_record(ast.literal_eval(key))

    def _record(self) -> dict:
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        record["rounding_sites"] = list(self.rounding_sites)
        if self.head_override is not None:
            record["head_override"] = [list(self.head_override[0]), self.head_override[1]._record()]
        return record

    @classmethod
    def _from_record(cls, record: dict) -> Precision:
        record = {**record, "rounding_sites": tuple(record["rounding_sites"])}
        if record["head_override"] is not None:
            heads, other = record["head_override"]
            record["head_override"] = (tuple(heads), cls._from_record(other))
        return cls(**record)

    def __hash__(self):
        # computed once: the kernels' registry and caches hash the policy on every eager call
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self):
        # string hashes differ between processes: a pickled hash would be wrong in the next one
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def _validate(self):
        for site in (*SITES, "compute"):
            value = getattr(self, site)
            if value != "input":
                try:
                    get_format(value)
                except ValueError:
                    raise ValueError(
                        f"Precision.{site}: unknown format {value!r}; expected 'input' or a format name "
                        "such as 'bf16', 'fp16', 'fp32', 'fp64', 'fp8_e4m3', 'fp8_e5m2', 'e8m6' ... 'e8m3'") from None
        if self.compute not in ("fp32", "fp64"):
            raise ValueError(f"Precision.compute: expected 'fp32' or 'fp64', got {self.compute!r}")
        if self.o_saved != "out":
            get_format(self.o_saved)
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Precision.{name}: expected a positive int or None, got {value!r}")
        clamp = self.tile_sum_clamp
        if clamp is not None and not (isinstance(clamp, (int, float)) and math.isfinite(clamp) and clamp >= 0):
            raise ValueError(f"Precision.tile_sum_clamp: expected None or a finite number >= 0, got {clamp!r}")
        if self.delta_formula not in DELTA_FORMULAS:
            raise ValueError(f"Precision.delta_formula: expected one of {DELTA_FORMULAS}, got {self.delta_formula!r}")
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(f"Precision.rounding: expected one of {ROUNDING_MODES}, got {self.rounding!r}")
        if not isinstance(self.rounding_sites, tuple) or any(s not in SITES for s in self.rounding_sites):
            raise ValueError(f"Precision.rounding_sites: expected a tuple of site names from {list(SITES)}, "
                             f"got {self.rounding_sites!r}")
        if self.head_override is not None:
            heads, policy = self.head_override
            if not isinstance(policy, Precision) or any(not isinstance(h, int) or h < 0 for h in heads):
                raise ValueError("Precision.head_override: expected (tuple of head indices >= 0, Precision)")

    # -- resolution --------------------------------------------------------------

    def format(self, site: str, input_dtype: torch.dtype) -> Format:
        """The format `site`'s result is rounded to for inputs of `input_dtype`."""
        value = getattr(self, site)
        return get_format(input_dtype if value == "input" else value)

    def dtype(self, site: str, input_dtype: torch.dtype) -> torch.dtype:
        """torch dtype that `site`'s result is stored in for inputs of `input_dtype` (fp32 for a format torch has
        no dtype for, such as e8m4: the values are the format's, the storage fp32)."""
        return self.format(site, input_dtype).torch_dtype or torch.float32

    def compute_dtype(self) -> torch.dtype:
        return get_format(self.compute).torch_dtype

    # -- isolation knobs (each returns a new policy) ------------------------------

    def replace(self, **changes) -> Precision:
        return dataclasses.replace(self, **changes)

    def tiling_off(self) -> Precision:
        """One tile per row and column: the seed's 'tiling is not the source' experiment."""
        return self.replace(name=f"{self.name}+notiling", block_m=None, block_n=None)

    def with_delta(self, formula: DeltaFormula) -> Precision:
        """δ = rowsum(dO*O) | rowsum(dP*P) | rowsum(dO*O) with O recomputed as PV in fp32."""
        return self.replace(name=f"{self.name}+delta={formula}", delta_formula=formula)

    def with_pv_fp32(self) -> Precision:
        """P̄V product and the accumulator it feeds kept in fp32; O rounded once at the end."""
        return self.replace(name=f"{self.name}+pv32", pv="fp32", acc_scaled="fp32", acc="fp32")

    def with_o_fp32(self) -> Precision:
        """O computed and saved in fp32 in the forward, so δ reads O_hp."""
        return self.replace(name=f"{self.name}+o32", pv="fp32", acc_scaled="fp32", acc="fp32", row_sum="fp32",
                            o_saved="fp32")

    def with_pass_of(self, which: Literal["forward", "backward"], policy: str | Precision) -> Precision:
        """One pass's sites (FORWARD_SITES or BACKWARD_SITES) in the formats of `policy`: which pass's
        roundings matter (tiles, δ formula and rounding mode stay this policy's)."""
        sites = {"forward": FORWARD_SITES, "backward": BACKWARD_SITES}.get(which)
        if sites is None:
            raise ValueError(f"which: expected 'forward' or 'backward', got {which!r}")
        other = resolve(policy)
        return self.replace(name=f"{self.name}+{which}={other.name}", **{site: getattr(other, site) for site in sites})

    def with_sites(self, **formats: str) -> Precision:
        """Sites set by hand, e.g. `with_sites(qk="fp32", scores="fp32")`, named after what they set."""
        return self.replace(name=self.name + "+" + ",".join(f"{k}={v}" for k, v in formats.items()), **formats)

    def with_rounding(self, mode: str, sites=()) -> Precision:
        """Round `sites` (all of them when empty) with `mode`, the others to nearest: e.g. stochastic rounding on
        the P̄V path only, `with_rounding("stochastic", PV_PATH)`."""
        sites = tuple(sites)
        label = f"{mode}@{','.join(sites)}" if sites else mode
        return self.replace(name=f"{self.name}+{label}", rounding=mode, rounding_sites=sites)

    def with_heads(self, heads, policy: str | Precision) -> Precision:
        """Compute the given head indices with `policy` (e.g. per-head fp32)."""
        return self.replace(name=f"{self.name}+heads{sorted(heads)}", head_override=(tuple(sorted(heads)), resolve(policy)))

    def describe(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "head_override"}
        if self.head_override is not None:
            out["head_override"] = {"heads": list(self.head_override[0]), "policy": self.head_override[1].describe()}
        return out


def _uniform(name: str, fmt: str, **extra) -> Precision:
    sites = {site: fmt for site in SITES}
    return Precision(name=name, compute="fp64" if fmt == "fp64" else "fp32", **sites, **extra)


_FA2 = dict(
    qk="fp32", scores="fp32", row_max="fp32", pbar="fp32", pbar_operand="input", tile_sum="fp32", pv="fp32",
    rescale="fp32", row_sum="fp32", acc="fp32", out="input", lse="fp32", p="fp32", p_operand="input",
    dp="fp32", delta_terms="fp32", delta="fp32", ds="fp32", ds_operand="input", dv="fp32", dk="fp32", dq="fp32",
)

# The analysed code (the paper's repository, `attention.py`) as its `train.py` runs it: under torch.compile, the
# forward under bf16 autocast and the backward traced under it too. Traced against the official code run as an
# oracle on an H200 (docs/precision.md; research/official_trace.py). Inductor fuses each chain of elementwise ops
# and reductions into one kernel that computes in fp32, so a value is rounded only where it is stored: the
# matmul results (S, P̄V, dP and each tile's dQ, dK, dV) and their bf16 operands (P̄, P, dS), the saved l and O.
_PAPER = dict(
    qk="bf16", scores="fp32", row_max="fp32", pbar="fp32", pbar_operand="bf16", tile_sum="fp32", pv="bf16",
    rescale="fp32", row_sum="fp32", acc_scaled="fp32", acc="fp32", out="bf16", row_sum_saved="bf16", lse="fp32",
    p="fp32", p_operand="bf16", dp="bf16", delta_terms="fp32", delta="fp32", ds="fp32", ds_operand="bf16",
    dv_part="bf16", dv="fp32", dk_part="bf16", dk="fp32", dq_part="bf16", dq="fp32",
)
# The same code's forward run eagerly under autocast: every op rounds its result to its dtype (S, m and S - m
# in bf16, l and O in their bf16 buffers, O*c rounded by the in-place multiply). Its backward cannot run
# eagerly (fp32 P times bf16 dO raises), so the backward sites are the compiled ones.
_PAPER_EAGER = dict(_PAPER, scores="bf16", row_max="bf16", row_sum="bf16", acc_scaled="bf16", acc="bf16")
_TILES_512 = dict(block_m=512, block_n=512, tile_sum_clamp=1e-10)  # the official bucket sizes and row-sum clamp

PRESETS: dict[str, Precision] = {
    "fp64": _uniform("fp64", "fp64"),
    "fp32": _uniform("fp32", "fp32"),
    "fa2": Precision(name="fa2", **_FA2),
    "bf16": _uniform("bf16", "bf16", **_TILES_512),
    "paper": Precision(name="paper", **_TILES_512, **_PAPER),
    "paper-eager": Precision(name="paper-eager", **_TILES_512, **_PAPER_EAGER),
}


def resolve(precision: str | Precision) -> Precision:
    """A policy from a preset name, or the policy itself."""
    if isinstance(precision, Precision):
        return precision
    if isinstance(precision, str) and precision in PRESETS:
        return PRESETS[precision]
    raise ValueError(f"precision: unknown preset {precision!r}; expected a Precision or one of {sorted(PRESETS)}")


def rounds_backward_stochastically(policy: Precision) -> bool:
    """Whether some backward site of `policy` rounds stochastically: each backward then draws a seed of its own as
    it starts, the reference and the kernels alike."""
    return policy.rounding == "stochastic" and (not policy.rounding_sites
                                                or bool(set(policy.rounding_sites) & set(BACKWARD_SITES)))
