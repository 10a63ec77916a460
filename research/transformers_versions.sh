#!/usr/bin/env bash
# The transformers seam (`stableflash/integrations/transformers.py`) against the lowest supported transformers: the
# version's wheel and the dependency ranges it pins (huggingface_hub, tokenizers, kernels) installed into TARGET,
# put first on the path, then the integration tests. The highest supported version is whatever the dev install has;
# run the same tests without TARGET for it.
#   research/transformers_versions.sh TARGET [VERSION]    (default 5.0.0, pyproject's lower bound)
set -euo pipefail
target=${1:?usage: research/transformers_versions.sh TARGET [VERSION]}
version=${2:-5.0.0}
python3 -m pip install -q --no-deps --target "$target" "transformers==$version"
pins=$(python3 - "$target" <<'PY'
import runpy, sys
deps = runpy.run_path(f"{sys.argv[1]}/transformers/dependency_versions_table.py")["deps"]
print(" ".join(deps[name] for name in ("huggingface-hub", "tokenizers", "kernels") if name in deps))
PY
)
# shellcheck disable=SC2086  # the pins are separate requirements
python3 -m pip install -q --target "$target" $pins
PYTHONPATH="$target:${PYTHONPATH:+$PYTHONPATH:}." python3 -c "import transformers; print('transformers', transformers.__version__)"
PYTHONPATH="$target:${PYTHONPATH:+$PYTHONPATH:}." python3 -m pytest -q -p no:cacheprovider tests/integrations
