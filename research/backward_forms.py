"""What the backward kernels compile to on sm_90, offline (no GPU needed): registers, spilled bytes, shared memory,
static counts of a few instructions and whether ptxas serialises the wgmmas (`serialised`, its reason kept in the
JSON), at each candidate tile, with TMA and without, D = 64 and 128, causal; with `--atomic-dq` the dK/dV kernel's
form that adds dQ with atomics (`KernelOptions.atomic_dq`).

It compiles the package on the path, so a kernel change is compared by running it in a patched copy of the tree
(`PYTHONPATH=COPY python research/backward_forms.py --out COPY.json`) and in this one, then reading the two tables
side by side: `--compare BEFORE.json AFTER.json` prints each tile's rows together. Static counts are not run time
(a loop's body counts once however often it runs); they show code the compiler duplicated (one copy per loop)
and spills, which the GPU's timings then confirm or not.

    python research/backward_forms.py [--kernels dkdv,dq] [--atomic-dq] --out FILE.json
    python research/backward_forms.py --compare BEFORE.json AFTER.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

PTX_COUNTS = {"wgmma": r"wgmma\.mma_async", "ld_shared": r"ld\.shared", "st_shared": r"st\.shared",
              "tma_loads": r"cp\.async\.bulk\.tensor", "barriers": r"(?:bar|barrier)\.sync\b"}
"""Instructions counted where they start a PTX line (after `offline_compile.INSTRUCTION_START`)."""


def _forms(kernels: list[str], atomic_dq: bool = False) -> list[dict]:
    import torch
    import triton
    from offline_compile import INSTRUCTION_START, compile_kernel, constexprs, resource_usage, wgmma_serialization

    from stableflash.attention.precision import resolve
    from stableflash.attention.triton import tuning
    from stableflash.attention.triton.spec import spec_name

    tiles = {"dkdv": tuning.DKDV_CONFIGS, "dq": tuning.DQ_CONFIGS}
    rows = []
    for kernel in kernels:
        for head_dim in (64, 128):
            name = spec_name(resolve("fa2"), None, torch.bfloat16, head_dim, 4096)
            for tile in tiles[kernel]:
                for tma in (True, False):
                    config = triton.Config({**tile.kwargs, "TMA": tma}, num_warps=tile.num_warps,
                                           num_stages=tile.num_stages)
                    atomic = {"ATOMIC_DQ": True} if atomic_dq and kernel == "dkdv" else {}
                    consts = {**constexprs(name, kernel, head_dim, config), **atomic}
                    compiled = compile_kernel(name, kernel, consts, config)
                    ptx = compiled.asm["ptx"]
                    reason = wgmma_serialization(compiled)
                    rows.append({"kernel": kernel + ("-atomic-dq" if atomic else ""), "head_dim": head_dim,
                                 **tile.kwargs, "num_warps": tile.num_warps, "num_stages": tile.num_stages, "TMA": tma,
                                 **resource_usage(compiled),
                                 **{key: len(re.findall(INSTRUCTION_START + pattern, ptx, re.MULTILINE))
                                    for key, pattern in PTX_COUNTS.items()},
                                 "serialised": "yes" if reason else "no", "serialised_because": reason})
    return rows


def _label(row: dict) -> str:
    return (f"{row['kernel']} D={row['head_dim']} {row['BLOCK_M']}x{row['BLOCK_N']} {row['num_warps']}w "
            f"{row['num_stages']}s {'TMA' if row['TMA'] else 'ptr'}")


COLUMNS = ("registers", "spill_stack_bytes", "shared_bytes", *PTX_COUNTS, "serialised")


def compare(before: list[dict], after: list[dict]) -> list[dict]:
    """Rows of both tables with the same label, each column as [before, after] ("?" where a table predates it)."""
    old = {_label(row): row for row in before}
    return [{"form": _label(row), **{c: [old[_label(row)].get(c, "?"), row.get(c, "?")] for c in COLUMNS}}
            for row in after if _label(row) in old]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="dkdv,dq", help="comma-separated: dkdv, dq")
    parser.add_argument("--atomic-dq", action="store_true", help="the dK/dV kernel's form that adds dQ with atomics")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        tables = [json.loads(path.read_text())["rows"] for path in args.compare]
        print(f"{'form':34s}" + "".join(f"{c:>20s}" for c in COLUMNS))
        for row in compare(*tables):
            print(f"{row['form']:34s}" + "".join(f"{f'{row[c][0]} -> {row[c][1]}':>20s}" for c in COLUMNS))
        return
    if args.out is None:
        parser.error("--out is required (or --compare)")
    kernels = args.kernels.split(",")
    unknown = [k for k in kernels if k not in ("dkdv", "dq")]
    if unknown:
        parser.error(f"--kernels: unknown {unknown}; expected dkdv, dq")
    sys.path.insert(0, str(Path(__file__).parent))
    import triton

    rows = _forms(kernels, args.atomic_dq)
    for row in rows:
        print(f"{_label(row):34s}" + " ".join(f"{c}={row[c]}" for c in COLUMNS))
    args.out.write_text(json.dumps({"triton": triton.__version__, "target": "sm_90", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
