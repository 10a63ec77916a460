#!/usr/bin/env bash
# One GPU call for the kernels' launch path: the packed (varlen) tests with blocking launches first (a bad access
# names its kernel), then the kernel tests but the emulation sweeps (16 workers), then the attention benchmark on
# the tree BEFORE (an exported earlier commit) and on this one, cuDNN the named baseline in each. Every output lands
# in OUT (logs archived: the device returns at most 8 files).
#   research/launch_check.sh OUT BEFORE
set -u
out=${1:?usage: research/launch_check.sh OUT BEFORE}
before=${2:?usage: research/launch_check.sh OUT BEFORE}
mkdir -p "$out/logs"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$out/logs/gpu.csv" 2>&1
CUDA_LAUNCH_BLOCKING=1 timeout 150 python3 -m pytest -n 8 -q -rfE -p no:cacheprovider tests/attention/test_triton.py \
  -k packed_sequences > "$out/logs/varlen.log" 2>&1
tail -3 "$out/logs/varlen.log"
sweeps="emulation_agrees or narrow_formats or toward_zero or o_in_a_narrow or stochastic_rounding or round_as"
timeout 270 python3 -m pytest -n 16 -q -rfE -p no:cacheprovider --timeout 240 tests/attention/test_triton.py \
  tests/attention/test_launch.py tests/attention/test_tile_picks.py -k "not ($sweeps) and not packed_sequences" \
  --junitxml "$out/tests.xml" > "$out/logs/tests.log" 2>&1
tail -12 "$out/logs/tests.log"
impls=stableflash,stableflash-sfa,stableflash-sfa-stats,stableflash-paper,sdpa-cudnn
for version in before after; do
  tree=$([ "$version" = before ] && echo "$before" || echo .)
  (cd "$tree" && PYTHONPATH=. timeout 110 python3 benchmarks/attention.py --impls $impls --modes fwdbwd,fwdbwd_graph \
     --shapes "16,12,1024,64;4,16,4096,128" --out "$out/attention-$version.json") > "$out/logs/attention-$version.log" 2>&1
  grep -v Warning "$out/logs/attention-$version.log" | tail -14
done
tar -czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
