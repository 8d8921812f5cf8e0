#!/usr/bin/env bash
# Install a model --model-path knows by name into the venv and the model cache, e.g.
# `scripts/install_model.sh qwen2.5-coder-0.5b` (see python/sglang_kvcmas/models/install.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec "${VENV:-$ROOT/.venv}/bin/python" -m sglang_kvcmas.models.install "$@"
