"""The frontend endpoint that names a workflow: what it sends, without a server."""

from __future__ import annotations

import json
import types

import pytest

from sglang_kvcmas import frontend


class Sent:
    """Stands in for SGLang's ``http_request``: records the JSON bodies."""

    def __init__(self):
        self.bodies = []

    def __call__(self, url, json=None, stream=False, **kwargs):
        self.bodies.append((url, json))
        return Reply(stream)


class Reply:
    status_code = 200

    def __init__(self, stream):
        self.stream = stream

    def json(self):
        return {"model_path": "/m", "text": "x", "meta_info": {"prompt_tokens": 3}}

    def iter_lines(self, decode_unicode=False):
        yield b'data: ' + json.dumps({"text": "hi", "meta_info": {}}).encode()
        yield b"data: [DONE]"


@pytest.fixture
def sent(monkeypatch):
    from sglang.lang.backend import runtime_endpoint

    rec = Sent()
    monkeypatch.setattr(runtime_endpoint, "http_request", rec)
    return rec


def test_every_request_names_the_workflow(sent):
    import sglang as sgl

    @sgl.function
    def program(s):
        s += "Q: 1+1? A:"
        s += sgl.gen("a", max_tokens=4)

    backend = frontend.KvcmasEndpoint("http://h", chat_template_name="chatml",
                                      workflow="run-1",
                                      custom={"kvcmas_budget_tokens": 900})
    first = program.run(backend=backend)
    assert first.error() is None, first.error()
    program.run(backend=backend, stream=True).text()
    other = backend.for_workflow("run-2")
    third = program.run(backend=other)
    assert third.error() is None, third.error()
    gens = [body for url, body in sent.bodies if url.endswith("/generate")]
    assert len(gens) == 3
    assert [b["sampling_params"]["custom_params"] for b in gens] == [
        {"kvcmas_budget_tokens": 900, "kvcmas_workflow": "run-1"}] * 2 + [
        {"kvcmas_budget_tokens": 900, "kvcmas_workflow": "run-2"}]
    assert gens[0]["sampling_params"]["max_new_tokens"] == 4  # SGLang's own fields intact
    assert backend.workflow == "run-1" and other.workflow == "run-2"
    data = {"text": "t", "sampling_params": {"max_new_tokens": 0}}  # select's scoring body
    backend._generate_http_request(types.SimpleNamespace(images_=[]), data)
    assert data["sampling_params"]["custom_params"]["kvcmas_workflow"] == "run-1"


def test_a_plain_endpoint_and_bad_arguments(sent):
    plain = frontend.KvcmasEndpoint("http://h", chat_template_name="chatml")
    assert plain.workflow is None and plain.custom_params == {}
    for bad in ({"workflow": ""}, {"workflow": 7}, {"custom": {"temperature": 0}}):
        with pytest.raises(ValueError):
            frontend.KvcmasEndpoint("http://h", chat_template_name="chatml", **bad)
    with pytest.raises(ValueError):
        plain.for_workflow("")
