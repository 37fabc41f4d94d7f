#!/usr/bin/env bash
# Make (or reuse) the project's Python environment and install this checkout into it.
# Sourced by scripts/demo.sh, scripts/test.sh and .ci/run; prints nothing but progress.
# The environment lives outside the clone (default ~/.cache/sglang-ddtree/venv-sgl0516) so a
# CI run on the same machine reuses it; a fresh machine builds it from PyPI (SGLang 0.5.16 and
# its pinned torch 2.11 / triton 3.6: several GB, a few minutes).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
VENV=${SGLANG_DDTREE_VENV:-$HOME/.cache/sglang-ddtree/venv-sgl0516}
SPEC="sglang==0.5.16 pytest safetensors"
STAMP="$VENV/.sglang-ddtree-spec"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$SPEC" ]; then
  echo "== building $VENV ($SPEC)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q $SPEC
  echo "$SPEC" > "$STAMP"
fi
# setuptools >= 70.1 builds wheels without the separate `wheel` package (tests/test_wheel.py builds
# one with --no-build-isolation); a no-op when already satisfied
"$VENV/bin/python" -m pip install -q "setuptools>=70.1"
# editable install of this checkout: maps kernels/ -> sglang_ddtree.kernels (never a top-level
# `kernels`, which is Hugging Face's package that SGLang imports)
"$VENV/bin/python" -m pip install -q --no-deps -e "$REPO" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import sglang_ddtree.kernels, sys; assert sglang_ddtree.kernels.__file__.startswith('$REPO'), sglang_ddtree.kernels.__file__" 
export VENV REPO
