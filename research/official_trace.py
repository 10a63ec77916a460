"""The analysed code as it really trained, run as an oracle, and our presets measured against it.

The paper's own repository (`ucker/why-low-precision-training-fails`) is an outside oracle, like fp64:
clone it into the git-ignored `oracle/` folder and point `--oracle` at it; nothing of it is copied here.

    git clone https://github.com/ucker/why-low-precision-training-fails oracle/why-low-precision-training-fails
    python research/official_trace.py run --oracle oracle/why-low-precision-training-fails --out OUT  # CUDA
    python research/official_trace.py compare OUT                                                     # anywhere

`run` calls the official `FlashAttentionFunction` as its `train.py` does (forward under bf16 autocast, backward
outside it), eagerly and under `torch.compile`, with `STABLE=0` and `STABLE=1`, on random inputs and on inputs
with tied maxima, and saves its outputs (`oracle-stable{0,1}.pt`; the inputs are seeded and made again), the
compile logs (AOT graphs and inductor's generated code) and, via `compare`, the bit agreement of every preset
(`agreement.json`). `compare` recomputes the agreement from the saved tensors on this machine's device.
The log-sum-exp, which the official function saves but does not return, is read from a call of its forward
with a stand-in context (eagerly, and compiled as a graph of its own). That graph's O equals the training
path's bit for bit (recorded), but its lse need not: inductor fuses it differently. dV, which reads nothing
else of the forward, checks the training path's lse.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from stableflash import SFA, flash_attention
from stableflash.attention import PRESETS
from stableflash.attention.reference import forward as reference_forward

SHAPE = (2, 4, 1024, 64)  # B, H, T, D as the issue asks
TILE = 512  # the official model's q and k bucket sizes
SINKS = (0, 1, 2, 3, 512, 513)  # identical keys: every row past 3 holds >= 2 exact maxima, across both tiles
TENSORS = ("out", "lse", "dq", "dk", "dv")


def trace_inputs(kind: str, seed: int = 0):
    """(q, k, v, dout) in bf16 on the CPU. `tied`: identical sink keys that win every row, V positive in 8 dims."""
    B, H, T, D = SHAPE
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=gen) for _ in range(4))
    if kind == "tied":
        direction = torch.nn.functional.normalize(torch.randn(1, H, 1, D, generator=gen), dim=-1)
        q = q + 8.0 * direction  # q . sink ~ 64 * scale = 8, well above the other scores (std ~1.4)
        k[:, :, list(SINKS)] = 8.0 * direction
        v[..., :8] = v[..., :8].abs() + 0.5
    elif kind != "random":
        raise ValueError(f"kind: expected 'random' or 'tied', got {kind!r}")
    return tuple(t.to(torch.bfloat16) for t in (q, k, v, dout))


def load_oracle(folder: Path):
    path = folder / "attention.py"
    if not path.is_file():
        raise SystemExit(f"--oracle: {path} not found; clone the official repository there (see this file's docstring)")
    site = folder.parent / "site"  # einops, which the oracle imports, where the machine lacks it
    if site.is_dir():
        sys.path.insert(0, str(site))
    spec = importlib.util.spec_from_file_location("official_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dynamo re-imports the module of the code it traces
    spec.loader.exec_module(module)
    return module.FlashAttentionFunction


class _Ctx:
    """Stand-in for autograd's ctx: keeps what the forward saves."""

    def save_for_backward(self, *tensors):
        self.saved = tensors


def _forward_with_lse(fn, q, k, v):
    ctx = _Ctx()
    out = fn.forward(ctx, q, k, v, None, True, TILE, TILE)
    return out, ctx.saved[4]


def _training_path(fn, q, k, v, dout, compiled, device="cuda"):
    """The model's call: forward under autocast, backward outside. Returns (out, dq, dk, dv) or raises."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    def call(a, b, c):
        return fn.apply(a, b, c, None, True, TILE, TILE)

    if compiled:
        call = torch.compile(call)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = call(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def worker(oracle: Path, out_dir: Path, stable: str, device: str = "cuda"):
    """One STABLE value (the oracle reads it from the environment at every forward)."""
    os.environ["STABLE"] = stable
    fn = load_oracle(oracle)
    record = {"stable": stable, "emulate_precision_casts": torch._inductor.config.emulate_precision_casts}
    saved = {}
    for kind in ("random", "tied"):
        q, k, v, dout = (t.to(device) for t in trace_inputs(kind))
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            eager_out, eager_lse = _forward_with_lse(fn, q, k, v)
        saved[f"{kind}/eager"] = {"out": eager_out.cpu(), "lse": eager_lse.cpu()}
        try:
            _training_path(fn, q, k, v, dout, compiled=False, device=device)
            record[f"{kind}/eager_backward"] = "ran"
        except RuntimeError as error:
            record[f"{kind}/eager_backward"] = f"{type(error).__name__}: {error}"
        torch._dynamo.reset()
        out, dq, dk, dv = _training_path(fn, q, k, v, dout, compiled=True, device=device)
        graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        forward_only = torch.compile(lambda a, b, c: _forward_with_lse(fn, a, b, c))
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            lse_out, lse = forward_only(q, k, v)
        saved[f"{kind}/compiled"] = {"out": out.cpu(), "lse": lse.cpu(), "dq": dq.cpu(), "dk": dk.cpu(), "dv": dv.cpu()}
        record[f"{kind}/compiled"] = {
            "graph_breaks": graph_breaks,
            "dtypes": {"out": str(out.dtype), "lse": str(lse.dtype), "dq": str(dq.dtype)},
            "lse_graph_out_bit_equal_to_training_out": (lse_out == out).float().mean().item(),
            "compiled_vs_eager_out_bit_equal": (out == eager_out).float().mean().item(),
        }
    torch.save(saved, out_dir / f"oracle-stable{stable}.pt")
    (out_dir / f"worker-stable{stable}.json").write_text(json.dumps(record, indent=2))


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of elements that are the same value (NaN equal to NaN), after casting both to `b`'s dtype."""
    a = a.to(b.dtype)
    return ((a == b) | (a.isnan() & b.isnan())).double().mean().item()


