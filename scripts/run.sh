#!/usr/bin/env bash
# Install if needed, then run one multi-agent workflow (a 16-agent review panel over one
# document, an SGLang frontend program) on SGLang's radix cache and on sglang-kvcmas with sharing
# on, one server at a time (same binary, embedded model), and print a side-by-side table per turn
# with a summary.
#
#   scripts/run.sh                                   # the panel, 64-token answers
#   scripts/run.sh --workflow debate                 # args go to sglang_kvcmas_examples.side_by_side
#   scripts/run.sh --server-args "--model-path /path/to/hf-folder"
#
# Environment: VENV (default .venv, see scripts/install.sh), SKIP_INSTALL=1 (do not run
# scripts/install.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VENV="${VENV:-$ROOT/.venv}"
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then "$ROOT/scripts/install.sh"; fi
start=$(date +%s)
"$VENV/bin/python" -m sglang_kvcmas_examples.side_by_side "$@"
echo "[run] done in $(( $(date +%s) - start )) s" >&2
