"""The centroid hook in the HTTP process (``integration/lora_rebase.py``), with a stand-in for
SGLang's ``generate_request``: an adapter request waits for the centroid's prefill of its prompt,
identical prompts share one, and what needs none gets none."""

from __future__ import annotations

import asyncio

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput

from sglang_kvcmas.integration import lora_rebase
from sglang_kvcmas.policy.lora_share import CENTROID, CENTROID_RID
from sglang_kvcmas.policy.request_options import RequestOptions


@pytest.fixture(autouse=True)
def rebase_mode(monkeypatch, knobs):
    knobs(lora_share="rebase")
    monkeypatch.setattr(lora_rebase, "TOTALS", dict.fromkeys(lora_rebase.TOTALS, 0))
    monkeypatch.setattr(lora_rebase, "_IN_FLIGHT", {})


class FakeManager:
    """Logs when each request starts and ends; each takes ``delay_s``; ``fail`` raises for the
    centroid."""

    def __init__(self, delay_s: float = 0.02, fail: bool = False):
        self.log: list[tuple[str, str]] = []
        self.delay_s, self.fail = delay_s, fail

    async def original(self, manager, obj, request=None):
        who = obj.lora_path
        self.log.append(("start", who))
        await asyncio.sleep(self.delay_s)
        if self.fail and who == CENTROID:
            raise RuntimeError("boom")
        self.log.append(("end", who))
        yield {"text": "x", "meta_info": {"prompt_tokens": 10, "cached_tokens": 4}}


async def turn(fake: FakeManager, adapter: str | None, text: str = "prompt",
               custom: dict | None = None) -> GenerateReqInput:
    obj = GenerateReqInput(text=text, lora_path=adapter,
                           sampling_params={"custom_params": custom} if custom else {})
    opts = [RequestOptions.parse(custom)]
    async for _ in lora_rebase.around_request(fake.original, fake, obj, opts,
                                              fake.original(None, obj)):
        pass
    return obj


def test_an_adapter_request_starts_after_the_centroid_prefilled_its_prompt():
    fake = FakeManager()
    asyncio.run(turn(fake, "planner", custom={"kvcmas_head_len": 3}))
    assert fake.log == [("start", CENTROID), ("end", CENTROID), ("start", "planner"),
                        ("end", "planner")]
    assert lora_rebase.TOTALS["requests"] == 1 and lora_rebase.TOTALS["prefilled"] == 6


def test_the_centroid_request_keeps_the_prompt_fields_and_namespace():
    obj = GenerateReqInput(input_ids=[1, 2, 3], lora_path="solver", cache_salt="t1",
                           extra_key="k", sampling_params={
                               "max_new_tokens": 99, "custom_params": {"kvcmas_head_len": 2}})
    req = lora_rebase.centroid_request(obj)
    assert req.input_ids == [1, 2, 3] and req.lora_path == CENTROID
    assert req.rid.startswith(CENTROID_RID)
    assert (req.cache_salt, req.extra_key) == ("t1", "k")
    assert req.sampling_params == {"max_new_tokens": 1, "temperature": 0,
                                   "custom_params": {"kvcmas_head_len": 2}}


def test_identical_prompts_in_flight_share_one_centroid_prefill():
    fake = FakeManager()

    async def run():
        await asyncio.gather(turn(fake, "planner"), turn(fake, "solver"), turn(fake, "critic"),
                             turn(fake, "critic", text="another prompt"))

    asyncio.run(run())
    assert sum(1 for e in fake.log if e == ("start", CENTROID)) == 2
    assert lora_rebase.TOTALS["coalesced"] == 2


def test_no_centroid_for_the_base_model_exact_requests_or_other_modes(knobs):
    fake = FakeManager()
    asyncio.run(turn(fake, None))
    asyncio.run(turn(fake, "planner", custom={"kvcmas_exact": True}))
    asyncio.run(turn(fake, CENTROID))
    knobs(lora_share="borrow")
    asyncio.run(turn(fake, "planner"))
    assert [w for e, w in fake.log if e == "start"] == [None, "planner", CENTROID, "planner"]


def test_a_failed_centroid_prefill_is_counted_and_the_request_goes_on():
    fake = FakeManager(fail=True)
    asyncio.run(turn(fake, "planner"))
    assert ("end", "planner") in fake.log
    assert lora_rebase.TOTALS["failed"] == 1
