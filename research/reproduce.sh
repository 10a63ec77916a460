#!/usr/bin/env bash
# The closest regime to the seed's failure found so far (configs/repro-bf16-4l.toml), on one GPU in about
# five minutes: the all-bf16 attention against fp32 attention and against bf16 with its forward in FA2
# numerics, 3 seeds each, 9 runs at once. Needs CUDA (the bf16 runs use the fused kernels).
#
#   research/reproduce.sh OUT [SEEDS]
#
# Expected (an H200; results/repro-bf16-4l/README.md): fp32 ends
# at 2.59-2.62 in every seed with no step of gradient norm above 100; bf16 at 2.9-4.0 (mean about 3.3) with
# 99-311 such steps per seed, failing by the issue's loss rule (final >= best + 1) in 0-2 of 3 seeds, so the
# last line usually reads "not met"; bf16 with the forward in FA2 numerics at 2.66-2.74 with 0-1 such steps.
# Runs are not bit-reproducible on the GPU (atomics in the backward), and this regime is chaotic:
# expect the bf16 numbers to move by a few tenths between calls, fp32 by about 0.01.
set -euo pipefail
OUT=${1:?usage: research/reproduce.sh OUT [SEEDS]}
SEEDS=${2:-0,1,2}
cd "$(dirname "$0")/.."
python3 research/sweep.py --out "$OUT" --config repro-bf16-4l --settings bf16,fp32,bf16-fwd-fa2 --seeds "$SEEDS" \
    --jobs 9 --budget-s 120 --keep-runs --verdict bf16:fp32
