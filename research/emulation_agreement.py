"""How often the fused kernels' emulated presets give the reference's bits, output and gradients.

For each emulated policy (`EMULATED_VARIANTS` of `tests/attention/variants.py`), with and without SFA, on fresh
random inputs: the fraction of entries of O, dQ, dK and dV equal bit for bit to the reference backend's under the
same policy. The GPU tests assert >= 95% of outputs (80% of gradients); this reports the figure. On a GPU, or on the
CPU with TRITON_INTERPRET=1.

    python research/emulation_agreement.py --out results/emulation-agreement/emulation-agreement-h200.json
    TRITON_INTERPRET=1 python research/emulation_agreement.py --shapes 1,2,130,16 --draws 1 --variants paper
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from stableflash import SFA, flash_attention
from stableflash.attention.triton.spec import INTERPRET

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root: the tests' catalogue
from tests.attention.variants import EMULATED_VARIANTS, emulated_variant  # noqa: E402

OUTPUTS = ("out", "dq", "dk", "dv")


def _attention(backend: str, q, k, v, policy, stabilize):
    if backend == "triton" and INTERPRET:  # the public API sends CPU tensors to the reference: call the kernels
        from stableflash.attention import triton as kernels
        return kernels.attention(q, k, v, causal=True, scale=q.shape[-1] ** -0.5, policy=policy, stabilize=stabilize,
                                 stats=None)
    return flash_attention(q, k, v, precision=policy, stabilize=stabilize, backend=backend)


def _run(backend: str, policy, stabilize, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = _attention(backend, q, k, v, policy, stabilize)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def agreement(name: str, stabilize, shape, draws: int, device: str, seed: int) -> dict:
    """Per output, the smallest and the mean fraction of bit-equal entries over `draws` fresh inputs."""
    policy = emulated_variant(name)
    generator = torch.Generator().manual_seed(seed)
    fractions = {what: [] for what in OUTPUTS}
    for _ in range(draws):
        q, k, v, dout = (torch.randn(*shape, generator=generator).to(torch.bfloat16).to(device) for _ in range(4))
        ours = _run("triton", policy, stabilize, q, k, v, dout)
        ref = _run("reference", policy, stabilize, q, k, v, dout)
        for what, a, r in zip(OUTPUTS, ours, ref):
            fractions[what].append((a == r).float().mean().item())
    return {what: {"min": min(f), "mean": sum(f) / len(f)} for what, f in fractions.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/emulation-agreement.json"))
    parser.add_argument("--shapes", default="2,3,77,64;1,4,513,64;2,2,1000,128", help="B,H,T,D;...")
    parser.add_argument("--variants", default=",".join(EMULATED_VARIANTS))
    parser.add_argument("--draws", type=int, default=3, help="fresh random inputs per setting")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not (INTERPRET or torch.cuda.is_available()):
        parser.error("needs a CUDA GPU, or TRITON_INTERPRET=1 for the CPU")
    device = "cpu" if INTERPRET else "cuda"
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    rows = []
    print(f"{'variant':<16}{'sfa':<5}{'shape':<20}" + "".join(f"{w:>14}" for w in OUTPUTS) + "   (min / mean % bit-equal)")
    for shape in shapes:
        for name in args.variants.split(","):
            for stabilize in (None, SFA()):
                result = agreement(name, stabilize, shape, args.draws, device, args.seed)
                rows.append({"variant": name, "sfa": stabilize is not None, "shape": list(shape), "draws": args.draws,
                             **result})
                cells = "".join(f"{100 * result[w]['min']:>7.2f}/{100 * result[w]['mean']:<6.2f}" for w in OUTPUTS)
                print(f"{name:<16}{'yes' if stabilize else 'no':<5}{str(shape):<20}{cells}", flush=True)
    meta = {"device": "cpu (triton interpreter)" if INTERPRET else torch.cuda.get_device_name(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "commit": os.environ.get("STABLEFLASH_COMMIT"), "causal": True, "dtype": "bf16",
            "fraction": "entries equal bit for bit to the reference backend under the same policy"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
