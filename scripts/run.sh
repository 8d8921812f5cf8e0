#!/usr/bin/env bash
# Install if needed, start sglang-kvcmas's server, run the 3-agent debate example against it,
# and stop the server again (also on Ctrl-C or error).
#
#   scripts/run.sh                      # embedded model, port 30000
#   PORT=30100 scripts/run.sh --rounds 2 --max-new-tokens 48   # args go to the debate example
#
# Environment: VENV (default .venv, see scripts/install.sh), PORT (30000), BOOT_TIMEOUT (300 s),
# SERVER_ARGS (extra flags for sglang-kvcmas-server, e.g. "--model-path /path/to/hf-folder"),
# LOG (server log file, default a temp file), SKIP_INSTALL=1 (do not run scripts/install.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VENV="${VENV:-$ROOT/.venv}"
PORT="${PORT:-30000}"
BOOT_TIMEOUT="${BOOT_TIMEOUT:-300}"
LOG="${LOG:-$(mktemp -t sglang-kvcmas-server.XXXXXX.log)}"
URL="http://127.0.0.1:$PORT"
say() { printf '[run] %s\n' "$*" >&2; }

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then "$ROOT/scripts/install.sh"; fi
PY="$VENV/bin/python"

if "$PY" - "$PORT" <<'PY'
import socket, sys
s = socket.socket()
sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
PY
then
  say "port $PORT is already in use; choose another with PORT=..."
  exit 1
fi

server_pid=""
stop_server() {
  [[ -n "$server_pid" ]] || return 0
  if kill -0 "$server_pid" 2>/dev/null; then
    say "stopping the server (pid $server_pid)"
    kill -TERM "$server_pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
  fi
  # Anything left in the server's process group (scheduler, detokenizer).
  kill -KILL -- "-$server_pid" 2>/dev/null || true
  server_pid=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

say "starting sglang-kvcmas-server on $URL (log: $LOG)"
# setsid: the server gets its own process group, so stop_server can clean up all of it.
# shellcheck disable=SC2086
setsid "$PY" -m sglang_kvcmas.launch_server --host 127.0.0.1 --port "$PORT" ${SERVER_ARGS:-} \
  >"$LOG" 2>&1 &
server_pid=$!

start=$(date +%s)
until curl -sf "$URL/health" >/dev/null 2>&1; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    wait "$server_pid" && status=0 || status=$?
    server_pid=""
    say "the server exited (status $status) before it became healthy; last lines of $LOG:"
    tail -n 40 "$LOG" >&2
    exit 1
  fi
  waited=$(( $(date +%s) - start ))
  if (( waited >= BOOT_TIMEOUT )); then
    say "the server is not healthy after ${BOOT_TIMEOUT}s; last lines of $LOG:"
    tail -n 40 "$LOG" >&2
    exit 1
  fi
  (( waited % 10 == 0 )) && say "waiting for the server to boot (${waited}s; $(tail -n 1 "$LOG" | cut -c1-100))"
  sleep 1
done
say "server healthy after $(( $(date +%s) - start ))s"

"$PY" -m sglang_kvcmas.examples.debate --url "$URL" "$@"
