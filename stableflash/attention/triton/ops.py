"""The fused kernels as PyTorch operations: one `torch.library` custom op per direction, as flash-attn has them.

`flash_fwd` and `flash_bwd` take the kernels' specialisation by its name (`spec.spec_name`: a string, which an op can
carry), each with a fake implementation that describes its outputs (torch.compile, FakeTensor, `torch.export`), and
`flash_fwd`'s gradient is `flash_bwd` (`register_autograd`). Eager calls and compiled graphs run the same ops; under
torch.compile they are opaque nodes that launch the kernels when the graph runs.
"""

from __future__ import annotations

import torch

from stableflash.attention.stats import STAT_COLUMNS
from stableflash.attention.triton import launch, options
from stableflash.attention.triton.spec import spec_named

_FwdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_BwdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def band_fields(band) -> tuple:
    """A `launch.Band` (or None) as the ops' arguments: masked, left, right, keep, packed."""
    return (False, -1, -1, None, False) if band is None else (True, band.left, band.right, band.keep, band.packed)


def _band(masked: bool, left: int, right: int, keep, packed: bool):
    return launch.Band(left, right, keep, packed) if masked else None


@torch.library.custom_op("stableflash::flash_fwd", mutates_args=())
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, name: str,
              stats: bool, stats_eps: float, masked: bool = False, left: int = -1, right: int = -1,
              keep: torch.Tensor | None = None, packed: bool = False, softcap: float = 0.0) -> _FwdOutputs:
    """(out, o_saved, lse, counts, max_score): `launch.forward`."""
    return launch.forward(q, k, v, causal, scale, name, stats, stats_eps, band=_band(masked, left, right, keep, packed),
                          softcap=softcap)


@flash_fwd.register_fake
def _(q, k, v, causal, scale, name, stats, stats_eps, masked=False, left=-1, right=-1, keep=None, packed=False,
      softcap=0.0):
    spec = spec_named(name)
    B, H, T, _ = q.shape
    out = launch.empty_in_layout_of(q, spec.out_dtype)
    o_saved = launch.empty_in_layout_of(q, torch.float32) if spec.save_fp32_o else q.new_empty(0, dtype=out.dtype)
    if stats:
        counts = q.new_empty(H, len(STAT_COLUMNS), dtype=torch.int64)
        smax = q.new_empty(H, dtype=torch.float32)
    else:
        counts, smax = q.new_empty(0, dtype=torch.int64), q.new_empty(0, dtype=torch.float32)
    return out, o_saved, q.new_empty(B, H, T, dtype=torch.float32), counts, smax


@torch.library.custom_op("stableflash::flash_bwd", mutates_args=())
def flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_saved: torch.Tensor,
              lse: torch.Tensor, causal: bool, scale: float, name: str, masked: bool = False, left: int = -1,
              right: int = -1, keep: torch.Tensor | None = None, packed: bool = False,
              softcap: float = 0.0, atomic_dq: bool = False, group_sum: bool = True) -> _BwdOutputs:
    """(dq, dk, dv): `launch.backward`."""
    return launch.backward(dout, q, k, v, o_saved, lse, causal, scale, name,
                           band=_band(masked, left, right, keep, packed), softcap=softcap, atomic_dq=atomic_dq,
                           group_sum=group_sum)


@flash_bwd.register_fake
def _(dout, q, k, v, o_saved, lse, causal, scale, name, masked=False, left=-1, right=-1, keep=None, packed=False,
      softcap=0.0, atomic_dq=False, group_sum=True):
    return (launch.empty_in_layout_of(q, q.dtype), launch.empty_in_layout_of(k, k.dtype),
            launch.empty_in_layout_of(k, v.dtype))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, name, _, _, masked, left, right, keep, packed, softcap = inputs
    out, o_saved, lse, _, _ = output
    ctx.save_for_backward(q, k, v, o_saved if o_saved.numel() else out, lse, keep)
    ctx.causal, ctx.scale, ctx.name, ctx.band, ctx.softcap = causal, scale, name, (masked, left, right, packed), softcap
    switches = options.current()  # the options in force at the forward choose its backward, wherever that runs
    ctx.backward_switches = (switches.atomic_dq, switches.group_sum_in_program)


def _backward(ctx, dout, *_):
    q, k, v, o_saved, lse, keep = ctx.saved_tensors
    masked, left, right, packed = ctx.band
    dq, dk, dv = flash_bwd(dout, q, k, v, o_saved, lse, ctx.causal, ctx.scale, ctx.name, masked, left, right, keep,
                           packed, ctx.softcap, *ctx.backward_switches)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


flash_fwd.register_autograd(_backward, setup_context=_setup_context)
