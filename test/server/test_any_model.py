"""A Qwen2-family model served with sharing on: a tiny random-weight one, built here (no download).

The model is ``Qwen2ForCausalLM`` with tiny dimensions saved with ``save_pretrained``, with the
embedded model's tokenizer files (ChatML chat template) copied in. It boots through our launcher
with our CPU defaults (``--mem-fraction-static`` sized from this model), and a second agent
(another system prompt) borrows the first one's transcript KV, as ``usage`` reports.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from sglang_kvcmas.server.process import ServerProcess
from sglang_kvcmas_bench.tiny_models import tiny_qwen2

pytestmark = [pytest.mark.server, pytest.mark.slow]

SA = "You are Ada, a careful mathematician."
SB = "You are Ben, a skeptical reviewer who checks every step."


def chat(url: str, system: str, user: str) -> dict:
    body = {"model": "default", "temperature": 0, "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["usage"]["prompt_tokens_details"]


def test_second_agent_borrows_on_a_tiny_qwen2_model(tmp_path):
    model = tiny_qwen2(tmp_path / "tiny-qwen2")
    transcript = " ".join(f"Step {i}: the farmer counts {i * 7} sheep and writes it down."
                          for i in range(20))
    with ServerProcess(args=["--model-path", str(model), "--kvcmas-share-context",
                             "--max-total-tokens", "4096"],
                       log_path=tmp_path / "server.log", boot_timeout_s=300) as server:
        log = server.log_path.read_text(errors="replace")
        assert "Qwen2ForCausalLM" in log or "qwen2" in log.lower()
        chat(server.url, SA, "Hello.")
        chat(server.url, SB, "Hello.")  # both heads cached: B can borrow from its next turn
        owner = chat(server.url, SA, transcript)
        reader = chat(server.url, SB, transcript)
    assert owner["kvcmas_reused_repositioned"] == 0 and owner["kvcmas_recomputed"] > 128
    assert reader["kvcmas_reused_repositioned"] > 100, reader
    assert reader["cached_tokens"] == (reader["kvcmas_reused_exact"]
                                       + reader["kvcmas_reused_repositioned"])
