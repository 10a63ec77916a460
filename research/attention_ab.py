"""Before/after ratios of `benchmarks/attention.py` runs of two trees, from their JSON files.

For each (shape, implementation) and each timing column present in both sets, the time after over the time before
(TFLOP/s before over after): the ratio of the rounds' mean TFLOP/s, and each round's own ratio (round i of the
before files against round i of the after files, in the order given), so the spread between rounds shows beside
the mean. A named baseline measured in the same processes (say `sdpa-cudnn`) reads near 1.00 when the machine held
still between the trees.

    python research/attention_ab.py --before B1.json B2.json --after A1.json A2.json [--column fwdbwd_tflops_cudagraph]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = ("fwd_tflops", "fwdbwd_tflops", "fwd_tflops_cudagraph", "fwdbwd_tflops_cudagraph")


def _rounds(paths: list[Path]) -> list[dict]:
    return [{(tuple(row["shape"]), row["impl"]): row for row in json.loads(Path(p).read_text())["rows"]}
            for p in paths]


def ratios(before: list[Path], after: list[Path], columns=COLUMNS) -> list[dict]:
    """One row per (shape, implementation, column) measured in every round of both sets: `time_ratio` (after /
    before, from the rounds' mean TFLOP/s) and `round_ratios`."""
    if len(before) != len(after):
        raise ValueError(f"before, after: need as many rounds of each, got {len(before)} and {len(after)}")
    old, new = _rounds(before), _rounds(after)
    rows = []
    for key in old[0]:
        for column in columns:
            tb = [r.get(key, {}).get(column) for r in old]
            ta = [r.get(key, {}).get(column) for r in new]
            if any(t is None for t in tb + ta):
                continue
            rows.append({"shape": list(key[0]), "impl": key[1], "column": column,
                         "before_tflops": tb, "after_tflops": ta,
                         "time_ratio": (sum(tb) / len(tb)) / (sum(ta) / len(ta)),
                         "round_ratios": [b / a for b, a in zip(tb, ta)]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", nargs="+", type=Path, required=True)
    parser.add_argument("--after", nargs="+", type=Path, required=True)
    parser.add_argument("--column", action="append", choices=COLUMNS, help="default: every column present")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = ratios(args.before, args.after, tuple(args.column or COLUMNS))
    print(f"{'shape':22s}{'impl':20s}{'column':26s}{'after / before (time)':>22s}  rounds")
    for row in rows:
        spread = ", ".join(f"{r:.3f}" for r in row["round_ratios"])
        print(f"{str(tuple(row['shape'])):22s}{row['impl']:20s}{row['column']:26s}{row['time_ratio']:22.3f}  {spread}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
