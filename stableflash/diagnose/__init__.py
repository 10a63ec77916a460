"""The seed's analyses as functions returning JSON-saveable dataclasses (`Record`s).

Figures (`figures`) and the HTML report (`report`) read only what these save.
"""

from stableflash.diagnose.bias import BiasAttribution, bias_attribution
from stableflash.diagnose.decompose import WqErrorDecomposition, alignment_across_steps, decompose_wq_error
from stableflash.diagnose.delta import DeltaErrors, DeltaTrace, delta_error, delta_trace, model_delta_errors
from stableflash.diagnose.pv_trace import PVTrace, pv_trace, pv_trace_from_attention

__all__ = [
    "BiasAttribution", "DeltaErrors", "DeltaTrace", "PVTrace", "WqErrorDecomposition", "alignment_across_steps",
    "bias_attribution", "decompose_wq_error", "delta_error", "delta_trace", "model_delta_errors", "pv_trace",
    "pv_trace_from_attention",
]
