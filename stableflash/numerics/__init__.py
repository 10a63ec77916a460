"""Floating-point formats by their bits, tensor rounding, and the addition explainer."""

from stableflash.numerics.explain import AdditionExplanation, explain_add
from stableflash.numerics.formats import (
    BF16,
    FORMATS,
    FP8_E4M3,
    FP8_E5M2,
    FP16,
    FP32,
    FP64,
    Format,
    get_format,
)
from stableflash.numerics.rounding import ROUNDING_MODES, round_to, ulp

__all__ = [
    "AdditionExplanation", "BF16", "FORMATS", "FP8_E4M3", "FP8_E5M2", "FP16", "FP32", "FP64", "Format",
    "ROUNDING_MODES", "explain_add", "get_format", "round_to", "ulp",
]
