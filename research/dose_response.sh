#!/usr/bin/env bash
# The dose-response study (docs/dose-response.md) on one GPU, in calls of at most 10 minutes: each call trains every
# arm and seed at once for BUDGET seconds (default 540), stops them with a checkpoint, and the next call resumes them.
# With FINISH > 0 (the last call) the training stops FINISH seconds early and `finish` spends them on the δ trace of
# every arm and the first diverging run's δ trace and isolation, from its checkpoint before the divergence. Every call
# ends by summarising what has run so far into OUT/arms/*.json, OUT/dose-response.png and OUT/verdict.json.
# The corpus must be in data/debian-docs (`stableflash prepare --dataset debian-docs`, ~80 s; carry it to a GPU
# machine that has no network). Compiled kernels are cached in OUT/cache, so a call on a machine still warm from the
# last one does not compile again.
#   research/dose_response.sh OUT [BUDGET] [FINISH]
set -euo pipefail
out=${1:?usage: research/dose_response.sh OUT [BUDGET] [FINISH]}
budget=${2:-540}
finish=${3:-0}
mkdir -p "$out/cache"
export TORCHINDUCTOR_CACHE_DIR=$out/cache/inductor TRITON_CACHE_DIR=$out/cache/triton
python3 "$(dirname "$0")/dose_response.py" run --out "$out" --budget-s $((budget - finish)) --config study-6l \
  --steps 3000 --set run.keep_interval_checkpoints=true --set data.dataset=debian-docs --set data.data_dir=data --set model.vocab_size=8192
if [ "$finish" -gt 0 ]; then
  python3 "$(dirname "$0")/dose_response.py" finish "$out" --budget-s "$finish"
fi
python3 "$(dirname "$0")/dose_response.py" summarise "$out"
