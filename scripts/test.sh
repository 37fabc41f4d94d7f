#!/usr/bin/env bash
# The test command: every test, on the CPU under the Triton interpreter when there is no GPU
# (on a GPU machine the same tests run on CUDA).  Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$REPO"
# the second -W wins for its message: NumPy 2.3's deprecation that NumPy 2.4 makes an error stays one
# (kernels/_interpreter_compat.py; pyproject's filterwarnings says the same for a bare pytest)
exec "$VENV/bin/pytest" -p no:cacheprovider -q -W ignore::DeprecationWarning \
  -W "error:Conversion of an array with ndim:DeprecationWarning" tests "$@"
