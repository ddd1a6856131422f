#!/usr/bin/env bash
# Reruns the adapters' tests on each Keras version given (default: the
# module's TESTED_KERAS_VERSIONS), each installed from PyPI into its own
# directory put first on PYTHONPATH, so the venv's own Keras stays as it is.
# Needs network access, so it is not part of the test suite. Keras 3.12 to
# 3.15 need nothing the venv (which TensorFlow's Keras came with) lacks, so
# each is installed without its dependencies.
#
#   tests/keras_versions.sh [3.X.Y ...]
#
# Prints one line per version (its pytest summary) and exits non-zero if any
# version failed.
set -u -o pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
KERAS_DIRS="${KERAS_DIRS:-${TMPDIR:-/tmp}/tfspmd-keras-versions}"
TESTS=(tests/test_adapters_keras.py tests/test_adapters_tf_data.py
       tests/test_adapters_checkpoint.py tests/test_keras_versions.py)

if [[ $# -gt 0 ]]; then
  versions=("$@")
else
  # One list of versions, in adapters/_keras_internal.py, read without
  # importing TensorFlow.
  read -r -a versions < <("$PYTHON" - "$ROOT/adapters/_keras_internal.py" <<'PY'
import ast
import sys

for node in ast.parse(open(sys.argv[1]).read()).body:
  if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
      and node.targets[0].id == "TESTED_KERAS_VERSIONS"):
    print(*ast.literal_eval(node.value))
PY
)
fi

cd "$ROOT" || exit 1
failed=()
for version in "${versions[@]}"; do
  target="$KERAS_DIRS/keras-$version"
  if [[ ! -d "$target/keras" ]]; then
    "$PYTHON" -m pip install --quiet --no-deps --target "$target" \
        "keras==$version" || { failed+=("$version"); continue; }
  fi
  imported="$(PYTHONPATH="$target" "$PYTHON" -c \
      'import keras; print(keras.__version__)' 2>/dev/null)"
  if [[ "$imported" != "$version" ]]; then
    echo "Keras $version: imported Keras '$imported' instead" >&2
    failed+=("$version")
    continue
  fi
  summary="$(PYTHONPATH="$target" "$PYTHON" -m pytest -q -p no:cacheprovider \
      "${TESTS[@]}" 2>&1 | tail -n 1)" || failed+=("$version")
  echo "Keras $version: $summary"
done

if [[ ${#failed[@]} -gt 0 ]]; then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
