"""ServerProcess boots only its own server: another job's server on the port does not count."""

from __future__ import annotations

import http.server
import threading

import pytest

from sglang_kvcmas.server.process import HOST, ServerProcess, ServerStartError, free_port


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_healthy_stranger_on_the_port_is_not_our_server(tmp_path):
    port = free_port(34000, 35000)
    stranger = http.server.ThreadingHTTPServer((HOST, port), _Health)
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(4)\n")  # never listens
    proc = ServerProcess(args=[], log_path=tmp_path / "log", port=port, module="sleeper",
                         env={"PYTHONPATH": str(tmp_path)}, boot_timeout_s=30)
    try:
        with pytest.raises(ServerStartError, match="exited with status 0 while booting"):
            proc.start()
    finally:
        proc.stop()
        stranger.shutdown()
        stranger.server_close()


def test_free_ports_spread_over_the_range_and_stay_free():
    ports = {free_port(34000, 35000) for _ in range(20)}
    assert len(ports) > 1  # a random start: two jobs rarely pick the same port
    lowest = free_port(34000, 35000, spread=False)
    assert lowest == free_port(34000, 35000, spread=False) and lowest <= min(ports)
