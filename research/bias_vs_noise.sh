#!/usr/bin/env bash
# The bias-against-noise study (docs/bias-vs-noise.md) on one GPU, in calls of at most 10 minutes: each call trains
# every run at once for BUDGET seconds (default 540) towards the step target, stops them with a checkpoint, and the
# next call resumes them. With FINISH > 0 (the last call) training stops FINISH seconds early and `finish` spends them
# on the failing B run's condition check and errors (and C's errors), from its checkpoint. Every call ends by
# summarising what has run so far into OUT/arms/*.json, OUT/bias-vs-noise.png and OUT/verdict.json.
# The corpus must be in data/debian-docs (`stableflash prepare --dataset debian-docs`; carry it to a GPU machine that
# has no network). Compiled kernels are cached in OUT/cache, so a call on a machine still warm does not compile again.
#   research/bias_vs_noise.sh OUT [BUDGET] [FINISH]
set -euo pipefail
out=${1:?usage: research/bias_vs_noise.sh OUT [BUDGET] [FINISH]}
budget=${2:-540}
finish=${3:-0}
here=$(dirname "$0")
mkdir -p "$out/cache"
export TORCHINDUCTOR_CACHE_DIR=$out/cache/inductor TRITON_CACHE_DIR=$out/cache/triton
python3 "$here/bias_vs_noise.py" run --out "$out" --budget-s $((budget - finish)) --set run.keep_interval_checkpoints=true \
  --set data.dataset=debian-docs --set data.data_dir=data --set model.vocab_size=8192
if [ "$finish" -gt 0 ]; then
  python3 "$here/bias_vs_noise.py" finish "$out" --budget-s "$finish"
fi
python3 "$here/bias_vs_noise.py" summarise "$out"
