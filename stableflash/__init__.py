"""stableflash: BF16 flash-attention training that is stable, fast, and explainable."""

from stableflash.attention import SFA, AttentionStats, ClampPbar, Precision, flash_attention
from stableflash.numerics import explain_add

__version__ = "0.1.0"
__all__ = ["SFA", "AttentionStats", "ClampPbar", "Precision", "explain_add", "flash_attention", "__version__"]
