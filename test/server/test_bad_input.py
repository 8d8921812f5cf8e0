"""Malformed and oversized requests get a clear 4xx, and the server keeps serving."""

from __future__ import annotations

import pytest
import requests

pytestmark = [pytest.mark.server, pytest.mark.slow]

CONTEXT_LEN = 8192  # SmolLM2-135M-Instruct


def _still_serves(url: str) -> None:
    r = requests.post(f"{url}/generate",
                      json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}, timeout=120)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


def test_malformed_json(server):
    r = requests.post(f"{server.url}/generate", data=b'{"text": 1',
                      headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400
    assert "JSON decode error" in r.json()["message"]
    _still_serves(server.url)


def test_wrong_field_type(server):
    r = requests.post(f"{server.url}/generate",
                      json={"text": "hi", "sampling_params": {"max_new_tokens": "lots"}},
                      timeout=60)
    assert 400 <= r.status_code < 500
    assert "max_new_tokens" in r.text or "expected" in r.text
    _still_serves(server.url)


def test_chat_without_messages(server):
    r = requests.post(f"{server.url}/v1/chat/completions", json={"model": "default"}, timeout=60)
    assert r.status_code == 400
    assert "messages" in r.json()["message"]
    _still_serves(server.url)


def test_prompt_longer_than_context(server):
    r = requests.post(
        f"{server.url}/generate",
        json={"input_ids": [1000] * (CONTEXT_LEN + 100), "sampling_params": {"max_new_tokens": 4}},
        timeout=120,
    )
    assert r.status_code == 400
    assert "longer than the model's context length" in r.json()["error"]["message"]
    _still_serves(server.url)
