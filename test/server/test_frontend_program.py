"""An SGLang frontend program (sgl.function with fork and select) runs unchanged on our server."""

from __future__ import annotations

import pytest
import sglang as sgl

pytestmark = [pytest.mark.server, pytest.mark.slow]


@sgl.function
def judge_then_explain(s, question: str):
    s += "Question: " + question + "\nAnswer (yes or no): "
    s += sgl.select("verdict", choices=["yes", "no"])
    s += "\n"
    branches = s.fork(2)
    for i, branch in enumerate(branches):
        branch += f"Reason {i + 1}:" + sgl.gen("reason", max_tokens=8, temperature=0.0, stop="\n")
    branches.join()
    s += "Reasons: " + " / ".join(b["reason"] for b in branches)


def test_fork_and_select(any_server):
    backend = sgl.RuntimeEndpoint(any_server.url)
    state = judge_then_explain.run(question="Is water wet?", backend=backend)
    assert state.error() is None
    assert state["verdict"] in ("yes", "no")
    text = state.text()
    assert text.startswith("Question: Is water wet?\nAnswer (yes or no): " + state["verdict"])
    reasons = text.split("Reasons: ", 1)[1].split(" / ")
    assert len(reasons) == 2
    # Both branches ran greedy from the same state with different prompts ("Reason 1/2:").
    assert all(isinstance(r, str) for r in reasons)


def test_a_program_run_is_one_workflow_in_the_servers_ledger(sharing_server):
    import json
    import urllib.request
    import uuid

    from sglang_kvcmas.frontend import KvcmasEndpoint

    workflow = f"frontend-{uuid.uuid4().hex[:8]}"
    backend = KvcmasEndpoint(sharing_server.url, workflow=workflow)
    state = judge_then_explain.run(question="Is ice cold?", backend=backend)
    assert state.error() is None
    with urllib.request.urlopen(f"{sharing_server.url}/kvcmas/workflows/{workflow}",
                                timeout=60) as r:
        flow = json.loads(r.read())
    # select's scoring request(s) and both forked gens, every one under the run's workflow
    assert flow["requests"] >= 3 and flow["in_flight"] == 0
    assert flow["prompt_tokens"] > 0 and flow["kv_bytes_read"] > 0
    assert len(flow["turns"]) == flow["requests"]
