#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, slow checks included.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` for the quick subset.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh test
export OMP_WAIT_POLICY=passive
exec "$PY" -m pytest -q "$@"
