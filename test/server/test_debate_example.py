"""The debate example runs against the server and reports what the cache reused."""

from __future__ import annotations

import pytest
import sglang as sgl

from sglang_kvcmas.examples.debate import CHAT_TEMPLATE, DEFAULT_AGENTS, run_debate

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_short_debate_reports_cache_reuse(any_server):
    backend = sgl.RuntimeEndpoint(any_server.url, chat_template_name=CHAT_TEMPLATE)
    backend.flush_cache()
    agents = DEFAULT_AGENTS[:2]
    run = run_debate(backend, "What is 3 + 4?", "7", agents=agents, rounds=2, max_new_tokens=6)
    assert [(t.round, t.agent) for t in run.turns] == [
        (r, a.name) for r in (1, 2) for a in agents]
    assert all(t.completion_tokens > 0 and t.answer for t in run.turns)
    assert all(0 < t.ttft_client_s <= t.latency_s for t in run.turns)
    assert all(t.ttft_server_s is not None and t.ttft_server_s > 0 for t in run.turns)
    # The transcript grows: every prompt is longer than the one before.
    prompts = [t.prompt_tokens for t in run.turns]
    assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)
    # After the flush the first turn reuses nothing. In round 2 each agent's prompt begins like
    # its round-1 prompt (own system prompt, then the question), so prefix caching reuses at
    # least that head: more than the chat-template tokens any two agents share.
    assert run.turns[0].cached_tokens == 0
    head_tokens = 20
    assert all(t.cached_tokens > head_tokens for t in run.turns if t.round == 2)
    assert run.cached_tokens == sum(t.cached_tokens for t in run.turns) > 0
