"""Start ``sglang-kvcmas-server`` as a child process, wait until it is healthy, stop it cleanly.

Used by the test fixture and the serving benchmarks so that every caller boots the server the
same way: our launcher, 127.0.0.1, its own process group, output to a log file, and a clear
error with the log's tail when it dies or does not become healthy in time.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time (message has the log's tail)."""


def free_port(start: int = 30000, end: int = 31000, spread: bool = True) -> int:
    """A port in ``[start, end)`` that nothing listens on (bind-tested): searched from a random
    offset with ``spread`` (servers started at once by separate jobs rarely pick the same one),
    else the lowest."""
    offset = random.randrange(end - start) if spread and end > start else 0
    for i in range(end - start):
        port = start + (offset + i) % (end - start)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise ServerStartError(f"no free port in {start}..{end - 1}")


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


@dataclass
class ServerProcess:
    """One launcher process. Use as a context manager, or call :meth:`start` / :meth:`stop`.

    Attributes:
        args: extra launcher/SGLang flags (``--port`` and ``--host`` are added).
        log_path: where the server's stdout and stderr go.
        port: port to serve on; a free one in 30000–30999 when None.
        module: the launcher module run with ``python -m``.
        on_wait: called about every 10 s while booting with the seconds waited and the log's
            last line (progress output), or None.
        cpus: CPU cores the server and every process it starts may run on (set before it
            starts, so SGLang's children inherit it), or None: any core.
    """

    args: list[str] = field(default_factory=list)
    log_path: Path = Path("sglang-kvcmas-server.log")
    port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    boot_timeout_s: float = 300.0
    module: str = "sglang_kvcmas.launch_server"
    on_wait: Callable[[float, str], None] | None = None
    cpus: frozenset[int] | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _environment(self) -> dict[str, str]:
        # A server never runs Triton's interpreter, even when started from a test session that
        # turned it on for kernel tests (test/conftest.py).
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return {**env, **self.env}

    def start(self) -> ServerProcess:
        """Launch and block until ``GET /health`` answers 200.

        Raises:
            ServerStartError: if the process exits first or the timeout passes (it is stopped).
        """
        if self.port is None:
            self.port = free_port()
        cmd = [sys.executable, "-m", self.module, *self.args,
               "--host", HOST, "--port", str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cpus = self.cpus
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self._environment(), start_new_session=True, preexec_fn=pin,
            )
        start = time.monotonic()
        deadline, next_note = start + self.boot_timeout_s, start + 10.0
        while time.monotonic() < deadline:
            if self.on_wait is not None and time.monotonic() >= next_note:
                next_note += 10.0
                self.on_wait(time.monotonic() - start, log_tail(self.log_path, 1)[:100])
            if self.proc.poll() is not None:
                taken = "address already in use" in log_tail(self.log_path, 5).lower()
                raise ServerStartError(
                    (f"port {self.port} was taken by another process while the server booted; "
                     if taken else "")
                    + f"server exited with status {self.proc.returncode} while booting; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if self.healthy() and self.listens():
                return self
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(
            f"server not healthy after {self.boot_timeout_s:.0f} s; "
            f"log {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def listens(self) -> bool:
        """Whether our process (or a child of it) holds the listening socket on our port: a
        healthy answer from another job's server that took the port first must not count (our
        own server then fails to bind and exits, reported by :meth:`start`). True where the
        sockets cannot be read."""
        try:
            import psutil

            root = psutil.Process(self.proc.pid)
            for proc in (root, *root.children(recursive=True)):
                for conn in proc.net_connections(kind="tcp"):
                    if conn.status == psutil.CONN_LISTEN and conn.laddr.port == self.port:
                        return True
            return False
        except ImportError:
            return True
        except Exception:  # noqa: BLE001 - a process gone between the calls, no permission
            return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the launcher (SGLang then stops its children), then SIGKILL what is left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):  # the group: scheduler, detokenizer
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
