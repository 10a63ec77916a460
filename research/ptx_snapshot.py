"""The PTX of a fixed set of kernel specialisations, compiled for sm_90 on any machine: to show that a refactoring
of the kernels' source changed no generated code (so no device time), without a GPU.

    python research/ptx_snapshot.py capture DIR        # at the commit before, and again at the one after
    python research/ptx_snapshot.py compare BEFORE AFTER

`compare` strips comments, whitespace and the kernel's own name (an entry kernel's rename changes only those).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import sys
from pathlib import Path

os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # line numbers move with any edit
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from offline_compile import _POINTERS, compile_function, constexprs, kernel_of, resource_usage  # noqa: E402

from stableflash import SFA  # noqa: E402
from stableflash.attention.precision import resolve  # noqa: E402
from stableflash.attention.triton import decoding, hopper, launch, native, tuning  # noqa: E402
from stableflash.attention.triton.spec import spec_name  # noqa: E402

MASKED = {"MASK": True, "PAD": True}
PACKED_CAPPED = {**MASKED, "SEG": True, "SOFTCAP": True}
# label: (policy, stabilizer, head dim, kernel, tile, extra constants, causal, statistics)
ATTENTION = {
    "native-fwd-d64": ("fa2", None, 64, "fwd", tuning.FWD_CONFIGS[0], False, {}, True, False),
    "native-fwd-sfa-stats-d128-tma": ("fa2", SFA(), 128, "fwd", tuning.FWD_CONFIGS[2], True, {}, True, True),
    "native-fwd-packed-softcap-d128": ("fa2", None, 128, "fwd", tuning.FWD_CONFIGS[0], False, PACKED_CAPPED, False,
                                       False),
    "native-dq-d64": ("fa2", None, 64, "dq", tuning.DQ_CONFIGS[0], False, {}, True, False),
    "native-dq-packed-softcap-d128-tma": ("fa2", None, 128, "dq", tuning.DQ_CONFIGS[0], True, PACKED_CAPPED, False,
                                          False),
    "native-dkdv-d64": ("fa2", None, 64, "dkdv", tuning.DKDV_CONFIGS[0], False, {}, True, False),
    "native-dkdv-gqa-atomic-dq-d128-tma": ("fa2", None, 128, "dkdv", tuning.config(64, 128, 8, 3), True,
                                           {"GROUP": 4, "ATOMIC_DQ": True}, True, False),
    "native-dkdv-sfa-padded-d128": ("fa2", SFA(), 128, "dkdv", tuning.DKDV_CONFIGS[0], False, MASKED, False, False),
    "emulated-fwd-paper-stats": ("paper", None, 64, "fwd", tuning.emulation_config(False, 64), None, {}, True, True),
    "emulated-fwd-bf16-masked": ("bf16", None, 64, "fwd", tuning.emulation_config(False, 64), None, MASKED, False,
                                 False),
    "emulated-dq-paper": ("paper", None, 64, "dq", tuning.emulation_config(False, 64), None, {}, True, False),
    "emulated-dkdv-fp32": ("fp32", None, 64, "dkdv", tuning.emulation_config(True, 64), None, {}, True, False),
    "emulated-delta-dpp": ("paper+dp_p", None, 64, "delta_dpp", tuning.emulation_config(False, 64), None, {}, True,
                           False),
}
OTHERS = ("native-delta-d128", "decode-split-paged-softcap", "decode-combine", "gluon-fwd-sfa-stats")
LABELS = (*ATTENTION, *OTHERS)
_DECODE_POINTERS = {"O_PART": "*fp32", "LSE_PART": "*fp32", "FIRST": "*i64", "CACHE_ROWS": "*i64", "TABLE": "*i32",
                    "OUT": "*bf16", "SEEN": "*i64"}


def _kernel(module, name: str):
    """An entry kernel by its name, private (`_attn_fwd`) or as it was before the rename: captures at either commit."""
    return getattr(module, f"_{name}", None) or getattr(module, name)


def _spec(policy: str, stabilize, head_dim: int) -> str:
    base, _, knob = policy.partition("+")
    pol = resolve(base).with_delta("dp_p") if knob == "dp_p" else resolve(base)
    return spec_name(pol, stabilize, torch.bfloat16, head_dim, 4096)


def _compile(label: str):
    saved = dict(_POINTERS)
    try:
        if label in ATTENTION:
            policy, stabilize, head_dim, kernel, config, tma, extra, causal, stats = ATTENTION[label]
            if tma is not None:
                config = tuning.config(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps,
                                       config.num_stages, TMA=tma)
            if extra.get("SEG"):
                _POINTERS["KEEP"] = "*i32"
            name = _spec(policy, stabilize, head_dim)
            consts = {**constexprs(name, kernel, head_dim, config, causal=causal, stats=stats), **extra}
            return compile_function(kernel_of(name, kernel), consts,
                                    {"num_warps": config.num_warps, "num_stages": config.num_stages})
        if label == "native-delta-d128":
            return compile_function(_kernel(native, "attn_bwd_delta"), {"HEAD_DIM": 128, **tuning.DELTA_CONFIG.kwargs},
                                    {"num_warps": tuning.DELTA_CONFIG.num_warps, "num_stages": 1})
        if label.startswith("decode"):
            _POINTERS.update(_DECODE_POINTERS)
            if label == "decode-split-paged-softcap":
                return compile_function(decoding._decode_split, {
                    "GROUP": 4, "HEAD_DIM": 128, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_D": 128, "PAGED": True,
                    "SOFTCAP": True, "UNIFORM": False}, {"num_warps": 4, "num_stages": 3})
            return compile_function(decoding._decode_combine, {"HEAD_DIM": 128, "BLOCK_S": 16, "BLOCK_D": 128},
                                    {"num_warps": 4})
        from triton.experimental.gluon._runtime import GluonASTSource

        (head_dim, _), choice = next((key, c) for key, c in hopper.FORWARD_TILES.items() if c is not None and key[1])
        consts, config = launch._hopper_constants(_spec("fa2", SFA(), head_dim), head_dim, torch.bfloat16, True,
                                                  choice.tile, True)
        return compile_function(_kernel(hopper, "attn_fwd"), {**consts, "num_warps": config.num_warps},
                                {"num_warps": config.num_warps}, source_type=GluonASTSource)
    finally:
        _POINTERS.clear()
        _POINTERS.update(saved)


def _capture(label: str) -> tuple[str, str, dict]:
    compiled = _compile(label)
    return label, compiled.asm["ptx"], resource_usage(compiled)


def capture(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    usage = {}
    with concurrent.futures.ProcessPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        for label, ptx, resources in pool.map(_capture, LABELS):
            (folder / f"{label}.ptx").write_text(ptx)
            usage[label] = resources
            print(f"{label:40s} {resources}", flush=True)
    (folder / "resources.json").write_text(json.dumps(usage, indent=1))


def _normalised(ptx: str) -> list[str]:
    name = re.search(r"\.entry (\w+)\(", ptx)[1]
    lines = (line.split("//")[0] for line in ptx.replace(name, "KERNEL").splitlines())
    return [" ".join(line.split()) for line in lines if line.strip()]


def compare(before: Path, after: Path) -> bool:
    same = True
    for label in LABELS:
        a, b = (_normalised((folder / f"{label}.ptx").read_text()) for folder in (before, after))
        differing = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
        same &= differing == 0
        print(f"{label:40s} {'identical' if differing == 0 else f'{differing} lines differ'} ({len(b)} lines)")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("capture").add_argument("folder", type=Path)
    pair = sub.add_parser("compare")
    pair.add_argument("before", type=Path)
    pair.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "capture":
        capture(args.folder)
    else:
        sys.exit(0 if compare(args.before, args.after) else 1)


if __name__ == "__main__":
    main()
