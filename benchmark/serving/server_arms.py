"""Boot one SGLang server per benchmark arm (same binary, different tree cache), stop it cleanly.

Arms:
    kvcmas    ``sglang_kvcmas.integration.shared_launch --kvcmas-share-context`` (our tree cache
              + delta attention backend, cross-agent sharing on)
    radix     ``sglang_kvcmas.launch_server --kvcmas-stock-cache`` (SGLang's default radix cache)
    no_cache  ``sglang_kvcmas.launch_server --kvcmas-stock-cache --disable-radix-cache``

All on 127.0.0.1, their own process group, output to a log file.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"

ARMS: dict[str, list[str]] = {
    "kvcmas": ["-m", "sglang_kvcmas.integration.shared_launch", "--kvcmas-share-context"],
    "radix": ["-m", "sglang_kvcmas.launch_server", "--kvcmas-stock-cache"],
    "no_cache": ["-m", "sglang_kvcmas.launch_server", "--kvcmas-stock-cache",
                 "--disable-radix-cache"],
}


def free_port(start: int = 31000, end: int = 32000) -> int:
    for port in range(start, end):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{end - 1}")


@dataclass
class ArmServer:
    """One server process for one arm; a context manager."""

    arm: str
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int | None = None
    boot_timeout_s: float = 400.0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> ArmServer:
        self.port = self.port or free_port()
        cmd = [sys.executable, *ARMS[self.arm], *self.extra_args, "--host", HOST,
               "--port", str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                                         start_new_session=True)
        deadline = time.monotonic() + self.boot_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").splitlines()[-40:]
                raise RuntimeError(f"{self.arm} server exited while booting:\n" + "\n".join(tail))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.arm} server not healthy after {self.boot_timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def __enter__(self) -> ArmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
