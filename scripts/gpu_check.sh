#!/usr/bin/env bash
# One-shot GPU check of the delta read path. On a machine with a CUDA GPU:
#   1. runs every kernel test on CUDA (test/lab/kernels: Triton kernels vs. the torch reference in
#      fp32 and bf16, the extended grid, the FlashInfer variant where FlashInfer is installed; the
#      served kernel paths, test/attention/test_kernel_reads.py; the head-mass kernel,
#      test/attention/test_triton_head_mass.py and test_probe_reads.py) and
#      the sharing dispatch tests (SGLang's Triton backend as dispatcher, where SGLang is installed),
#   2. runs the GPU micro-benchmark (delta attention vs. plain attention vs. materializing, over
#      context 1k-32k, ranks 0/4/8/16, one span or 16 runs of alternating shifts, head_dim
#      64/128, GQA 4:1 and 1:1),
# and writes one JSON summary, gpu_check_summary.json (steps, kernel tests by name, delta / plain
# attention time ratios by context and rank: sglang_kvcmas_bench/gpu_summary.py), with the logs,
# the benchmark's JSONL and a PNG, into the folder given, else $OUT, else results/gpu_check. Each
# step has its own time limit, together under 6 minutes; a step cut off at its limit loses only
# what it had left (pytest is interrupted, so its report of the tests run so far is kept).
#
#   scripts/gpu_check.sh --prepare            # on a machine with PyPI: pytest's wheels into
#                                             # .gpu_wheels, to carry to a lent GPU machine
#   scripts/gpu_check.sh [OUT_DIR]            # the kernel check (under 6 minutes)
#   scripts/gpu_check.sh --dry-run [OUT_DIR]  # print the steps, their limits, what travels with
#                                             # the tree and the summary's fields (any machine)
#   scripts/gpu_check.sh --server [OUT_DIR]   # a user's CUDA machine with network: install the
#                                             # GPU extras, then the quick head-to-heads on GPU
#                                             # (prompt agents, LoRA agents, LoRA agents over a
#                                             # task context: --shots 4)
#
# Python: $VENV (default .venv) when its torch sees CUDA, else the python3 on PATH (a machine with
# PyTorch and Triton preinstalled and no network: nothing is installed; the packages are read from
# python/ via PYTHONPATH; pytest from $KVCMAS_WHEELS if it is missing). Never installs on a CPU
# machine. Env: KVCMAS_GPU_CHECK_QUICK=0 for the full benchmark grid, FLASHINFER_CUDA_ARCH_LIST
# (default: this GPU's), MAX_JOBS (default: nproc) for FlashInfer's JIT.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE=check
case "${1:-}" in
  --dry-run) MODE=dry; shift ;;
  --prepare) MODE=prepare; shift ;;
  --server) MODE=server; shift ;;
  -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
esac
OUT_DIR="$(mkdir -p "${1:-${OUT:-$ROOT/results/gpu_check}}" && cd "${1:-${OUT:-$ROOT/results/gpu_check}}" && pwd)"
VENV="${VENV:-$ROOT/.venv}"
WHEELS="${KVCMAS_WHEELS:-$ROOT/.gpu_wheels}"
STEPS="$OUT_DIR/gpu_check_steps.jsonl"
[[ $MODE == dry || $MODE == prepare ]] || : > "$STEPS"
cd "$ROOT"

if [[ $MODE == prepare ]]; then
  # Pure-Python wheels (any CPython 3): pytest and what it needs, on 3.10 too.
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  python3 -m pip download -q --only-binary=:all: --implementation py --abi none --platform any \
    --python-version 3.10 --dest "$WHEELS" pytest exceptiongroup tomli \
    || exit 1
  printf 'wheels in %s (%s): carry it to the GPU machine with the tree\n' "$WHEELS" \
    "$(du -sh "$WHEELS" | cut -f1)"
  exit 0
fi
log() { printf '[gpu_check] %s\n' "$*" | tee -a "$OUT_DIR/gpu_check.log" >&2; }

LIMITS=0
# step NAME LIMIT_S CMD...: run, log to OUT_DIR/NAME.log, append {"step", "limit_s", "rc",
# "seconds"}. At its limit a step gets SIGINT (pytest then writes its report), 10 s later SIGKILL.
step() {
  local name="$1" limit="$2"; shift 2
  LIMITS=$((LIMITS + limit))
  if [[ $MODE == dry ]]; then
    printf 'would run %s (limit %ss): %s\n' "$name" "$limit" "$*"; return 0
  fi
  local t0=$SECONDS rc
  log "$name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  printf '{"step": "%s", "limit_s": %d, "rc": %d, "seconds": %d}\n' "$name" "$limit" "$rc" \
    "$((SECONDS - t0))" >> "$STEPS"
  log "$name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 5 "$OUT_DIR/$name.log" >&2
  return $rc
}

cuda_python() { "$1" -c "import torch, triton; assert torch.cuda.is_available()" 2>/dev/null; }

