"""Flash attention with controllable numerics: the public function, policies, stabilizers, stats."""

from stableflash.attention.api import BACKENDS, flash_attention
from stableflash.attention.flash_attn import flash_attn_func, flash_attn_varlen_func
from stableflash.attention.precision import PRESETS, PV_PATH, SITES, Precision, resolve
from stableflash.attention.stabilize import SFA, ClampPbar
from stableflash.attention.stats import AttentionStats

__all__ = ["BACKENDS", "PRESETS", "PV_PATH", "SITES", "AttentionStats", "ClampPbar", "Precision", "SFA", "flash_attention",
           "flash_attn_func", "flash_attn_varlen_func", "resolve"]
