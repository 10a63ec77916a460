"""The seed's analyses as functions returning JSON-saveable dataclasses (`Record`s).

Figures (`figures`) and the HTML report (`report`) read only what these save. The names below are imported on
first use, so that the command line can build its parser without the attention layer.
"""

import importlib

_EXPORTS = {
    "BiasAttribution": "bias", "bias_attribution": "bias", "WqErrorDecomposition": "decompose",
    "alignment_across_steps": "decompose", "decompose_wq_error": "decompose", "DeltaErrors": "delta",
    "DeltaTrace": "delta", "delta_error": "delta", "delta_trace": "delta", "model_delta_errors": "delta",
    "PVTrace": "pv_trace", "pv_trace": "pv_trace", "pv_trace_from_attention": "pv_trace",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"stableflash.diagnose.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'stableflash.diagnose' has no attribute {name!r}")
