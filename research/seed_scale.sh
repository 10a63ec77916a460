#!/usr/bin/env bash
# The seed's run at its own scale (docs/seed-scale.md) on every GPU of the host, one call of at most 10 minutes: the
# corpus unpacked from .carry/debian-docs where data/ lacks it (carry .carry), then `seed_scale.py run` resumes the run
# in OUT (keep OUT on the machine's disk between back-to-back calls), then the compact summary in SUMMARY.
#   research/seed_scale.sh OUT SUMMARY [ARM] [BUDGET]
set -euo pipefail
out=${1:?usage: research/seed_scale.sh OUT SUMMARY [ARM] [BUDGET]}
summary=${2:?usage: research/seed_scale.sh OUT SUMMARY [ARM] [BUDGET]}
arm=${3:-paper}
budget=${4:-540}
here=$(dirname "$0")
if [ ! -f data/debian-docs/train.bin ] && [ -f .carry/debian-docs/train.bin.gz ]; then
  mkdir -p data/debian-docs
  cp .carry/debian-docs/val.bin .carry/debian-docs/meta.json .carry/debian-docs/tokenizer.json data/debian-docs/
  gunzip -c .carry/debian-docs/train.bin.gz > data/debian-docs/train.bin
fi
mkdir -p "$out/cache"
export TORCHINDUCTOR_CACHE_DIR=$out/cache/inductor TRITON_CACHE_DIR=$out/cache/triton PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
python3 "$here/seed_scale.py" run "$out" --arm "$arm" --budget-s "$budget"
python3 "$here/seed_scale.py" summary "$out" "$summary" --arm "$arm"
