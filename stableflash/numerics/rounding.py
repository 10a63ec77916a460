"""Rounding of tensors to a `Format`, with the rounding mode as a parameter.

torch's own casts only round to nearest-even; this module adds round-toward-zero
and seeded stochastic rounding (the seed's suggested cure for biased rounding),
for any format including the fp8 ones. Work happens in float64, where every
value of the narrower formats and every rounding boundary is exact.
"""

from __future__ import annotations

from typing import Literal

import torch

from stableflash.numerics.formats import Format, get_format

RoundingMode = Literal["nearest", "toward_zero", "up", "down", "stochastic"]
ROUNDING_MODES = ("nearest", "toward_zero", "up", "down", "stochastic")


def round_to(
    x: torch.Tensor,
    fmt: str | Format | torch.dtype,
    mode: RoundingMode = "nearest",
    *,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Round every element of `x` to the nearest value of `fmt` under `mode`.

    - `"nearest"`: round to nearest, ties to even (IEEE default); overflow goes
      to ±inf (NaN for fp8 e4m3, which has no infinity: OCP's non-saturating
      mode, where torch's `.to(torch.float8_e4m3fn)` saturates at ±448).
    - `"toward_zero"`: truncate; overflow saturates at the largest finite value.
    - `"up"` / `"down"`: toward +inf / -inf (directed rounding; overflow on
      the rounded side goes to infinity, on the other saturates).
    - `"stochastic"`: round up with probability equal to the distance from the
      lower neighbour in units of the spacing, so the result is unbiased;
      seeded through `generator`, or with `noise` (values in [0, 1), one per
      element) given: what `counter_noise` makes, to reproduce the kernels' bits.

    Returns a `dtype` tensor (float64 by default) holding the rounded values,
    so that formats torch cannot compute in (fp8) still give usable numbers.
    """
    fmt = get_format(fmt)
    if mode not in ROUNDING_MODES:
        raise ValueError(f"mode: expected one of {ROUNDING_MODES}, got {mode!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if fmt.exponent_bits > 11 or fmt.fraction_bits > 52:
        raise ValueError(f"fmt: {fmt.name} is wider than float64, which this rounding works in")

    wide = x.to(torch.float64)
    magnitude = wide.abs()
    finite = torch.isfinite(wide)
    _, exponent = torch.frexp(torch.where(finite, magnitude, torch.ones_like(magnitude)))
    # frexp gives magnitude = mantissa * 2**exponent with mantissa in [0.5, 1); the
    # binade's exponent is exponent - 1, and subnormals share the smallest one.
    binade = torch.clamp(exponent - 1, min=fmt.min_exponent)
    spacing = torch.ldexp(torch.ones_like(magnitude), binade - fmt.fraction_bits)
    units = magnitude / spacing  # exact: division by a power of two

    if mode == "nearest":
        units = torch.round(units)  # torch.round is half-to-even
    elif mode == "toward_zero":
        units = torch.trunc(units)
    elif mode in ("up", "down"):
        away = (wide > 0) if mode == "up" else (wide < 0)  # where the direction is away from zero
        units = torch.where(away, torch.ceil(units), torch.trunc(units))
    else:
        if noise is None:
            noise = torch.rand(units.shape, dtype=torch.float64, generator=generator, device=units.device)
        units = torch.floor(units + noise.to(torch.float64))
    rounded = units * spacing

    infinite = float("inf") if fmt.has_inf else float("nan")
    if mode == "toward_zero":
        overflow_value = torch.full_like(rounded, fmt.max_finite)
    elif mode in ("up", "down"):
        away = (wide > 0) if mode == "up" else (wide < 0)
        overflow_value = torch.where(away, torch.full_like(rounded, infinite), torch.full_like(rounded, fmt.max_finite))
    else:
        overflow_value = torch.full_like(rounded, infinite)
    rounded = torch.where(rounded > fmt.max_finite, overflow_value, rounded)
    rounded = torch.copysign(rounded, wide)
    # inf and nan pass through (inf becomes nan in a format without infinity)
    passthrough = wide if fmt.has_inf else torch.where(torch.isinf(wide), torch.nan, wide)
    return torch.where(finite, rounded, passthrough).to(dtype)


def ulp(x: torch.Tensor, fmt: str | Format | torch.dtype) -> torch.Tensor:
    """Spacing of `fmt` at each element's magnitude (float64)."""
    fmt = get_format(fmt)
    _, exponent = torch.frexp(x.to(torch.float64).abs())
    binade = torch.clamp(exponent - 1, min=fmt.min_exponent)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), binade - fmt.fraction_bits)


_MASK32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash step (xorshift-multiply), on int64 tensors holding uint32 values; the fused kernels
    compute the same in uint32. The multipliers are below 2^31, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _MASK32
    return x ^ (x >> 16)


def counter_bits(seed: int, site: int, bh: torch.Tensor, row: torch.Tensor, col: torch.Tensor, tile: int) -> torch.Tensor:
    """32 random bits per element from a counter-based hash of (seed, site, batch·head, row, column, tile): the same
    bits wherever the element is computed (any tiling, the reference or a kernel). int64 tensor of uint32 values."""
    h = _mix(torch.as_tensor((seed + site * 0x1B873593) & _MASK32, dtype=torch.int64))
    for part in (bh, row, col):
        h = _mix(h ^ part.to(torch.int64))
    return _mix(h ^ tile)


def counter_noise(bits: torch.Tensor, fmt: str | Format, source_fraction_bits: int = 23) -> torch.Tensor:
    """`round_to`'s stochastic noise from `counter_bits`, for rounding fp32 values to `fmt` as the kernels do: the top
    `23 - fmt.fraction_bits` bits, as a fraction of the spacing (float64, exact)."""
    drop = source_fraction_bits - get_format(fmt).fraction_bits
    return (bits >> (32 - drop)).to(torch.float64) * 2.0 ** -drop


def draw_seed() -> int:
    """A seed for one call's stochastic rounding, from torch's CPU generator: `torch.manual_seed` and a checkpoint's
    RNG state make it reproducible, and the reference and the kernels draw it at the same point of a call."""
    return int(torch.randint(0, 2**31 - 1, ()).item())
