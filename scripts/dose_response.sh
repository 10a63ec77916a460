#!/usr/bin/env bash
# The dose-response study (docs/dose-response.md) on one GPU, in calls of at most 10 minutes: each call trains every
# arm and seed at once for BUDGET seconds (default 540), stops them with a checkpoint, and the next call resumes them;
# then it summarises what has run so far into OUT/arms/*.json, OUT/dose-response.png and OUT/verdict.json, whose
# `diagnosis` lists the δ diagnosis and the isolation of the first diverging run, from its checkpoint before it.
# The corpus must be in data/debian-docs (`stableflash prepare --dataset debian-docs`, ~80 s; carry it to a GPU
# machine that has no network).
#   scripts/dose_response.sh OUT [BUDGET]
set -euo pipefail
out=${1:?usage: scripts/dose_response.sh OUT [BUDGET]}
budget=${2:-540}
python3 scripts/dose_response.py run --out "$out" --budget-s "$budget" --config study-6l \
  --steps 3000 --set run.keep_previous_checkpoint=true --set data.dataset=debian-docs --set data.data_dir=data --set model.vocab_size=8192
python3 scripts/dose_response.py summarise "$out"
