#!/usr/bin/env bash
# flash-attn's own tests/test_flash_attn.py run against stableflash's drop-ins on a GPU, as an outside oracle: the
# stand-in package research/flash_attn_shim/flash_attn comes first on the path, its other modules (bert_padding,
# rotary) from the flash-attn checkout REPO (git-ignored, never copied in). Dropout, ALiBi and the extension's
# private entry points are deselected (research/flash_attn_shim/upstream_cases.py); SAMPLE N runs one case in N
# of each large test function (default 1: all). Writes OUT/flash-attn-tests.{log,xml}, OUT/cases.json and
# OUT/failures.jsonl (each failure's error, as it happens) and OUT/compiles.jsonl (each case's Triton compiles). Arguments after SAMPLE go to pytest (say, -k to pick cases).
# SHARD=K (0 <= K < SAMPLE) runs the K-th of SAMPLE disjoint shards instead of the first: shards 0..SAMPLE-1 cover
# every case in scope between them, so calls that each fit a time limit can run the whole file
# (research/flash_attn_ledger.py adds up what the shards run so far have covered). SHARD_BY=d,dtype deals whole groups
# of cases sharing those parameters to the shards instead, so that each shard compiles its own kernels only.
# The kernels launch at fixed tiles, untuned (TILES=tuned: autotune each shape, as a user's first call does).
# RESUME="DIR..." (earlier runs' output folders of the same shard) leaves out the cases they reported passed or skipped,
# so that a shard cut short by its call's limit goes on where it stopped and its failures run again
# (research/flash_attn_ledger.py adds a shard's runs up, the last report of a case counting).
# The workers share Triton's cache through research/flash_attn_shim/compile_once.py, under which one worker compiles a
# kernel that several miss at once and the others wait and load it (COMPILE_ONCE=0: Triton's own manager).
# MEMORY_RETRIES=N (default 8): each case frees its cached device memory when it ends, and a case that runs out of
# device memory, which 16 workers on one GPU can, runs again after a pause, up to N times (0: neither).
# The rootdir is fixed at the current folder: shards by hash hash the cases' node ids, which pytest writes relative to
# it, and pytest would otherwise move it to hold every existing path among the arguments (a RESUME folder's, say).
# LIMIT_S=S interrupts pytest after S seconds as Ctrl-C would, so that a run cut short still writes its junit XML (each
# case's outcome and time, what research/flash_attn_ledger.py reads): set it below the call's own limit.
#   research/flash_attn_tests.sh REPO OUT [SAMPLE [PYTEST_ARGS...]]   (WORKERS: pytest-xdist workers, default 16;
#                                                     EXTRA_PYTHONPATH: where einops is, if not installed)
set -u
repo=${1:?usage: research/flash_attn_tests.sh REPO OUT [SAMPLE [PYTEST_ARGS...]]}
out=${2:?usage: research/flash_attn_tests.sh REPO OUT [SAMPLE]}
sample=${3:-1}
shift $(($# < 3 ? $# : 3))
mkdir -p "$out"
export FLASH_ATTN_REPO=$(cd "$repo" && pwd)
resume=()
for folder in ${RESUME:-}; do resume+=(--upstream-resume "$(cd "$folder" && pwd)"); done
export PYTHONPATH=$PWD:$PWD/research/flash_attn_shim${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}
[ "${COMPILE_ONCE:-1}" = 0 ] || export TRITON_CACHE_MANAGER=compile_once:CompileOnceCacheManager
${LIMIT_S:+timeout -s INT -k 60 $LIMIT_S} python3 -m pytest "$FLASH_ATTN_REPO/tests/test_flash_attn.py" -o addopts= -p upstream_cases -p no:cacheprovider \
  --rootdir "$PWD" \
  -n "${WORKERS:-16}" --max-worker-restart 256 -v -rf --tb=line --timeout 300 --durations 40 \
  --upstream-sample "$sample" \
  --upstream-shard "${SHARD:-0}" ${SHARD_BY:+--upstream-shard-by "$SHARD_BY"} ${resume[@]+"${resume[@]}"} \
  --upstream-counts "$out/cases.json" --upstream-failures "$out/failures.jsonl" \
  --upstream-compiles "$out/compiles.jsonl" --upstream-memory-retries "${MEMORY_RETRIES:-8}" \
  --junitxml "$out/flash-attn-tests.xml" $([ "${TILES:-fixed}" = fixed ] && echo --upstream-fixed-tiles) "$@" > "$out/flash-attn-tests.log" 2>&1
status=$?
grep -oE "(PASSED|FAILED|SKIPPED|ERROR) [^ ]+::[a-z_]+" "$out/flash-attn-tests.log" | sort | uniq -c
tail -1 "$out/flash-attn-tests.log"
exit $status