if [[ $MODE == server ]]; then
  # A user's CUDA machine with network: the GPU extras, then our server against radix on GPU.
  nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || { log "nvidia-smi failed: no GPU here"; exit 2; }
  step install 1200 env KVCMAS_GPU=1 VENV="$VENV" bash scripts/install.sh || exit 1
  export KVCMAS_BENCH_SERVER_ARGS="${KVCMAS_BENCH_SERVER_ARGS:---device cuda --dtype bfloat16 --mem-fraction-static 0.8}"
  step head_to_head 3600 "$VENV/bin/python" benchmark/serving/head_to_head.py --quick --sequential \
    --arms radix,kvcmas --out "$OUT_DIR"; rc=$?
  step lora_head_to_head 3600 "$VENV/bin/python" benchmark/serving/lora_head_to_head.py --quick \
    --out "$OUT_DIR" || rc=1
  step lora_head_to_head_shots 3600 "$VENV/bin/python" benchmark/serving/lora_head_to_head.py \
    --quick --shots 4 --arms stock,borrow --out "$OUT_DIR" || rc=1
  exit $rc
fi

# The python that runs the check: the venv's if it sees CUDA, else the machine's own.
PY="$VENV/bin/python"
if [[ $MODE == dry ]]; then
  cuda_python "$PY" || PY="$(command -v python3 || echo python3)"
  printf 'python: %s (CUDA: %s)\n' "$PY" "$(cuda_python "$PY" && echo yes || echo no)"
else
  if ! nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1; then
    log "nvidia-smi failed: no GPU here"; exit 2
  fi
  cuda_python "$PY" || PY="$(command -v python3)"
  cuda_python "$PY" || { log "no python here imports torch and triton with CUDA"; exit 1; }
fi
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import pytest" 2>/dev/null; then
  # No network on a lent GPU machine: pytest from wheels carried with the tree, if any.
  deps="$OUT_DIR/.pydeps"
  if [[ -d "$WHEELS" && $MODE != dry ]]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" \
      --target "$deps" pytest && export PYTHONPATH="$PYTHONPATH:$deps"
  fi
  [[ $MODE == dry ]] && echo "pytest: missing (would install from $WHEELS)"
elif [[ $MODE == dry ]]; then
  echo "pytest: present"
fi
HAVE_FI=0; "$PY" -c "import flashinfer" 2>/dev/null && HAVE_FI=1
HAVE_SGLANG=0; "$PY" -c "import sglang.srt" 2>/dev/null && HAVE_SGLANG=1

export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-${TMPDIR:-/tmp}/kvcmas-flashinfer}"
if [[ $MODE != dry ]]; then
  export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-$("$PY" -c \
    'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}.{b}" + ("a" if a >= 9 else ""))')}"
  log "GPU: $("$PY" -c 'import torch; print(torch.cuda.get_device_name())'), arch $FLASHINFER_CUDA_ARCH_LIST, flashinfer=$HAVE_FI sglang=$HAVE_SGLANG"
else
  echo "flashinfer: $HAVE_FI, sglang: $HAVE_SGLANG"
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export KVCMAS_KERNEL_TESTS_FULL=1

# Kernel tests on CUDA (no interpreter: conftest only sets TRITON_INTERPRET without a GPU).
tests=(test/lab/kernels test/attention/test_kernel_reads.py
       test/attention/test_triton_head_mass.py test/attention/test_probe_reads.py)
[[ $HAVE_SGLANG == 1 ]] && tests+=(test/integration/test_shared_triton_backend.py
                                  test/integration/test_shared_backends.py)
# Limits: together under 6 minutes, with the start and the summary.
step kernel_tests 200 "$PY" -m pytest "${tests[@]}" -v -p no:cacheprovider \
  --junitxml="$OUT_DIR/kernel_tests.xml"

quick=(); [[ "${KVCMAS_GPU_CHECK_QUICK:-1}" == 1 ]] && quick=(--quick)
step benchmark 130 "$PY" benchmark/kernels/delta_attention_gpu_bench.py --out "$OUT_DIR" \
  --with-variant "${quick[@]}"

if [[ $MODE == dry ]]; then
  carried="$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')"
  wheels=0; [[ -d "$WHEELS" ]] && wheels="$(du -sb "$WHEELS" | cut -f1)"
  printf 'steps: limits %d s in all (under 6 minutes with the start and the summary)\n' "$LIMITS"
  awk -v t="${carried:-0}" -v w="$wheels" -v where="$([[ -d "$WHEELS" ]] && echo "$WHEELS" \
      || echo "none yet: scripts/gpu_check.sh --prepare")" 'BEGIN {
    printf "carried: tree %.1f MiB + wheels %.1f MiB (%s) = %.1f MiB of 64 MiB\n",
      t / 1048576, w / 1048576, where, (t + w) / 1048576 }'
  printf 'summary: %s/gpu_check_summary.json, fields:\n' "$OUT_DIR"
  "$PY" -m sglang_kvcmas_bench.gpu_summary --fields
  exit 0
fi
"$PY" -m sglang_kvcmas_bench.gpu_summary "$OUT_DIR" | tee -a "$OUT_DIR/gpu_check.log" >&2
log "results in $OUT_DIR:"; ls -la "$OUT_DIR" >&2
! grep -q '"rc": [1-9]' "$STEPS"
