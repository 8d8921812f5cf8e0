"""The spare pass and the fidelity monitor on SGLang's server (one server, spare pass on, every
reader turn sampled, a 512-token prefill chunk): an agent alone over a short transcript is served
exactly on an idle server; over a transcript too long for one chunk it borrows, and the monitor
checks the turn against an exact prefill after it without changing what the client gets."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from test_shared_server import SA, SB, T2

pytestmark = [pytest.mark.slow, pytest.mark.server]

SC = ("You are Cleo, a careful reviewer who reads every answer and says in one sentence whether "
      "the team agrees.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sglang_kvcmas_bench.server_arms import ArmServer

    log = tmp_path_factory.mktemp("kvcmas-fidelity") / "server.log"
    with ArmServer("kvcmas", log, ["--chunked-prefill-size", "512",
                                   "--kvcmas-fidelity-share", "1"],
                   env={"KVCMAS_SPARE_PREFILL": "1"}) as s:
        yield s


def chat(server, system: str, user: str, max_tokens: int = 8, workflow: str | None = None):
    body = {"model": "default", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}
    headers = {"Content-Type": "application/json"}
    if workflow:
        headers["X-KVCMAS-Workflow"] = workflow
    req = urllib.request.Request(server.url + "/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def state(server) -> dict:
    with urllib.request.urlopen(server.url + "/server_info", timeout=60) as r:
        return json.loads(r.read())["internal_states"][0]["kvcmas"]


def test_an_agent_alone_on_an_idle_server_is_served_exactly(server):
    chat(server, SA, T2)
    before = state(server)["shared_tree"]["spare_exact_requests"]
    reader = chat(server, SB, T2)["usage"]["prompt_tokens_details"]
    assert reader["kvcmas_reused_repositioned"] == reader["kvcmas_reused_factored"] == 0
    assert reader["kvcmas_recomputed_borrowed"] == 0
    assert state(server)["shared_tree"]["spare_exact_requests"] > before


def test_a_reader_turn_is_checked_against_an_exact_prefill(server):
    long = "\n\n".join([T2] * 4)  # past one 512-token chunk: no spare pass
    chat(server, SA, long, workflow="fidelity-test")
    reader = chat(server, SC, long, max_tokens=24, workflow="fidelity-test")
    details = reader["usage"]["prompt_tokens_details"]
    assert details["kvcmas_reused_repositioned"] + details["kvcmas_reused_factored"] > 128
    choice = reader["choices"][0]
    assert choice.get("logprobs") is None  # the monitor's log-probabilities stay inside
    for _ in range(120):  # the exact prefill runs after the response
        fidelity = state(server)["fidelity"]
        if fidelity["turns"]:
            break
        time.sleep(1)
    assert fidelity["sampled"] >= 1 and fidelity["turns"] >= 1 and fidelity["failed"] == 0
    assert 0.0 <= fidelity["top1_agreement"] <= 1.0 and fidelity["prefilled_tokens"] > 0
    sample = fidelity["recent"][-1]
    assert sample["positions"] == 16 and sample["kl"] is not None and sample["kl"] >= 0
    # the workflow's later responses carry its samples
    later = chat(server, SA, T2, workflow="fidelity-test")["usage"]["prompt_tokens_details"]
    assert later["kvcmas_fidelity_turns"] >= 1
