#!/usr/bin/env bash
# The main job on its built-in default: captured drafter top-k and the tiny model pair through
# the real DDTree kernels, checked against the exact CPU reference and the target's greedy output.
# Extra arguments go to `python -m sglang_ddtree.demo` (--budget, --new-tokens, --json ...).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$REPO"
exec "$VENV/bin/python" -m sglang_ddtree.demo "$@"
