"""The head request of an agent's first request (``integration/head_first.py``), with a stand-in
for SGLang's ``generate_request``: sent beside the request, once per head, only where the
request could borrow; the request is marked for the turn-order hook; a client cannot mark its
own."""

from __future__ import annotations

import asyncio

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang_kvcmas.integration import head_first
from sglang_kvcmas.integration.request_hooks import label_and_check
from sglang_kvcmas.policy.recompute import MIN_BORROWED
from sglang_kvcmas.policy.request_options import HEAD_FIRST_FIELD, RequestOptionError

HEAD = 7


@pytest.fixture(autouse=True)
def fresh(monkeypatch, knobs):
    knobs(share_context=True)
    monkeypatch.setattr(head_first, "TOTALS", dict.fromkeys(head_first.TOTALS, 0))
    monkeypatch.setattr(head_first, "_SENT", type(head_first._SENT)())


class FakeManager:
    def __init__(self):
        self.sent: list[GenerateReqInput] = []

    async def original(self, manager, obj, request=None):
        self.sent.append(obj)
        yield {"text": "x", "meta_info": {"prompt_tokens": len(obj.input_ids),
                                          "cached_tokens": 0}}


def request(shared: int, salt: str | None = None, **custom) -> GenerateReqInput:
    ids = list(range(1, HEAD + shared + 1))
    return GenerateReqInput(input_ids=ids, cache_salt=salt, sampling_params={
        "custom_params": {"kvcmas_head_len": HEAD, "kvcmas_shared_end": HEAD + shared,
                          **custom}})


async def send(fake: FakeManager, *objs: GenerateReqInput) -> None:
    for obj in objs:
        head_first.before_request(fake.original, fake, obj, label_and_check(obj, None))
    await asyncio.gather(*head_first._TASKS)


def test_a_first_request_over_a_long_transcript_gets_its_head_prefilled_once():
    fake = FakeManager()
    first, again = request(MIN_BORROWED), request(MIN_BORROWED + 40)
    asyncio.run(send(fake, first, again))
    (head,) = fake.sent
    assert head.input_ids == first.input_ids[:HEAD] and head.rid.startswith(head_first.RID_PREFIX)
    assert head.sampling_params["max_new_tokens"] == 1
    assert head.sampling_params["custom_params"] == {
        "kvcmas_head_len": HEAD, "kvcmas_shared_end": HEAD, "kvcmas_exact": True}
    assert first.sampling_params["custom_params"][HEAD_FIRST_FIELD] is True
    assert HEAD_FIRST_FIELD not in again.sampling_params["custom_params"]  # head sent before
    assert head_first.TOTALS == {"requests": 1, "prompt": HEAD, "prefilled": HEAD, "failed": 0}


def test_no_head_request_where_the_request_could_not_borrow():
    fake = FakeManager()
    short, exact = request(MIN_BORROWED - 1), request(MIN_BORROWED, kvcmas_exact=True)
    untyped = GenerateReqInput(input_ids=list(range(300)), sampling_params={})
    asyncio.run(send(fake, short, exact, untyped))
    assert fake.sent == []


def test_heads_are_remembered_per_namespace():
    fake = FakeManager()
    asyncio.run(send(fake, request(MIN_BORROWED, salt="t1"), request(MIN_BORROWED, salt="t2")))
    assert [h.cache_salt for h in fake.sent] == ["t1", "t2"]


def test_sharing_off_sends_nothing(knobs):
    knobs(share_context=False)
    fake = FakeManager()
    asyncio.run(send(fake, request(MIN_BORROWED)))
    assert fake.sent == []


def test_a_client_cannot_mark_its_own_request():
    with pytest.raises(RequestOptionError, match="set by the server only"):
        label_and_check(request(MIN_BORROWED, kvcmas_head_first=True), None)
