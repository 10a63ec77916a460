#!/usr/bin/env bash
# The eager host path of two versions of the package in one GPU call: benchmarks/host_overhead.py (this checkout's)
# run over interleaved rounds, importing stableflash from OLD_DIR and from this checkout by turns.
#   git archive OLD_REV stableflash | (mkdir -p ab-old && tar -x -C ab-old)     # here, before the call (untracked)
#   scripts/host_ab.sh ab-old OUTDIR [ROUNDS]                                  # on the GPU machine
# OUTDIR gets old-R.json and new-R.json per round and ab.log (each run's table, prefixed by version and round).
set -u
old=${1:?usage: scripts/host_ab.sh OLD_DIR OUTDIR [ROUNDS]}
out=${2:?usage: scripts/host_ab.sh OLD_DIR OUTDIR [ROUNDS]}
rounds=${3:-3}
mkdir -p "$out"
for round in $(seq "$rounds"); do
  for version in old new; do
    path=.; [ "$version" = old ] && path=$old
    # benchmarks/ is sys.path[0], so stableflash comes from PYTHONPATH alone
    PYTHONPATH=$path python3 benchmarks/host_overhead.py --out "$out/$version-$round.json" 2>&1 | grep -v Warning \
      | head -8 | sed "s/^/$version-$round /" >> "$out/ab.log"
  done
done
cat "$out/ab.log"
