"""The example programs (debate, panel, fan-out) run against the server and report what the
cache reused."""

from __future__ import annotations

import pytest
import sglang as sgl

from sglang_kvcmas_examples.debate import CHAT_TEMPLATE, DEFAULT_AGENTS, run_debate

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


def test_panel_program_runs_three_rounds_and_round_two_borrows(sharing_server):
    """The review panel (examples/panel.py) over a short document on the sharing server:
    every panelist answers in each round, and in round 2 (all read the same document at
    once) the readers reuse it from one panelist's KV (re-positioned) instead of prefilling it."""
    from sglang_kvcmas_examples.panel import PERSONAS, document, run_panel

    backend = sgl.RuntimeEndpoint(sharing_server.url, chat_template_name=CHAT_TEMPLATE)
    run = run_panel(backend, document(1600), agents=3, answer_tokens=4)
    assert [(t.round, t.agent) for t in run.turns] == [
        (r, p) for r in (1, 2, 3) for p in PERSONAS[:3]]
    assert all(t.completion_tokens > 0 for t in run.turns)
    borrowed = [(t.reuse or {}).get("reused_repositioned", 0) for t in run.turns if t.round == 2]
    assert sorted(borrowed)[-2] > 200  # two of three readers borrowed the document


def test_fanout_program_forks_one_worker_per_sub_task(sharing_server):
    from sglang_kvcmas_examples.fanout import run_fanout, sub_tasks

    assert sub_tasks("1. add\n- multiply\nnothing", "q", 8) == ["add", "multiply"]
    assert sub_tasks("no list", "q", 8) == ["q"]
    backend = sgl.RuntimeEndpoint(sharing_server.url, chat_template_name=CHAT_TEMPLATE)
    run = run_fanout(backend, "What is 3 + 4, then times 2?", "14", workers=2, answer_tokens=24)
    workers = [t for t in run.turns if t.round == 2]
    assert [t.agent for t in run.turns] == ["Planner", *(t.agent for t in workers),
                                            "Aggregator"]
    assert len(workers) == len(run.tasks) and 1 <= len(workers) <= 2
    assert all(t.completion_tokens > 0 and t.ttft_client_s > 0 for t in run.turns)
