#!/usr/bin/env bash
# The kernel library before and after a change, in one GPU call: the attention benchmark (cuDNN as the named
# baseline in each process) and the eager host probe, for the tree OLD (an exported earlier commit) and this one,
# in interleaved rounds (with `eager`, the eager probe alone, then its back-to-back profile of each tree). Every
# output lands in OUT.
#   research/before_after.sh OLD OUT [ROUNDS] [eager]
set -u
old=${1:?usage: research/before_after.sh OLD OUT [ROUNDS]}
out=${2:?usage: research/before_after.sh OLD OUT [ROUNDS]}
rounds=${3:-2}
only=${4:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$out/gpu.csv" 2>&1
impls=stableflash,stableflash-sfa,stableflash-sfa-stats,stableflash-paper,sdpa-cudnn
for round in $(seq 1 "$rounds"); do
  for version in before after; do
    tree=$([ "$version" = before ] && echo "$old" || echo .)
    [ "$only" = eager ] || (cd "$tree" && PYTHONPATH=. python3 benchmarks/attention.py --impls $impls --modes fwdbwd,fwd_graph,fwdbwd_graph \
       --out "$out/attention-$version-$round.json") 2>&1 | grep -v Warning > "$out/attention-$version-$round.log"
    PYTHONPATH=$tree python3 research/eager_host.py --rounds 2 --out "$out/eager-$version-$round.json" 2>&1 \
      | grep -v Warning > "$out/eager-$version-$round.log"
  done
done
if [ "$only" = eager ]; then
  for version in before after; do
    tree=$([ "$version" = before ] && echo "$old" || echo .)
    PYTHONPATH=$tree python3 research/eager_host.py --profile 300 --out /dev/null > "$out/profile-$version.txt" 2>&1
  done
fi
tail -n 3 "$out"/eager-*.log
