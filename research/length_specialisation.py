"""Does a kernel's code depend on whether a sequence length or a band bound is a multiple of 16?

Triton specialises every integer argument on divisibility by 16, so each such flag that varies between calls is
another build of the kernel: in flash-attn's test file, the query length `T` and the band's integers (key length,
window bounds, the key table's stride) multiply the forward kernel's builds about fourfold (results/drop-ins/).
Leaving an argument unspecialised (`do_not_specialize`) saves those builds only if the code does not use the fact.
This compiles the native kernels for sm_90 on any machine (`offline_compile`) both ways and compares them: global
loads, stores and asynchronous copies (by width), PTX instructions and registers.

    python research/length_specialisation.py --out results/drop-ins/length-specialisation.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")  # compile, even where the package's tests run the interpreter

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_compile import INSTRUCTION_START, compile_kernel, constexprs, memory_instructions, resource_usage  # noqa: E402

from stableflash.attention.precision import resolve  # noqa: E402
from stableflash.attention.triton import tuning  # noqa: E402
from stableflash.attention.triton.spec import spec_name  # noqa: E402

LENGTHS = ("T",)
BAND = ("TK", "LEFT", "RIGHT", "stride_keep")
TILES = {"fwd": tuning.config(128, 64, 8, 3, TMA=False), "dq": tuning.config(128, 64, 8, 3, TMA=False),
         "dkdv": tuning.config(64, 128, 8, 3, TMA=False)}


def _instructions(compiled) -> int:
    return len(re.findall(INSTRUCTION_START + r"[a-z][\w.]*[ \t;]", compiled.asm["ptx"], re.MULTILINE))


def compare(head_dim: int, kernel: str, masked: bool, names: tuple[str, ...]) -> dict:
    """One kernel compiled with `names` known divisible by 16 and not (every other hint as a launch at T = 4096)."""
    name = spec_name(resolve("fa2"), None, torch.bfloat16, head_dim, 4096)
    config = TILES[kernel]
    consts = constexprs(name, kernel, head_dim, config)
    if masked:  # the band's form: a window, Tk != Tq, key padding
        consts = {**consts, "CAUSAL": False, "MASK": True}
    builds = {known: compile_kernel(name, kernel, consts, config, divisible={n: known for n in names})
              for known in (True, False)}
    row = {"head_dim": head_dim, "kernel": kernel, "form": "band" if masked else "plain", "unspecialised": list(names)}
    for known, compiled in builds.items():
        side = "divisible" if known else "not_divisible"
        row[side] = {"instructions": _instructions(compiled), "registers": resource_usage(compiled)["registers"],
                     "memory": dict(sorted(memory_instructions(compiled).items()))}
    row["same_memory"] = row["divisible"]["memory"] == row["not_divisible"]["memory"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for head_dim in (64, 128):
        for kernel in ("fwd", "dq", "dkdv"):
            rows.append(compare(head_dim, kernel, False, LENGTHS))
            rows.append(compare(head_dim, kernel, True, LENGTHS))
            rows.append(compare(head_dim, kernel, True, BAND))
    print(f"{'D':>4s} {'kernel':6s} {'form':5s} {'unspecialised':28s} {'PTX instr':>17s} {'registers':>10s}  memory")
    for row in rows:
        a, b = row["divisible"], row["not_divisible"]
        memory = "same" if row["same_memory"] else ", ".join(
            f"{op} {a['memory'].get(op, 0)}->{b['memory'].get(op, 0)}"
            for op in sorted(set(a["memory"]) | set(b["memory"])) if a["memory"].get(op) != b["memory"].get(op))
        print(f"{row['head_dim']:4d} {row['kernel']:6s} {row['form']:5s} {','.join(row['unspecialised']):28s} "
              f"{a['instructions']:>7d} -> {b['instructions']:<6d} {a['registers']:>4d} -> {b['registers']:<4d} {memory}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"triton": triton.__version__, "target": "sm_90", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
