"""End to end with another chat template: a sharing server started with ``--chat-template`` a
Llama-3 style Jinja file; two agents through ``/v1/chat/completions`` (the chat route names
their heads from their system messages) and through ``/generate`` with the rendered text (the
scheduler finds their heads by the template's markers): the second agent reads the first's
transcript."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from chat_templates import LLAMA3  # noqa: E402
from test_shared_server import SA, SB, T1, T2  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.server]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sglang_kvcmas_bench.server_arms import ArmServer

    folder = tmp_path_factory.mktemp("kvcmas_llama3")
    template = folder / "llama3.jinja"
    template.write_text(LLAMA3)
    with ArmServer("kvcmas", folder / "server.log", ["--chat-template", str(template)]) as s:
        yield s, folder / "server.log"


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def chat(server, system, user, salt):
    return post(server.url + "/v1/chat/completions", {
        "model": "default", "temperature": 0, "max_tokens": 4, "cache_salt": salt,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    })["usage"]["prompt_tokens_details"]


def generate(server, system, user, salt):
    text = LLAMA3_TEXT.format(bos="<|im_start|>", system=system, user=user)
    out = post(server.url + "/generate", {"text": text, "cache_salt": salt, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}})
    return out["meta_info"]["kvcmas_reuse"][0]


LLAMA3_TEXT = ("{bos}<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama3_template_agents_share_through_chat_and_generate(server):
    server, log = server
    for system in (SA, SB):  # both heads cached, T1 held exactly by each
        chat(server, system, T1, "chat")
    chat(server, SA, T2, "chat")
    reader = chat(server, SB, T2, "chat")
    assert reader["kvcmas_reused_repositioned"] > 40, reader
    for system in (SA, SB):  # raw text: another namespace, found by the template's markers
        generate(server, system, T1, "raw")
    generate(server, SA, T2, "raw")
    raw_reader = generate(server, SB, T2, "raw")
    assert raw_reader["reused_repositioned"] > 40, raw_reader
    assert "agent detection from chat template 'llama3.jinja'" in log.read_text()
