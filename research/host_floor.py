"""The host's floor for an eager SFA forward+backward under one `torch.library` custom op per direction.

Three arms time the same step on dressed CPU tensors, with Triton's launches stood in for (`host_time.py`):
- `ours`: `flash_attention(..., stabilize=SFA())`, the package's whole eager path;
- `floor`: a pair of custom ops with our ops' signatures and outputs, registered as ours are (`register_autograd`,
  the same context setup), whose bodies only allocate their outputs. No change to our own code can go below it.
- `function`: the same bodies in a `torch.autograd.Function`, the eager bypass the package's design rules out. It is
  a reference for what torch's custom-op layer costs.

The arms run in one process, interleaved round by round, in an order rotated each round. Each round's ratio to
`ours` is taken within the round.

    python research/host_floor.py --out OUT.json [--rounds 7] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from host_time import SHAPE, dressed_inputs, timed, without_gpu  # research/host_time.py: this folder is on sys.path

ARMS = ("ours", "floor", "function")
_Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _forward_outputs(q: torch.Tensor) -> _Outputs:
    """What our forward op returns for SFA without statistics: O, an empty fp32 O, the (B, H, T) log-sum-exp and
    the two empty statistics."""
    B, H, T, _ = q.shape
    return (torch.empty_like(q), q.new_empty(0, dtype=torch.float32), q.new_empty(B, H, T, dtype=torch.float32),
            q.new_empty(0, dtype=torch.int64), q.new_empty(0, dtype=torch.float32))


@torch.library.custom_op("host_floor::fwd", mutates_args=())
def floor_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, name: str,
              call: str) -> _Outputs:
    return _forward_outputs(q)


@torch.library.custom_op("host_floor::bwd", mutates_args=())
def floor_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_saved: torch.Tensor,
              lse: torch.Tensor, keep: torch.Tensor | None, name: str, call: str, atomic_dq: bool,
              group_sum: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, keep, name, call = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, output[0], output[2], keep)
    ctx.name, ctx.call = name, call


def _backward(ctx, dout, *_):
    q, k, v, o_saved, lse, keep = ctx.saved_tensors
    # atomic_dq and group_sum off, as our default options pass them
    return (*floor_bwd(dout, q, k, v, o_saved, lse, keep, ctx.name, ctx.call, False, False), None, None, None)


floor_fwd.register_autograd(_backward, setup_context=_setup_context)


class FloorFunction(torch.autograd.Function):
    """The same bodies without the custom-op layer."""

    @staticmethod
    def forward(ctx, q, k, v):
        outputs = _forward_outputs(q)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, outputs[0], outputs[2])
        return outputs

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def steps() -> dict:
    """Each arm's eager forward+backward, on one set of dressed inputs."""
    from stableflash import SFA, flash_attention

    without_gpu()
    q, k, v, dout = dressed_inputs()
    # strings standing in for the spec name and the encoded scalars our ops carry; the floor ops never read them
    name, call = "sfa-bf16-d64", repr((True, 0.125, None, None, 0.0))
    forwards = {"ours": lambda: flash_attention(q, k, v, causal=True, backend="triton", stabilize=SFA()),
                "floor": lambda: floor_fwd(q, k, v, None, name, call)[0],
                "function": lambda: FloorFunction.apply(q, k, v)[0]}

    def step(forward):
        def run():
            q.grad = k.grad = v.grad = None
            forward().backward(dout)
        return run

    return {arm: step(forward) for arm, forward in forwards.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="write the rounds and the summary here as JSON")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=2000, help="calls timed per measurement")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        parser.error(f"--rounds and --repeats: expected at least 1, got {args.rounds} and {args.repeats}")
    arms = steps()
    rounds = []
    for i in range(args.rounds):
        order = ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]
        rounds.append({arm: timed(arms[arm], args.repeats) for arm in order})
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{a} {rounds[-1][a]:.1f} µs" for a in ARMS),
              file=sys.stderr, flush=True)
    summary = {arm: {"median_us": statistics.median(r[arm] for r in rounds),
                     "to_ours": statistics.median(r[arm] / r["ours"] for r in rounds),
                     "to_ours_range": [min(r[arm] / r["ours"] for r in rounds),
                                       max(r[arm] / r["ours"] for r in rounds)]} for arm in ARMS}
    print(f"{'arm':<10}{'µs, median':>12}{'/ ours':>9}{'range':>16}   (SFA forward+backward, {args.rounds} rounds)")
    for arm, row in summary.items():
        low, high = row["to_ours_range"]
        print(f"{arm:<10}{row['median_us']:12.1f}{row['to_ours']:9.3f}{low:8.3f}-{high:.3f}")
    machine = {"python": sys.version.split()[0], "torch": torch.__version__, "cpus": os.cpu_count(), "shape": SHAPE,
               "repeats": args.repeats}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "summary": summary, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
