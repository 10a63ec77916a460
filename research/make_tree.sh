#!/usr/bin/env bash
# A tree for research/tree_rounds.sh: the files a GPU run needs from COMMIT (default HEAD), exported into DIR (made
# afresh; keep it under the git-ignored oracle/ and name it in the run's `carry`), with each PATCH applied in order.
#   research/make_tree.sh DIR [COMMIT] [PATCH...]
set -euo pipefail
dir=${1:?usage: research/make_tree.sh DIR [COMMIT] [PATCH...]}
commit=${2:-HEAD}
shift $(( $# >= 2 ? 2 : 1 ))
root=$(git rev-parse --show-toplevel)
patches=()
for patch in "$@"; do patches+=("$(cd "$(dirname "$patch")" && pwd)/$(basename "$patch")"); done
rm -rf "$dir"
mkdir -p "$dir"
git -C "$root" archive "$commit" stableflash benchmarks research tests pyproject.toml | tar -x -C "$dir"
for patch in "${patches[@]}"; do
  (cd "$dir" && git apply "$patch")
done
echo "$dir: $(git -C "$root" rev-parse --short "$commit")${patches:+ with ${#patches[@]} patch(es)}"
