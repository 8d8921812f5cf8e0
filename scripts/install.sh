#!/usr/bin/env bash
# Install sglang-kvcmas and its pinned runtime (torch, SGLang 0.5.23 and exactly the packages SGLang
# needs on CPU) into the virtual environment named by VENV (default: .venv in the checkout).
#
# Idempotent: a stamp in the venv records a hash of everything that decides what is installed; a
# second run with the same inputs installs nothing and takes about a second.
#
# On a CUDA machine the same script works (torch 2.14.1 from PyPI is a CUDA build); add the GPU
# extras with KVCMAS_GPU=1 (sglang-kernel and flashinfer-python, see scripts/requirements-gpu.txt).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
log() { printf '[install] %s\n' "$*" >&2; }

inputs=("$ROOT/pyproject.toml" "$ROOT/scripts/install.sh" "$ROOT/scripts/requirements-cpu.txt"
        "$ROOT/scripts/requirements-dev.txt")
[[ "${KVCMAS_GPU:-0}" == 1 ]] && inputs+=("$ROOT/scripts/requirements-gpu.txt")
stamp_want="$(cat "${inputs[@]}" | sha256sum | cut -d' ' -f1)-gpu${KVCMAS_GPU:-0}"
stamp_file="$VENV/.kvcmas-install-stamp"

if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp_want" && -x "$VENV/bin/python" ]]; then
  log "up to date: $VENV"
  exit 0
fi

start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
# pip's exit status is kept; only the noise about this machine's local package index is dropped.
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2); }
pip install --upgrade pip setuptools wheel

# torch first, with its own dependencies: SGLang 0.5.23 pins torch 2.14.1 (torchvision 0.29.1).
log "torch 2.14.1 + torchvision 0.29.1"
pip install torch==2.14.1 torchvision==0.29.1
# Everything else without dependency resolution: `sglang` declares a CUDA stack we must not pull.
log "SGLang 0.5.23, the packages it needs on CPU, its gateway SMG (--no-deps, pinned)"
pip install --no-deps -r "$ROOT/scripts/requirements-cpu.txt"
log "test and lab tools (--no-deps, pinned)"
pip install --no-deps -r "$ROOT/scripts/requirements-dev.txt"
if [[ "${KVCMAS_GPU:-0}" == 1 ]]; then
  log "GPU extras: sglang-kernel, flashinfer"
  pip install --no-deps -r "$ROOT/scripts/requirements-gpu.txt"
fi
log "sglang-kvcmas (editable, registers the sglang.srt.plugins entry point)"
pip install --no-deps --no-build-isolation -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, sglang, smg.launch_router, transformers
assert sglang.__version__ == "0.5.23", sglang.__version__
assert md.version("smg") == "1.13.0", md.version("smg")
eps = [e.value for e in md.entry_points(group="sglang.srt.plugins")]
assert "sglang_kvcmas.plugin:register" in eps, eps
print(f"[install] ok: torch {torch.__version__}, sglang {sglang.__version__}, "
      f"smg {md.version('smg')}, transformers {transformers.__version__}")
PY
echo "$stamp_want" > "$stamp_file"
log "done in $(( $(date +%s) - start )) s"
