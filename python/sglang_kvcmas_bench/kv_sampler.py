"""Peak KV pool use of a running server, sampled from its ``/metrics`` while a workload runs."""

from __future__ import annotations

import threading
import urllib.request


class KvSampler(threading.Thread):
    """Polls /metrics and keeps the peak of pool slots held (and the pool's size)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.peak, self._halt = url, 0, threading.Event()
        self.pool_tokens: int | None = None

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
                    vals = {}
                    for line in r.read().decode().splitlines():
                        for name in ("sglang:kv_used_tokens", "sglang:kv_evictable_tokens"):
                            if line.startswith(name):
                                vals[name] = int(float(line.rsplit(" ", 1)[1]))
                        if line.startswith("sglang:max_total_num_tokens{"):
                            self.pool_tokens = int(float(line.rsplit(" ", 1)[1]))
                    if len(vals) == 2:  # slots held = in use by requests + cached (evictable)
                        self.peak = max(self.peak, sum(vals.values()))
            except OSError:
                pass
            self._halt.wait(0.5)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak
