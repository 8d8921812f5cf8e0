"""Run model-written Python in a subprocess: time limit, memory limit, no network, a scratch dir.

Used by the accuracy benchmark to execute program-aided GSM8K answers and HumanEval tests.

Isolation, strongest available first (:func:`isolation`):

- ``unshare``: the child runs in its own user + network namespace (``unshare -rn``): no network
  interface but loopback, so no connection can leave the machine.
- ``guard``: a prelude that replaces ``socket.socket`` (and ``socket.create_connection``) by a
  function that raises, before the program runs: always there, the only barrier where
  namespaces are not permitted.

Both have: ``python -I`` (no user site, no environment variables read), an empty environment, a
fresh temporary working directory removed afterwards, ``RLIMIT_AS`` (address space),
``RLIMIT_CPU`` and ``RLIMIT_FSIZE``, and a wall-clock timeout after which the whole process
group is killed. This is a harness for benchmark code, not a security boundary for hostile code.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

MEMORY_LIMIT_BYTES = 1 << 30
OUTPUT_LIMIT_CHARS = 4000

_GUARD = """\
import socket as _s
def _no_network(*a, **k):
    raise OSError("network access is disabled in the sandbox")
_s.socket = _no_network
_s.create_connection = _no_network
del _s, _no_network
"""


@dataclass(frozen=True)
class RunResult:
    """What one sandboxed program did.

    Attributes:
        ok: exit status 0 within the time limit.
        returncode: the exit status (negative: killed by that signal; None: timed out).
        stdout, stderr: their first ``OUTPUT_LIMIT_CHARS`` characters.
        timed_out: the wall-clock limit was reached.
        seconds: wall time.
    """

    ok: bool
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float


@functools.cache
def isolation() -> str:
    """``"unshare"`` when this machine lets an unprivileged process have its own network
    namespace, else ``"guard"``."""
    if shutil.which("unshare") is None:
        return "guard"
    try:
        probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "guard"
    return "unshare" if probe.returncode == 0 else "guard"


def _limits(cpu_s: int) -> None:  # runs in the child, before exec
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 24, 1 << 24))


def run_python(code: str, timeout_s: float = 10.0) -> RunResult:
    """Run ``code`` as a Python program in the sandbox and return what it did."""
    import time

    with tempfile.TemporaryDirectory(prefix="kvcmas-sandbox-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w") as f:
            f.write(_GUARD + "\n" + code)
        cmd = [sys.executable, "-I", path]
        if isolation() == "unshare":
            cmd = ["unshare", "-rn", *cmd]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=tmp, env={}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace",
                                preexec_fn=functools.partial(_limits, int(timeout_s) + 1))
        try:
            out, err = proc.communicate(timeout=timeout_s)
            timed_out, code_ = False, proc.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            timed_out, code_ = True, None
        seconds = time.perf_counter() - t0
    return RunResult(ok=code_ == 0 and not timed_out, returncode=code_,
                     stdout=out[:OUTPUT_LIMIT_CHARS], stderr=err[-OUTPUT_LIMIT_CHARS:],
                     timed_out=timed_out, seconds=seconds)
