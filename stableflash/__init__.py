"""stableflash: BF16 flash-attention training that is stable, fast, and explainable."""

import importlib

__version__ = "0.1.0"
# Imported on first use, so that a command that needs none of them (`stableflash explain-add`) starts in a
# second instead of paying for torch.compile's machinery, which the attention layer pulls in.
_EXPORTS = {"SFA": "stableflash.attention", "AttentionStats": "stableflash.attention",
            "ClampPbar": "stableflash.attention", "Precision": "stableflash.attention",
            "flash_attention": "stableflash.attention", "flash_attn_func": "stableflash.attention",
            "flash_attn_varlen_func": "stableflash.attention", "flash_attn_qkvpacked_func": "stableflash.attention",
            "flash_attn_kvpacked_func": "stableflash.attention", "flash_attn_varlen_qkvpacked_func": "stableflash.attention",
            "flash_attn_varlen_kvpacked_func": "stableflash.attention", "flash_attn_with_kvcache": "stableflash.attention",
            "sdpa": "stableflash.attention",
            "route_sdpa": "stableflash.attention", "explain_add": "stableflash.numerics",
            "watch": "stableflash.integrations.watch"}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stableflash' has no attribute {name!r}")
