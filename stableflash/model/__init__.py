"""GPT-2 with per-layer, per-head attention control."""

from stableflash.model.gpt import GPT, PRESET_SHAPES, LayerAttention

__all__ = ["GPT", "PRESET_SHAPES", "LayerAttention"]
