"""The fused kernels as PyTorch operations: an `autograd.Function` for eager calls, `torch.library` ops for compiled.

The ops name the kernels' specialisation by its string (`spec.spec_name`). Two pairs:
- `flash_fwd` / `flash_bwd` (`custom_op`): opaque to torch.compile, with fake implementations that describe the
  outputs; used under the interpreter, for the Gluon forward (inductor launches only Triton kernels), and for a
  forward that rounds stochastically (its seed is drawn when the call runs, not when it is traced);
- `flash_fwd_traced` / `flash_bwd_traced` (`triton_op`): on a GPU, inductor traces into them and launches the kernels
  from its own generated code, with no Python op per call.
"""

from __future__ import annotations

import torch
from torch.library import triton_op

from stableflash.attention.triton import launch
from stableflash.attention.triton.spec import INTERPRET, spec_named

_FwdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_BwdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class FlashAttention(torch.autograd.Function):
    """The eager path: the launches without the custom op's dispatch. With `stat_targets` the kernel adds its counts
    to them in place (no output, no kernel after it)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, name, stats, stats_eps, stat_targets, band):
        output = launch.forward(q, k, v, causal, scale, name, stats, stats_eps, stat_targets=stat_targets, band=band,
                                shared_empties=True)
        _setup_context(ctx, (q, k, v, causal, scale, name, stats, stats_eps, *band_fields(band)), output)
        return output[0]

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, o_saved, lse, keep = ctx.saved_tensors
        dq, dk, dv = launch.backward(dout, q, k, v, o_saved, lse, ctx.causal, ctx.scale, ctx.name,
                                     band=_band(ctx.masked, *ctx.bounds, keep, ctx.packed))
        return dq, dk, dv, None, None, None, None, None, None, None


def band_fields(band) -> tuple:
    """A `launch.Band` (or None) as the ops' arguments: masked, left, right, keep, packed."""
    return (False, -1, -1, None, False) if band is None else (True, band.left, band.right, band.keep, band.packed)


def _band(masked: bool, left: int, right: int, keep, packed: bool):
    return launch.Band(left, right, keep, packed) if masked else None


def _setup_context(ctx, inputs, output):
    """What the backward needs (shared by the ops' autograd and `FlashAttention`)."""
    q, k, v, causal, scale, name, _, _, masked, left, right, keep, packed = inputs
    out, o_saved, lse, _, _ = output
    ctx.save_for_backward(q, k, v, o_saved if o_saved.numel() else out, lse, keep)
    ctx.causal, ctx.scale, ctx.name, ctx.masked, ctx.bounds = causal, scale, name, masked, (left, right)
    ctx.packed = packed


# -- opaque ops -------------------------------------------------------------------------------------------------------

@torch.library.custom_op("stableflash::flash_fwd", mutates_args=())
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, name: str,
              stats: bool, stats_eps: float, masked: bool = False, left: int = -1, right: int = -1,
              keep: torch.Tensor | None = None, packed: bool = False) -> _FwdOutputs:
    return launch.forward(q, k, v, causal, scale, name, stats, stats_eps,
                          band=_band(masked, left, right, keep, packed))


@flash_fwd.register_fake
def _(q, k, v, causal, scale, name, stats, stats_eps, masked=False, left=-1, right=-1, keep=None, packed=False):
    spec = spec_named(name)
    B, H, T, _ = q.shape
    out = launch.empty_in_layout_of(q, spec.out_dtype)
    o_saved = launch.empty_in_layout_of(q, torch.float32) if spec.save_fp32_o else q.new_empty(0)
    return (out, o_saved, q.new_empty(B, H, T, dtype=torch.float32), q.new_empty(H, 3, dtype=torch.int64),
            q.new_empty(H, dtype=torch.float32))


@torch.library.custom_op("stableflash::flash_bwd", mutates_args=())
def flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_saved: torch.Tensor,
              lse: torch.Tensor, causal: bool, scale: float, name: str, masked: bool = False, left: int = -1,
              right: int = -1, keep: torch.Tensor | None = None, packed: bool = False) -> _BwdOutputs:
    return launch.backward(dout, q, k, v, o_saved, lse, causal, scale, name,
                           band=_band(masked, left, right, keep, packed))


@flash_bwd.register_fake
def _(dout, q, k, v, o_saved, lse, causal, scale, name, masked=False, left=-1, right=-1, keep=None, packed=False):
    return (launch.empty_in_layout_of(q, q.dtype), launch.empty_in_layout_of(k, k.dtype),
            launch.empty_in_layout_of(k, v.dtype))


def _backward(ctx, dout, *_):
    q, k, v, o_saved, lse, keep = ctx.saved_tensors
    dq, dk, dv = flash_bwd(dout, q, k, v, o_saved, lse, ctx.causal, ctx.scale, ctx.name, ctx.masked, *ctx.bounds,
                           keep, ctx.packed)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


flash_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- traced ops -------------------------------------------------------------------------------------------------------

# triton_op: the function is also the fake implementation (it only allocates and launches), and under torch.compile
# it is traced into, so inductor sees each `wrap_triton` launch
@triton_op("stableflash::flash_fwd_traced", mutates_args=())
def flash_fwd_traced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, name: str,
                     stats: bool, stats_eps: float, masked: bool = False, left: int = -1, right: int = -1,
                     keep: torch.Tensor | None = None, packed: bool = False) -> _FwdOutputs:
    spec = spec_named(name)
    if spec.stochastic or (not masked and launch.hopper_forward_tile(spec, q, k, v, stats) is not None):
        # a node of its own (the Gluon forward, or a seed drawn when the call runs); the backward is traced
        return flash_fwd(q, k, v, causal, scale, name, stats, stats_eps, masked, left, right, keep, packed)
    return launch.forward(q, k, v, causal, scale, name, stats, stats_eps, traced=True,
                          band=_band(masked, left, right, keep, packed))


@triton_op("stableflash::flash_bwd_traced", mutates_args=())
def flash_bwd_traced(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_saved: torch.Tensor,
                     lse: torch.Tensor, causal: bool, scale: float, name: str, masked: bool = False, left: int = -1,
                     right: int = -1, keep: torch.Tensor | None = None, packed: bool = False) -> _BwdOutputs:
    if spec_named(name).backward_stochastic:  # its seed drawn when the call runs: a node of its own
        return flash_bwd(dout, q, k, v, o_saved, lse, causal, scale, name, masked, left, right, keep, packed)
    return launch.backward(dout, q, k, v, o_saved, lse, causal, scale, name, traced=True,
                           band=_band(masked, left, right, keep, packed))


def _backward_traced(ctx, dout, *_):
    q, k, v, o_saved, lse, keep = ctx.saved_tensors
    dq, dk, dv = flash_bwd_traced(dout, q, k, v, o_saved, lse, ctx.causal, ctx.scale, ctx.name, ctx.masked,
                                  *ctx.bounds, keep, ctx.packed)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


flash_fwd_traced.register_autograd(_backward_traced, setup_context=_setup_context)


def compiled_forward_op():
    """The forward op for traced (torch.compile) code: the `triton_op` on a GPU, the opaque op under the interpreter
    (there inductor cannot launch kernels)."""
    return flash_fwd if INTERPRET else flash_fwd_traced
