"""How often the fused kernels' emulated presets give the reference's bits, output and gradients.

For each emulated policy (`EMULATED_VARIANTS` of `tests/attention/variants.py`, or any preset), with and without
SFA (or with SFA's official rule, which is emulated under every policy), causal or not, at the policy's tiles or
others, on fresh random inputs: the fraction of entries of O, dQ, dK and dV equal bit for bit to the reference
backend's under the same policy. The GPU tests assert >= 95% of outputs (80% of gradients); this reports the figure.
On a GPU, or on the CPU with TRITON_INTERPRET=1.

    python research/emulation_agreement.py --out results/emulation-agreement/emulation-agreement-h200.json
    TRITON_INTERPRET=1 python research/emulation_agreement.py --shapes 1,2,130,16 --draws 1 --variants paper
    python research/emulation_agreement.py --variants fa2,paper --stabilize official --tiles 512,64 \
        --causal yes,no --shapes 1,2,1100,64 --draws 10
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

from stableflash import SFA, flash_attention
from stableflash.attention.triton.spec import INTERPRET

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root: the tests' catalogue
from tests.attention.conftest import tied_below_zero_inputs, tied_inputs  # noqa: E402
from tests.attention.variants import EMULATED_VARIANTS, emulated_variant  # noqa: E402

OUTPUTS = ("out", "dq", "dk", "dv")


STABILIZERS = {"none": lambda: None, "sfa": SFA, "official": SFA.official}
# q, k and v: fresh normal draws, or the GPU tests' fixed rows with 3 tied maximal scores (positive, or negative:
# SFA's m = 0 case), where only dO is drawn afresh
INPUTS = {
    "random": lambda shape, g: [torch.randn(*shape, generator=g) for _ in range(3)],
    "tied": lambda shape, g: tied_inputs(3, T=shape[2], D=shape[3], heads=shape[1]),
    "tied-below-zero": lambda shape, g: tied_below_zero_inputs(3, T=shape[2], D=shape[3], heads=shape[1]),
}


def _attention(backend: str, q, k, v, policy, stabilize, causal: bool):
    if backend == "triton" and INTERPRET:  # the public API sends CPU tensors to the reference: call the kernels
        from stableflash.attention import triton as kernels
        return kernels.attention(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, policy=policy,
                                 stabilize=stabilize, stats=None)
    return flash_attention(q, k, v, causal=causal, precision=policy, stabilize=stabilize, backend=backend)


def _run(backend: str, policy, stabilize, causal: bool, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = _attention(backend, q, k, v, policy, stabilize, causal)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def agreement(name: str, stabilize, shape, draws: int, device: str, seed: int, causal: bool = True,
              tiles: int | None = None, inputs: str = "random") -> dict:
    """Per output, the smallest and the mean fraction of bit-equal entries over `draws` fresh inputs, and each
    draw's (`draws`); `tiles` replaces the policy's query and key tile."""
    policy = emulated_variant(name)
    if tiles:
        policy = policy.replace(block_m=tiles, block_n=tiles)
    generator = torch.Generator().manual_seed(seed)
    fractions = {what: [] for what in OUTPUTS}
    for _ in range(draws):
        q, k, v = (t.to(torch.bfloat16).to(device) for t in INPUTS[inputs](shape, generator))
        dout = torch.randn(*q.shape, generator=generator).to(torch.bfloat16).to(device)
        ours = _run("triton", policy, stabilize, causal, q, k, v, dout)
        ref = _run("reference", policy, stabilize, causal, q, k, v, dout)
        for what, a, r in zip(OUTPUTS, ours, ref):
            fractions[what].append((a == r).float().mean().item())
    return {what: {"min": min(f), "mean": sum(f) / len(f), "draws": f} for what, f in fractions.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/emulation-agreement.json"))
    parser.add_argument("--shapes", default="2,3,77,64;1,4,513,64;2,2,1000,128", help="B,H,T,D;...")
    parser.add_argument("--variants", default=",".join(EMULATED_VARIANTS))
    parser.add_argument("--draws", type=int, default=3, help="fresh random inputs per setting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stabilize", default="none,sfa", help=f"of {','.join(STABILIZERS)}")
    parser.add_argument("--causal", default="yes", help="yes, no or yes,no")
    parser.add_argument("--tiles", default="", help="query and key tile sizes to try in place of the policy's, e.g. "
                                                     "512,64 (default: the policy's own)")
    parser.add_argument("--inputs", default="random", help=f"of {','.join(INPUTS)} (tied: B = 1)")
    args = parser.parse_args()
    if set(args.inputs.split(",")) - set(INPUTS):
        parser.error(f"--inputs: expected names of {sorted(INPUTS)}, got {args.inputs!r}")
    if args.inputs != "random" and any(not s.startswith("1,") for s in args.shapes.split(";")):
        parser.error(f"--shapes: tied inputs are one batch row (B = 1), got {args.shapes!r}")
    unknown = set(args.stabilize.split(",")) - set(STABILIZERS)
    if unknown:
        parser.error(f"--stabilize: expected names of {sorted(STABILIZERS)}, got {sorted(unknown)}")
    if set(args.causal.split(",")) - {"yes", "no"}:
        parser.error(f"--causal: expected yes, no or yes,no, got {args.causal!r}")
    if not (INTERPRET or torch.cuda.is_available()):
        parser.error("needs a CUDA GPU, or TRITON_INTERPRET=1 for the CPU")
    device = "cpu" if INTERPRET else "cuda"
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    rows = []
    tiles = [int(t) for t in args.tiles.split(",")] if args.tiles else [None]
    print(f"{'variant':<16}{'sfa':<9}{'causal':<7}{'tiles':<7}{'inputs':<16}{'shape':<20}" + "".join(f"{w:>14}" for w in OUTPUTS)
          + "   (min / mean % bit-equal)")
    for shape in shapes:
        for name in args.variants.split(","):
            for rule, causal, tile, inputs in itertools.product(args.stabilize.split(","), args.causal.split(","),
                                                                tiles, args.inputs.split(",")):
                result = agreement(name, STABILIZERS[rule](), shape, args.draws, device, args.seed,
                                   causal=causal == "yes", tiles=tile, inputs=inputs)
                rows.append({"variant": name, "sfa": rule != "none", "stabilize": rule, "causal": causal == "yes",
                             "tiles": tile, "inputs": inputs, "shape": list(shape), "draws": args.draws, **result})
                cells = "".join(f"{100 * result[w]['min']:>7.2f}/{100 * result[w]['mean']:<6.2f}" for w in OUTPUTS)
                print(f"{name:<16}{rule:<9}{causal:<7}{str(tile or '-'):<7}{inputs:<16}{str(shape):<20}{cells}",
                      flush=True)
    meta = {"device": "cpu (triton interpreter)" if INTERPRET else torch.cuda.get_device_name(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "commit": os.environ.get("STABLEFLASH_COMMIT"), "dtype": "bf16",
            "fraction": "entries equal bit for bit to the reference backend under the same policy"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
