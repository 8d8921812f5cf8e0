"""SGLang's routes answer through our launcher, and the server says our tree cache is in use."""

from __future__ import annotations

import json

import pytest
import requests

pytestmark = [pytest.mark.server, pytest.mark.slow]

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}


def test_health(server):
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200


def test_generate(server):
    r = requests.post(f"{server.url}/generate",
                      json={"text": "The capital of France is", "sampling_params": GREEDY},
                      timeout=120)
    r.raise_for_status()
    body = r.json()
    assert body["text"].strip()
    assert body["meta_info"]["completion_tokens"] == len(body["output_ids"]) > 0
    assert body["meta_info"]["prompt_tokens"] > 0
    assert "cached_tokens" in body["meta_info"]


def test_generate_streaming(server):
    payload = {"text": "Count: one, two,", "sampling_params": GREEDY, "stream": True}
    chunks = []
    with requests.post(f"{server.url}/generate", json=payload, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if line and line.startswith("data:"):
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunks.append(json.loads(data))
    assert len(chunks) >= 2, "a streamed generation arrives in several events"
    final = chunks[-1]
    assert final["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    # Same prompt, same greedy settings: streaming and non-streaming agree.
    plain = requests.post(f"{server.url}/generate",
                          json={"text": payload["text"], "sampling_params": GREEDY},
                          timeout=120).json()
    assert final["text"] == plain["text"]


def test_chat_completions(server):
    r = requests.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "Say hello."}],
              "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    r.raise_for_status()
    body = r.json()
    assert body["choices"][0]["message"]["content"]
    usage = body["usage"]
    assert usage["completion_tokens"] > 0
    # --enable-cache-report is one of our defaults.
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_models(server):
    r = requests.get(f"{server.url}/v1/models", timeout=30)
    r.raise_for_status()
    (model,) = r.json()["data"]
    assert "SmolLM2-135M-Instruct" in model["id"]
    assert model["max_model_len"] == 8192


def test_flush_cache(server):
    requests.post(f"{server.url}/generate",
                  json={"text": "A prompt to cache.", "sampling_params": GREEDY}, timeout=120)
    r = requests.post(f"{server.url}/flush_cache", timeout=60)
    assert r.status_code == 200
    assert "flushed" in r.text.lower()


def test_repeated_prompt_hits_the_cache(server):
    prompt = "The three primary colours are red, yellow and blue. Name another colour:"
    requests.post(f"{server.url}/flush_cache", timeout=60).raise_for_status()
    first = requests.post(f"{server.url}/generate",
                          json={"text": prompt, "sampling_params": GREEDY}, timeout=120).json()
    second = requests.post(f"{server.url}/generate",
                           json={"text": prompt, "sampling_params": GREEDY}, timeout=120).json()
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == second["meta_info"]["prompt_tokens"] - 1


def test_server_info_names_our_tree_cache(server):
    info = requests.get(f"{server.url}/server_info", timeout=60).json()
    assert info["radix_cache_backend"] == "kvcmas"  # what was asked for
    assert info["device"] == "cpu" and info["dtype"] == "float32"
    (state,) = info["internal_states"]  # what each scheduler actually built
    assert state["kvcmas"]["tree_cache_class"] == (
        "sglang_kvcmas.integration.shared_tree_cache.KvcmasSharedTreeCache"
    )
    assert state["kvcmas"]["radix_cache_backend"] == "kvcmas"


def test_server_log_names_our_tree_cache(server):
    log = server.log()
    assert "sglang-kvcmas: tree cache sglang_kvcmas.integration.shared_tree_cache." \
           "KvcmasSharedTreeCache in use" in log
    assert "share_context=False" in log  # sharing is opt-in
    assert "impl=KvcmasSharedTreeCache" in log  # SGLang's own line agrees


def test_metrics(server):
    r = requests.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200
    assert "sglang:" in r.text
