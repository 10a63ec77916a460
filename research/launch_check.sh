#!/usr/bin/env bash
# The kernels' launch path, before and after: the attention benchmark on the tree BEFORE (an exported earlier commit,
# `git archive REV stableflash benchmarks | tar -x -C BEFORE`) and on this one, in one call, cuDNN the named
# baseline in each process. Every output lands in OUT. The GPU suite (`research/gpu_suite.sh OUT tests-rest`) is the
# tests' run: both do not fit one 10-minute call.
#   research/launch_check.sh OUT BEFORE
set -u
out=${1:?usage: research/launch_check.sh OUT BEFORE}
before=${2:?usage: research/launch_check.sh OUT BEFORE}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$out/gpu.csv" 2>&1
impls=stableflash,stableflash-sfa,stableflash-sfa-stats,stableflash-paper,sdpa-cudnn
for version in before after; do
  tree=$([ "$version" = before ] && echo "$before" || echo .)
  (cd "$tree" && PYTHONPATH=. timeout 150 python3 benchmarks/attention.py --impls $impls --modes fwdbwd,fwdbwd_graph \
     --shapes "16,12,1024,64;4,16,4096,128" --out "$out/attention-$version.json") > "$out/attention-$version.log" 2>&1
  grep -v Warning "$out/attention-$version.log" | tail -14
done
