"""What the shards of flash-attn's test file have covered between them: per test function, the cases in scope and
how many of them passed, failed, errored or were skipped, over every shard run so far, and the worker-seconds they
took (pytest's time per case, summed): where the file's time goes, and how long the shards left would take. Where a
shard wrote `compiles.jsonl` (its cases' Triton compiles), also the seconds spent compiling: what a warm Triton cache
would save, and the worker-seconds of the cases that loaded kernels from that cache without compiling any: under the
compile-once manager, time spent waiting for another worker's compile. Where it lists each compile, also how many
distinct kernels were built (by Triton's cache key) and, per kernel, the runtime arguments whose specialisation
(divisible by 16, equal to 1) differs between its builds: what multiplies the compiles.

Each shard is one `research/flash_attn_tests.sh` output folder (its `cases.json` and `flash-attn-tests.xml`), run
with the same SAMPLE N, the same SHARD_BY and its own SHARD K. A shard's runs add up, in the order given: a resumed
run (RESUME) reports the cases its earlier runs did not pass or skip, and a case reported by several runs counts
once, as the last of them reported it. Shards of another N or another SHARD_BY are refused, since they would
overlap. Failures standing at the end are split by cause: out of device memory, or any other, named.

    python research/flash_attn_ledger.py OUT/shard-0 OUT/shard-1 ... --out results/drop-ins/flash-attn-ledger.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

from flash_attn_shim.shard_reports import out_of_memory, read_shard

OUTCOMES = ("passed", "failed", "error", "skipped")


def _added(earlier: dict, later: dict) -> dict:
    """Two runs of one shard as one: each case as the later run reported it, else as the earlier did."""
    return {**later, **{part: {**earlier[part], **later[part]} for part in ("outcomes", "seconds", "compiles")},
            **{part: {**{case: value for case, value in earlier[part].items() if case not in later["outcomes"]},
                      **later[part]} for part in ("memory_retries", "messages")}}


def ledger(folders: list[Path]) -> dict:
    shards = {}
    for folder in folders:
        shard = read_shard(folder)
        first = next(iter(shards.values()), shard)
        if shard["sample"] != first["sample"]:
            raise ValueError(f"{folder}: shards of one in {shard['sample']} do not partition with the others' "
                             f"one in {first['sample']}")
        if shard["shard_by"] != first["shard_by"]:
            raise ValueError(f"{folder}: shards by {shard['shard_by'] or 'hash'} do not partition with the others' "
                             f"by {first['shard_by'] or 'hash'}")
        if shard["shard"] in shards:
            shard = _added(shards[shard["shard"]], shard)
        shards[shard["shard"]] = shard
    if not shards:
        raise ValueError("folders: expected at least one shard's output folder")
    in_scope = next(iter(shards.values()))["in_scope"]
    per_function, seconds, building = defaultdict(Counter), Counter(), defaultdict(Counter)
    for shard in shards.values():
        for case, outcome in shard["outcomes"].items():
            function = case.split("::")[-1].split("[")[0]
            per_function[function][outcome] += 1
            seconds[function] += shard["seconds"][case]
        for case, record in shard["compiles"].items():
            function = case.split("::")[-1].split("[")[0]
            building[function].update({"compiled": record["compiled"], "loaded": record["loaded"],
                                       "compile_s": record["compile_s"]})
    sample = next(iter(shards.values()))["sample"]
    functions = {name: {"in_scope": n, **{o: per_function[name][o] for o in OUTCOMES},
                        "worker_seconds": round(seconds[name], 3), "compiled": building[name]["compiled"],
                        "loaded": building[name]["loaded"], "compile_seconds": round(building[name]["compile_s"], 3)}
                 for name, n in in_scope.items()}
    done = sum(sum(f[o] for o in OUTCOMES) for f in functions.values())
    left = sum((f["in_scope"] - sum(f[o] for o in OUTCOMES)) * seconds[name] / max(1, sum(f[o] for o in OUTCOMES))
               for name, f in functions.items() if sum(f[o] for o in OUTCOMES))
    kernels = _kernels(record for shard in shards.values() for record in shard["compiles"].values())
    load_only = sum(_load_only_seconds(shard) for shard in shards.values())
    return {"sample_one_in": sample, "shards_run": sorted(shards), "shards_left": sorted(set(range(sample)) - set(shards)),
            "in_scope": sum(in_scope.values()), "reported": done,
            "totals": {o: sum(f[o] for f in functions.values()) for o in OUTCOMES},
            "worker_seconds": round(sum(seconds.values()), 3),
            "compile_seconds": round(sum(f["compile_seconds"] for f in functions.values()), 3),
            "load_only_seconds": round(load_only, 3),
            "worker_seconds_left": round(left, 3),
            "memory_retried": sum(len(shard["memory_retries"]) for shard in shards.values()),
            "failures_by_cause": _failures_by_cause(shards.values()),
            "functions": functions, "kernels": kernels}


def _load_only_seconds(shard) -> float:
    """The seconds of the shard's cases that loaded kernels without compiling any. The junit report names a case
    `classname::name`, the compile listing by node id (`path::name`): one test file, so the name alone joins them."""
    seconds = {case.split("::")[-1]: s for case, s in shard["seconds"].items()}
    return sum(seconds.get(case.split("::")[-1], 0.0) for case, record in shard["compiles"].items()
               if record["compiled"] == 0 and record["loaded"] > 0)


def _failures_by_cause(shards) -> dict:
    """The failed and errored cases as the last run reported them: how many ran out of device memory, and every
    other one (a worker lost, whatever the cause) by name with its message."""
    short, other = 0, {}
    for shard in shards:
        for case, outcome in shard["outcomes"].items():
            if outcome not in ("failed", "error"):
                continue
            message = shard["messages"].get(case, "")
            if out_of_memory(message):
                short += 1
            else:
                other[case] = message[:300]
    return {"out_of_memory": short, "other": len(other), "other_cases": dict(sorted(other.items()))}


def _kernels(records) -> dict:
    """Per kernel name: its compiles, its distinct builds (cache keys: a build compiled by several workers before
    the disk cache held it counts once), and for each specialised argument in how many of the distinct builds it was
    so, listed where that is neither none nor all of them."""
    builds, specialised = Counter(), defaultdict(dict)
    for record in records:
        for kernel in record.get("kernels", ()):
            builds[kernel["kernel"]] += 1
            specialised[kernel["kernel"]][kernel["key"]] = kernel["specialisation"]
    result = {}
    for name, keys in specialised.items():
        counts = Counter(label for labels in keys.values() for label in labels)
        result[name] = {"compiles": builds[name], "distinct": len(keys),
                        "varying": {label: n for label, n in sorted(counts.items()) if n < len(keys)}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="shard output folders")
    parser.add_argument("--out", type=Path, help="write the ledger as JSON here")
    args = parser.parse_args()
    result = ledger(args.folders)
    print(f"{'function':45s} {'in scope':>9s} " + " ".join(f"{o:>8s}" for o in OUTCOMES)
          + f" {'worker s':>9s} {'compiled':>9s} {'compile s':>10s}")
    for name, row in sorted(result["functions"].items()):
        print(f"{name:45s} {row['in_scope']:9d} " + " ".join(f"{row[o]:8d}" for o in OUTCOMES)
              + f" {row['worker_seconds']:9.0f} {row['compiled']:9d} {row['compile_seconds']:10.0f}")
    print(f"shards run {len(result['shards_run'])} of {result['sample_one_in']}; cases reported "
          f"{result['reported']} of {result['in_scope']} in scope; " +
          ", ".join(f"{n} {o}" for o, n in result["totals"].items()))
    print(f"worker-seconds so far {result['worker_seconds']:.0f}; the cases left, at each function's mean so far: "
          f"{result['worker_seconds_left']:.0f} (functions with no case reported yet not counted)")
    print(f"cases run again after running out of device memory: {result['memory_retried']}")
    causes = result["failures_by_cause"]
    print(f"failed or errored as last reported: {causes['out_of_memory']} out of device memory, {causes['other']} "
          "otherwise" + "".join(f"\n  {case}: {message}" for case, message in list(causes["other_cases"].items())[:20]))
    print(f"of the worker-seconds, compiling Triton kernels: {result['compile_seconds']:.0f} (where the shards wrote "
          "compiles.jsonl)")
    print(f"of the worker-seconds, cases that only loaded kernels from the disk cache (waits for other workers' "
          f"compiles among them): {result['load_only_seconds']:.0f}")
    for name, row in sorted(result["kernels"].items()):
        varying = ", ".join(f"{label} in {n}" for label, n in row["varying"].items())
        print(f"{name}: {row['compiles']} compiles, {row['distinct']} distinct; specialised in some: {varying or '-'}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
