"""Flash attention with controllable numerics: the public function, policies, stabilizers, stats."""

from stableflash.attention.api import BACKENDS, flash_attention
from stableflash.attention.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from stableflash.attention.precision import PRESETS, PV_PATH, SITES, Precision, resolve
from stableflash.attention.sdpa import route_sdpa, sdpa
from stableflash.attention.stabilize import SFA, ClampPbar
from stableflash.attention.stats import AttentionStats

__all__ = ["BACKENDS", "PRESETS", "PV_PATH", "SITES", "AttentionStats", "ClampPbar", "Precision", "SFA", "flash_attention",
           "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache", "resolve",
           "route_sdpa", "sdpa"]
