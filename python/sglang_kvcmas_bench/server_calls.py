"""HTTP calls to one server: JSON posts, ``/generate`` (plain and streamed), and calls that
never raise (``call``, ``raw_stream``: the robustness benchmarks judge every status).

Standard library only (``urllib``), so every benchmark can call a server without extra packages.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlparse


def post(url: str, body: dict, timeout: float = 600) -> dict:
    """POST ``body`` as JSON to ``url``; the JSON answer (an HTTP error raises)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def stream_generate(url: str, ids: list[int], max_new: int, extra: dict | None = None) -> dict:
    """One streamed /generate; returns ttft, latency, output ids/text and meta_info. ``extra``:
    more request fields (e.g. ``lora_path``)."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new}, **(extra or {})}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, last = None, None
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "text": last["text"],
            "output_ids": last.get("output_ids"), "meta": last["meta_info"]}


def generate(url: str, ids: list[int], max_new: int, salt: str | None = None, **extra) -> dict:
    """One greedy ``/generate`` of ``max_new`` tokens after ``ids``; ``salt``: its
    ``cache_salt`` (a fresh one: nothing shared, nothing cached); ``extra``: more request fields
    (``sampling``: more sampling parameters)."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new,
                                                  **extra.pop("sampling", {})}, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    return post(url + "/generate", body)


# ----- HTTP without raising -------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    """What a call got: the HTTP status and body, or ``None`` and the error."""

    status: int | None  # None: no HTTP answer (connection error, timeout)
    body: str

    def json(self) -> dict:
        try:
            return json.loads(self.body)
        except ValueError:
            return {}


def call(url: str, path: str, body: dict | None = None, headers: dict | None = None,
         timeout: float = 300.0) -> Reply:
    """POST ``body`` (GET without one) to ``url + path``; any outcome as a :class:`Reply`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, r.read().decode(errors="replace"))
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError) as e:
        return Reply(None, str(e))


def raw_stream(url: str, body: dict, drop_after_chunks: int | None) -> int:
    """POST a streamed request over a raw socket and close it after ``drop_after_chunks`` SSE
    chunks (0: before the first; None: read to the end). Returns the chunks seen."""
    u = urlparse(url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=300)
    path = "/v1/chat/completions" if "messages" in body else "/generate"
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                 + payload)
    seen, buf = 0, b""
    try:
        while drop_after_chunks is None or seen < drop_after_chunks:
            data = sock.recv(4096)
            if not data:
                break
            buf += data
            seen = buf.count(b"data:")
    finally:
        sock.close()
    return seen


def flush(url: str, timeout_s: float = 120.0) -> None:
    """Flush the server's caches once every request has drained: SGLang refuses (400) while
    requests run."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"),
                                   timeout=60).read()
            return
        except urllib.error.HTTPError as e:
            if e.code != 400 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
