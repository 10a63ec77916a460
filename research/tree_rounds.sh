#!/usr/bin/env bash
# The attention benchmark over several trees in alternating rounds, in one GPU call: one process per arm and round,
# the baseline named in IMPLS (say sdpa-cudnn) measured in every process, so that each arm's ratios to it and to the
# other arms come from the same machine state. A tree is a `git archive` of a commit, patched or not
# (research/make_tree.sh), carried to the machine; an arm is NAME=DIR, or NAME=DIR@VAR=VALUE to run that tree with
# one environment variable set.
# Each arm's JSON is OUT/attention-NAME-ROUND.json (written row by row, so a call cut short keeps what it measured);
# research/attention_ab.py reads them in pairs.
#   research/tree_rounds.sh OUT ROUNDS IMPLS MODES SHAPES ARM...
set -u
out=${1:?usage: research/tree_rounds.sh OUT ROUNDS IMPLS MODES SHAPES ARM...}
rounds=${2:?rounds}
impls=${3:?impls}
modes=${4:?modes}
shapes=${5:?shapes}
shift 5
[ $# -gt 0 ] || { echo "tree_rounds.sh: name at least one arm (NAME=DIR[@VAR=VALUE])" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$out/gpu.csv" 2>&1
for round in $(seq 1 "$rounds"); do
  for arm in "$@"; do
    name=${arm%%=*}
    spec=${arm#*=}
    tree=${spec%%@*}
    setting=$([ "$spec" != "$tree" ] && echo "${spec#*@}")
    [ -d "$tree" ] || { echo "tree_rounds.sh: arm $name: no tree at $tree" >&2; exit 2; }
    start=$(date +%s)
    (cd "$tree" && env ${setting:+"$setting"} PYTHONPATH=. python3 benchmarks/attention.py --impls "$impls" \
       --modes "$modes" --shapes "$shapes" --out "$out/attention-$name-$round.json") 2>&1 | grep -v Warning \
       > "$out/attention-$name-$round.log"
    echo "round $round arm $name: $(( $(date +%s) - start )) s" | tee -a "$out/rounds.log"
  done
done
