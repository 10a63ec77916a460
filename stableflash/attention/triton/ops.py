"""The fused kernels as PyTorch operations: one `torch.library` custom op per direction, as flash-attn has them.

`flash_fwd` and `flash_bwd` take the kernels' specialisation by its name (`spec.spec_name`: a string, which an op can
carry) and the call's scalars as one more string (`Call`), each with a fake implementation that describes its
outputs (torch.compile, FakeTensor, `torch.export`), and `flash_fwd`'s gradient is `flash_bwd` (`register_autograd`).
Eager calls and compiled graphs run the same ops; under torch.compile they are opaque nodes that launch the kernels
when the graph runs.
"""

from __future__ import annotations

import ast
import functools
from typing import NamedTuple

import torch

from stableflash.attention.stats import STAT_COLUMNS
from stableflash.attention.triton import launch, options
from stableflash.attention.triton.spec import spec_named

_FwdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_BwdOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Call(NamedTuple):
    """A call's arguments besides its tensors and its specialisation, which the ops carry as one string (`encode`):
    torch's custom-op layer spends time quadratic in an op's argument count on every eager forward (`fill_defaults`,
    in `register_autograd`'s context setup: ~10 µs at the forward's 6 arguments on a 2-core CPU, ~41 at 14)."""
    causal: bool
    scale: float
    stats_eps: float | None = None  # the statistics' near-max eps, None without statistics
    band: tuple[int, int, bool] | None = None  # a masked call's (left, right, packed): `launch.Band`, its keep apart
    softcap: float = 0.0

    def encode(self) -> str:
        return _encoded(*self)


@torch.compiler.assume_constant_result
def _encoded(causal, scale, stats_eps, band, softcap) -> str:
    # under torch.compile evaluated once, at trace time (as `spec.spec_name`); a float's repr reads back as itself
    return repr((causal, scale, stats_eps, band, softcap))


@functools.lru_cache(maxsize=4096)
def decode(call: str) -> Call:
    return Call(*ast.literal_eval(call))


def _band(call: Call, keep: torch.Tensor | None):
    return None if call.band is None else launch.Band(call.band[0], call.band[1], keep, call.band[2])


@torch.library.custom_op("stableflash::flash_fwd", mutates_args=())
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, name: str,
              call: str) -> _FwdOutputs:
    """(out, o_saved, lse, counts, max_score): `launch.forward` for the spec `name` and the `Call` encoded in
    `call`; `keep` the band's key-padding bytes or packed table (`launch.Band`), else None."""
    c = decode(call)
    return launch.forward(q, k, v, c.causal, c.scale, name, c.stats_eps is not None, c.stats_eps or 0.0,
                          band=_band(c, keep), softcap=c.softcap)


@flash_fwd.register_fake
def _(q, k, v, keep, name, call):
    spec = spec_named(name)
    B, H, T, _ = q.shape
    out = launch.empty_in_layout_of(q, spec.out_dtype)
    o_saved = launch.empty_in_layout_of(q, torch.float32) if spec.save_fp32_o else q.new_empty(0, dtype=out.dtype)
    if decode(call).stats_eps is not None:
        counts = q.new_empty(H, len(STAT_COLUMNS), dtype=torch.int64)
        smax = q.new_empty(H, dtype=torch.float32)
    else:
        counts, smax = q.new_empty(0, dtype=torch.int64), q.new_empty(0, dtype=torch.float32)
    return out, o_saved, q.new_empty(B, H, T, dtype=torch.float32), counts, smax


@torch.library.custom_op("stableflash::flash_bwd", mutates_args=())
def flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_saved: torch.Tensor,
              lse: torch.Tensor, keep: torch.Tensor | None, name: str, call: str, atomic_dq: bool,
              group_sum: bool) -> _BwdOutputs:
    """(dq, dk, dv): `launch.backward`, for the forward's `name`, `call` and `keep`."""
    c = decode(call)
    return launch.backward(dout, q, k, v, o_saved, lse, c.causal, c.scale, name, band=_band(c, keep),
                           softcap=c.softcap, atomic_dq=atomic_dq, group_sum=group_sum)


@flash_bwd.register_fake
def _(dout, q, k, v, o_saved, lse, keep, name, call, atomic_dq, group_sum):
    return (launch.empty_in_layout_of(q, q.dtype), launch.empty_in_layout_of(k, k.dtype),
            launch.empty_in_layout_of(k, v.dtype))


def _setup_context(ctx, inputs, output):
    q, k, v, keep, name, call = inputs
    out, o_saved, lse, _, _ = output
    # only O takes a gradient: the other four outputs' are left as None, not built as zero tensors (the log-sum-exp's
    # was a GPU memset per call)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, o_saved if o_saved.numel() else out, lse, keep)
    ctx.name, ctx.call = name, call
    switches = options.current()  # the options in force at the forward choose its backward, wherever that runs
    ctx.backward_switches = (switches.atomic_dq, switches.group_sum_in_program)


def _backward(ctx, dout, *_):
    if dout is None:  # O had no gradient (only an unmaterialised output was reached): none for the inputs
        return None, None, None, None, None, None
    q, k, v, o_saved, lse, keep = ctx.saved_tensors
    dq, dk, dv = flash_bwd(dout, q, k, v, o_saved, lse, keep, ctx.name, ctx.call, *ctx.backward_switches)
    return dq, dk, dv, None, None, None


flash_fwd.register_autograd(_backward, setup_context=_setup_context)