def _ours(q, k, v, dout, policy, stabilize):
    """O, lse, dQ, dK, dV from the reference backend under `policy`."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    with torch.no_grad():
        _, _, lse = reference_forward(q, k, v, scale=scale, causal=True, policy=policy, stabilize=stabilize)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=True, precision=policy, stabilize=stabilize, backend="reference")
    out.backward(dout.to(out.dtype))
    return {"out": out.detach(), "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def compare(out_dir: Path, device: str, presets=None) -> dict:
    """Bit agreement of each preset with the saved oracle tensors: {stable: {kind: {mode: {preset: {tensor: f}}}}}."""
    presets = presets or list(PRESETS)
    stabilizers = {"0": {"": None}, "1": {"+sfa-official": SFA.official(), "+sfa-bounded": SFA()}}
    table = {}
    for stable in ("0", "1"):
        path = out_dir / f"oracle-stable{stable}.pt"
        if not path.is_file():
            continue
        saved = torch.load(path)
        for kind in ("random", "tied"):
            inputs = [t.to(device) for t in trace_inputs(kind)]  # seeded on the CPU: the same bits anywhere
            for mode in ("eager", "compiled"):
                oracle = saved[f"{kind}/{mode}"]
                row = table.setdefault(stable, {}).setdefault(kind, {}).setdefault(mode, {})
                for name in presets:
                    if name == "fp64":
                        continue
                    for suffix, stabilize in stabilizers[stable].items():
                        ours = _ours(*inputs, PRESETS[name], stabilize)
                        row[name + suffix] = {t: bit_equal(ours[t].cpu(), oracle[t]) for t in TENSORS if t in oracle}
    return table


def print_table(table: dict) -> None:
    print(f"{'STABLE':>6} {'inputs':>7} {'oracle':>9} {'preset':>28} " + " ".join(f"{t:>7}" for t in TENSORS))
    for stable, kinds in table.items():
        for kind, modes in kinds.items():
            for mode, presets in modes.items():
                for name, fractions in presets.items():
                    cells = " ".join(f"{fractions[t]:7.4f}" if t in fractions else f"{'-':>7}" for t in TENSORS)
                    print(f"{stable:>6} {kind:>7} {mode:>9} {name:>28} {cells}")


def run(oracle: Path, out_dir: Path):
    if not torch.cuda.is_available():
        raise SystemExit("run: needs CUDA (autocast's CUDA op lists and inductor's CUDA code are what is traced)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for stable in ("0", "1"):
        log = out_dir / f"compile-stable{stable}.log"
        env = dict(os.environ, TORCH_LOGS="graph_breaks,aot_graphs,output_code", TORCH_LOGS_OUT=str(log))
        subprocess.run([sys.executable, __file__, "worker", "--oracle", str(oracle), "--out", str(out_dir),
                        "--stable", stable], check=True, env=env)
    try:
        table = compare(out_dir, "cuda")
    except Exception:  # the trace is saved either way; `compare` reruns on any machine
        traceback.print_exc()
        table = None
    import triton
    meta = {"command": " ".join(["python", "research/official_trace.py", "run", "--oracle", str(oracle), "--out", str(out_dir)]),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "shape": SHAPE, "tile": TILE, "sinks": SINKS,
            "oracle_commit": (oracle / "COMMIT").read_text().strip() if (oracle / "COMMIT").is_file() else None,
            "workers": {s: json.loads((out_dir / f"worker-stable{s}.json").read_text()) for s in ("0", "1")}}
    (out_dir / "agreement.json").write_text(json.dumps({"meta": meta, "agreement": table}, indent=2))
    if table is not None:
        print_table(table)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="trace the oracle on CUDA and compare (writes OUT)")
    p_run.add_argument("--oracle", type=Path, required=True)
    p_run.add_argument("--out", type=Path, required=True)
    p_worker = sub.add_parser("worker", help=argparse.SUPPRESS)
    p_worker.add_argument("--oracle", type=Path, required=True)
    p_worker.add_argument("--out", type=Path, required=True)
    p_worker.add_argument("--stable", choices=("0", "1"), required=True)
    p_worker.add_argument("--device", default="cuda", help="cpu only to try the script out: CPU autocast is not what trained")
    p_cmp = sub.add_parser("compare", help="bit agreement of every preset with a saved trace")
    p_cmp.add_argument("folder", type=Path)
    p_cmp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p_cmp.add_argument("--presets", nargs="*", help="preset names (default: all)")
    p_cmp.add_argument("--json", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    if args.command == "worker":
        try:
            worker(args.oracle, args.out, args.stable, args.device)
        except Exception:
            traceback.print_exc()
            raise
    elif args.command == "run":
        run(args.oracle, args.out)
    else:
        table = compare(args.folder, args.device, args.presets)
        print_table(table)
        if args.json:
            args.json.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
