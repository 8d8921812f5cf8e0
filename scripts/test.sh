#!/usr/bin/env bash
# Install everything if needed (scripts/install.sh, honours VENV), then run the test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k radix -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VENV="${VENV:-$ROOT/.venv}"
"$ROOT/scripts/install.sh"
cd "$ROOT"
start=$(date +%s)
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
echo "[test] pytest exit code $rc after $(( $(date +%s) - start )) s"
exit $rc
