"""Serving the default model never calls an op of the sgl_kernel stand-in."""

from __future__ import annotations

import importlib.util

import pytest
import requests

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_no_standin_op_called_while_serving(server):
    if "sgl_kernel: standin" not in server.log():
        pytest.skip("a real sgl_kernel is installed: the server does not use the stand-in")
    assert importlib.util.find_spec("sgl_kernel") is None  # stand-in only where none exists
    # Prefill, decode, streaming, chat and a cache hit, so the test stands on its own.
    for _ in range(2):
        requests.post(f"{server.url}/generate",
                      json={"text": "One, two, three,", "sampling_params": {"max_new_tokens": 8}},
                      timeout=120).raise_for_status()
    requests.post(f"{server.url}/generate", stream=True, timeout=120,
                  json={"text": "Four, five,", "stream": True,
                        "sampling_params": {"max_new_tokens": 4}}).raise_for_status()
    requests.post(f"{server.url}/v1/chat/completions", timeout=120,
                  json={"model": "default", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "Hi"}]}).raise_for_status()
    calls = server.standin_log_path.read_text() if server.standin_log_path.exists() else ""
    assert calls == "", f"sgl_kernel stand-in ops were called:\n{calls}"
