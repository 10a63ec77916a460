"""The emulated policies the kernels are checked against the reference on, by name: a preset or one of its
isolation knobs ("paper", "paper+pv32", "bf16+bwdfa2", "paper+pv-e8m4-tz", ...). Shared by the kernel tests and
the studies that sweep the same policies (`research/emulation_agreement.py`)."""

from stableflash.attention import PRESETS, PV_PATH, Precision


def emulated_variant(name: str) -> Precision:
    """A preset or one of its isolation knobs, by name (`EMULATED_VARIANTS`, `NARROW_VARIANTS`)."""
    base, _, knob = name.partition("+")
    policy = PRESETS[base]
    knobs = {"": lambda: policy, "pv32": policy.with_pv_fp32, "o32": policy.with_o_fp32, "notiling": policy.tiling_off,
             "dpp": lambda: policy.with_delta("dp_p"), "fwdfa2": lambda: policy.with_pass_of("forward", "fa2"),
             "bwdfa2": lambda: policy.with_pass_of("backward", "fa2"),
             "scores32": lambda: policy.with_sites(qk="fp32", scores="fp32", row_max="fp32", lse="fp32"),
             "lse32": lambda: policy.with_sites(lse="fp32"),
             # the dose-response study's numerics: the P̄V path in fewer fraction bits, rounded to nearest or toward 0
             **{f"pv-{fmt}": (lambda fmt=fmt: policy.with_sites(**{s: fmt for s in PV_PATH}))
                for fmt in ("e8m6", "e8m5", "e8m4", "e8m3")},
             "pv-e8m4-tz": lambda: policy.with_sites(**{s: "e8m4" for s in PV_PATH}).with_rounding("toward_zero", PV_PATH),
             "pv-tz": lambda: policy.with_rounding("toward_zero", PV_PATH),
             "pv-e8m4-sr": lambda: policy.with_sites(**{s: "e8m4" for s in PV_PATH}).with_rounding("stochastic", PV_PATH),
             "pv-sr": lambda: policy.with_rounding("stochastic", PV_PATH),
             "l-e8m3-sr": lambda: policy.with_sites(tile_sum="e8m3", row_sum="e8m3", row_sum_saved="e8m3").with_rounding(
                 "stochastic", ("tile_sum", "row_sum", "row_sum_saved")),
             "stats-e8m5-tz": lambda: policy.with_sites(**{s: "e8m5" for s in STATS_SITES}).with_rounding(
                 "toward_zero", STATS_SITES)}
    if knob not in knobs:
        raise ValueError(f"name: expected PRESET or PRESET+KNOB with KNOB in {sorted(k for k in knobs if k)}, got {name!r}")
    return knobs[knob]()


STATS_SITES = ("tile_sum", "row_sum", "row_sum_saved", "delta")
"""ℓ's sites and δ: the row statistics the kernels round in the narrow formats too."""

NARROW_VARIANTS = ("paper+pv-e8m6", "paper+pv-e8m5", "paper+pv-e8m4", "paper+pv-e8m3", "paper+pv-e8m4-tz",
                   "paper+pv-tz", "paper+stats-e8m5-tz", "paper+pv-e8m4-sr", "paper+pv-sr", "paper+l-e8m3-sr")
"""Formats with bf16's exponent and fewer fraction bits, and rounding toward zero or stochastic, at the sites the
kernels take them."""

EMULATED_VARIANTS = ("paper", "paper-eager", "bf16", "paper+pv32", "paper+o32", "paper+notiling", "paper+dpp", "bf16+fwdfa2",
                     "bf16+bwdfa2", "bf16+scores32", "bf16+lse32")
