"""Two sglang-kvcmas servers shared by the server tests of a session (booting costs ~40 s each).

``server`` runs through our launcher with its defaults (embedded model, CPU settings, ``kvcmas``
tree cache, sharing off) on a free port in 30000–30999, with the sgl_kernel stand-in's call log
enabled. ``sharing_server`` has sharing on, a small KV pool (4096 tokens) and chunked prefill
(256), so the reliability suite meets eviction and chunk boundaries. ``any_server`` runs a test
on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from sglang_kvcmas.server.process import ServerProcess


@dataclass(frozen=True)
class RunningServer:
    """What server tests need to know about the shared server."""

    url: str
    log_path: Path
    standin_log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    workdir = tmp_path_factory.mktemp("kvcmas-server")
    standin_log = workdir / "sgl_kernel_standin_calls.log"
    process = ServerProcess(
        log_path=workdir / "server.log",
        env={"KVCMAS_SGL_KERNEL_STANDIN_LOG": str(standin_log)},
        boot_timeout_s=300,
    )
    process.start()
    try:
        yield RunningServer(process.url, process.log_path, standin_log)
    finally:
        process.stop()


SHARING_FLAGS = ["--kvcmas-share-context", "--max-total-tokens", "4096",
                 "--chunked-prefill-size", "256"]


@pytest.fixture(scope="session")
def sharing_server(tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    workdir = tmp_path_factory.mktemp("kvcmas-sharing-server")
    standin_log = workdir / "sgl_kernel_standin_calls.log"
    process = ServerProcess(
        args=SHARING_FLAGS, log_path=workdir / "server.log",
        env={"KVCMAS_SGL_KERNEL_STANDIN_LOG": str(standin_log)}, boot_timeout_s=300,
    )
    process.start()
    try:
        yield RunningServer(process.url, process.log_path, standin_log)
    finally:
        process.stop()


@pytest.fixture(params=["sharing_off", "sharing_on"])
def any_server(request: pytest.FixtureRequest) -> RunningServer:
    return request.getfixturevalue("server" if request.param == "sharing_off"
                                   else "sharing_server")
