#!/usr/bin/env bash
# The test command: every test, on the CPU under the Triton interpreter when there is no GPU
# (on a GPU machine the same tests run on CUDA).  Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$REPO"
exec "$VENV/bin/pytest" -p no:cacheprovider -q -W ignore::DeprecationWarning tests "$@"
