#!/usr/bin/env bash
# One-shot GPU check for the delta-attention kernels. On a machine with a CUDA GPU:
#   1. installs the GPU extras if missing (KVCMAS_GPU=1 scripts/install.sh),
#   2. runs every kernel test on CUDA (test/lab/kernels: Triton kernels vs. the torch reference in fp32
#      and bf16, the extended grid, the FlashInfer variant, which JIT-compiles on first use),
#   3. runs the GPU micro-benchmark (delta attention vs. plain FlashInfer over base KV vs.
#      materializing per-agent KV first),
# and writes everything as JSONL (+ logs, a PNG) into the folder given as $1, else $OUT, else
# results/gpu_check. Each step has its own time limit so a hang loses only that step.
#
#   scripts/gpu_check.sh [OUT_DIR]          # about 6-8 minutes on an H200 with a warm pip cache
#
# Env: VENV (default .venv), KVCMAS_GPU_CHECK_QUICK=0 for the full benchmark grid,
# FLASHINFER_CUDA_ARCH_LIST (default: this GPU's), MAX_JOBS (default: nproc) for FlashInfer's JIT.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$(mkdir -p "${1:-${OUT:-$ROOT/results/gpu_check}}" && cd "${1:-${OUT:-$ROOT/results/gpu_check}}" && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
SUMMARY="$OUT_DIR/gpu_check_summary.jsonl"
: > "$SUMMARY"
cd "$ROOT"
log() { printf '[gpu_check] %s\n' "$*" | tee -a "$OUT_DIR/gpu_check.log" >&2; }

# step NAME LIMIT_S CMD...: run, log to OUT_DIR/NAME.log, append {"step", "rc", "seconds"}.
step() {
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS rc
  log "$name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  printf '{"step": "%s", "rc": %d, "seconds": %d}\n' "$name" "$rc" "$((SECONDS - t0))" >> "$SUMMARY"
  log "$name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 5 "$OUT_DIR/$name.log" >&2
  return $rc
}

# No GPU, no install: never touch the venv on a CPU machine.
if ! nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1; then
  log "nvidia-smi failed: no GPU here"; exit 2
fi
if ! "$PY" -c "import torch, flashinfer, triton; assert torch.cuda.is_available()" 2>/dev/null; then
  step install 900 env KVCMAS_GPU=1 VENV="$VENV" bash scripts/install.sh || exit 1
fi
if ! "$PY" -c "import torch; assert torch.cuda.is_available()"; then
  log "no CUDA device visible to torch"; exit 1
fi

export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-${TMPDIR:-/tmp}/kvcmas-flashinfer}"
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-$("$PY" -c \
  'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}.{b}" + ("a" if a >= 9 else ""))')}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export KVCMAS_KERNEL_TESTS_FULL=1
log "GPU: $("$PY" -c 'import torch; print(torch.cuda.get_device_name())'), arch $FLASHINFER_CUDA_ARCH_LIST"

# Kernel tests on CUDA (no interpreter: conftest only sets TRITON_INTERPRET without a GPU).
step kernel_tests 420 "$PY" -m pytest test/lab/kernels -q -rA -p no:cacheprovider \
  --junitxml="$OUT_DIR/kernel_tests.xml"
"$PY" - "$OUT_DIR/kernel_tests.xml" "$OUT_DIR/kernel_tests.jsonl" <<'PY' || log "no junit xml"
import json, sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
with open(sys.argv[2], "w") as f:
    for c in cases:
        outcome = next((t.tag for t in c if t.tag in ("failure", "error", "skipped")), "passed")
        detail = next((t.get("message", "")[:300] for t in c
                       if t.tag in ("failure", "error", "skipped")), "")
        f.write(json.dumps({"test": f"{c.get('classname')}::{c.get('name')}", "outcome": outcome,
                            "seconds": float(c.get("time", 0)), "detail": detail}) + "\n")
PY

quick=(); [[ "${KVCMAS_GPU_CHECK_QUICK:-1}" == 1 ]] && quick=(--quick)
step benchmark 420 "$PY" benchmark/kernels/delta_attention_gpu_bench.py --out "$OUT_DIR" \
  --with-variant "${quick[@]}"

log "results in $OUT_DIR:"; ls -la "$OUT_DIR" >&2
! grep -q '"rc": [1-9]' "$SUMMARY"
