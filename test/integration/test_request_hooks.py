"""Request checks in the HTTP process and the streamed usage chunk, without a server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_kvcmas.integration.request_hooks import label_and_check
from sglang_kvcmas.integration.usage_stream import with_usage
from sglang_kvcmas.policy.request_options import RequestOptionError


def test_workflow_header_reaches_every_prompt_and_conflicts_are_refused():
    obj = SimpleNamespace(sampling_params=[{}, {"custom_params": {"thinking_budget": 2}}])
    label_and_check(obj, {"x-kvcmas-workflow": "wf"})
    assert [p["custom_params"]["kvcmas_workflow"] for p in obj.sampling_params] == ["wf", "wf"]
    assert obj.sampling_params[1]["custom_params"]["thinking_budget"] == 2  # untouched
    with pytest.raises(RequestOptionError, match="disagrees with the x-kvcmas-workflow header"):
        label_and_check(SimpleNamespace(sampling_params={"custom_params": {
            "kvcmas_workflow": "a"}}), {"x-kvcmas-workflow": "b"})


def test_router_routing_key_names_the_workflow_when_nothing_else_does():
    obj = SimpleNamespace(sampling_params={})
    label_and_check(obj, {"x-smg-routing-key": "debate-3"})
    assert obj.sampling_params["custom_params"]["kvcmas_workflow"] == "debate-3"
    both = SimpleNamespace(sampling_params={})
    label_and_check(both, {"x-smg-routing-key": "k", "x-kvcmas-workflow": "ours"})
    assert both.sampling_params["custom_params"]["kvcmas_workflow"] == "ours"
    body = SimpleNamespace(sampling_params={"custom_params": {"kvcmas_workflow": "body"}})
    label_and_check(body, {"x-smg-routing-key": "k"})  # the body's name wins, no conflict
    assert body.sampling_params["custom_params"]["kvcmas_workflow"] == "body"
    for bad in ("", "x" * 129, "tab\there"):  # not a valid name: ignored, never a 400
        odd = SimpleNamespace(sampling_params={})
        label_and_check(odd, {"x-smg-routing-key": bad})
        assert odd.sampling_params == {}


def test_bad_fields_are_refused_before_the_scheduler_and_others_pass():
    with pytest.raises(RequestOptionError, match="custom_params.kvcmas_head_len"):
        label_and_check(SimpleNamespace(sampling_params={"custom_params": {
            "kvcmas_head_len": [16]}}), None)
    label_and_check(SimpleNamespace(sampling_params=None), None)  # nothing of ours: nothing
    no_params = SimpleNamespace()
    label_and_check(no_params, {"x-kvcmas-workflow": "w"})  # not a generate request
    assert vars(no_params) == {}


def test_stream_usage_chunk_gains_the_same_fields_as_a_plain_response():
    rec = {"reused_exact": 10, "reused_factored": 0, "reused_repositioned": 5, "recomputed": 3,
           "recomputed_borrowed": 1, "exact_from_leaves": 2, "workflow": "w"}
    usage = {"prompt_tokens": 18, "completion_tokens": 4, "total_tokens": 22}
    chunk = f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
    out = json.loads(with_usage(chunk, {0: rec})[len("data: "):])
    details = out["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == 15 and details["kvcmas_reused_repositioned"] == 5
    assert details["kvcmas_workflow"] == "w" and details["kvcmas_exact_from_leaves"] == 2
    content = 'data: {"choices": [{"delta": {"content": "usage"}}]}\n\n'
    assert with_usage(content, {0: rec}) == content  # not the usage chunk
    assert with_usage("data: [DONE]\n\n", {0: rec}) == "data: [DONE]\n\n"
