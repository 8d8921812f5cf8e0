"""The catch-up hook in the HTTP process (``integration/lora_catchup.py``), with a stand-in for
SGLang's ``generate_request``: which background requests it sends, and what it counts."""

from __future__ import annotations

import asyncio

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput

from sglang_kvcmas.integration import lora_catchup
from sglang_kvcmas.policy.lora_catchup import CatchupPlanner
from sglang_kvcmas.policy.request_options import RequestOptions


@pytest.fixture(autouse=True)
def catchup_mode(monkeypatch, knobs):
    knobs(lora_share="catchup")
    monkeypatch.setattr(lora_catchup, "PLANNER", CatchupPlanner())
    monkeypatch.setattr(lora_catchup, "GRACE_S", 0.01)
    monkeypatch.setattr(lora_catchup, "TOTALS", dict.fromkeys(lora_catchup.TOTALS, 0))


class FakeManager:
    """Records every request ``original`` serves; each answers after ``delay_s``."""

    def __init__(self, delay_s: float = 0.0):
        self.served: list[GenerateReqInput] = []
        self.delay_s = delay_s

    async def original(self, manager, obj, request=None):
        self.served.append(obj)
        await asyncio.sleep(self.delay_s)
        yield {"text": "x", "meta_info": {"prompt_tokens": 10, "cached_tokens": 4}}


def options(workflow: str | None) -> list[RequestOptions]:
    return [RequestOptions.parse({"kvcmas_workflow": workflow} if workflow else None)]


async def turn(fake: FakeManager, adapter: str, workflow: str | None = "w") -> None:
    obj = GenerateReqInput(text="prompt", lora_path=adapter)
    out = lora_catchup.around_request(fake.original, None, obj, options(workflow),
                                      fake.original(None, obj))
    async for _ in out:
        pass


def test_a_turn_catches_up_the_workflows_other_adapters():
    async def run() -> FakeManager:
        fake = FakeManager()
        await turn(fake, "planner")
        await turn(fake, "solver")
        await asyncio.sleep(0.1)  # the background catch-ups
        return fake

    fake = asyncio.run(run())
    served = [(o.lora_path, bool(o.rid) and o.rid.startswith(lora_catchup.RID_PREFIX))
              for o in fake.served]
    assert served == [("planner", False), ("solver", False), ("planner", True)]
    catchup = fake.served[-1]
    assert catchup.text == "prompt" and catchup.sampling_params["max_new_tokens"] == 1
    assert lora_catchup.TOTALS["requests"] == 1 and lora_catchup.TOTALS["prefilled"] == 6


def test_no_catchup_without_a_workflow_or_an_adapter_or_in_another_mode(knobs):
    async def run() -> FakeManager:
        fake = FakeManager()
        await turn(fake, "planner", workflow=None)
        await turn(fake, "solver", workflow=None)
        await asyncio.sleep(0.05)
        return fake

    assert len(asyncio.run(run()).served) == 2
    knobs(lora_share="borrow")
    assert len(asyncio.run(run()).served) == 2


def test_an_adapter_answering_in_the_same_step_is_not_caught_up():
    async def run() -> FakeManager:
        fake = FakeManager(delay_s=0.05)  # both requests in flight past the grace period
        await turn(fake, "planner")
        await asyncio.gather(turn(fake, "planner"), turn(fake, "solver"))
        await asyncio.sleep(0.1)
        return fake

    fake = asyncio.run(run())
    assert not any(o.rid and o.rid.startswith(lora_catchup.RID_PREFIX) for o in fake.served)
    assert lora_catchup.TOTALS["skipped"] >= 1


def test_a_streamed_turn_starts_its_catchups_after_its_first_chunk():
    async def run() -> list[str]:
        fake = FakeManager()
        await turn(fake, "planner")
        obj = GenerateReqInput(text="prompt", lora_path="solver", stream=True)
        seen = []

        async def two_chunks(manager, o, request=None):
            for i in range(2):
                seen.append(f"chunk{i}:{len(fake.served)}")
                yield {"text": "x", "meta_info": {}}
                await asyncio.sleep(0.05)

        async for _ in lora_catchup.around_request(fake.original, None, obj, options("w"),
                                                   two_chunks(None, obj)):
            pass
        await asyncio.sleep(0.05)
        return seen + [f"end:{len(fake.served)}"]

    # planner's own turn served; none before the solver's first chunk, one (grace 10 ms) after
    assert asyncio.run(run()) == ["chunk0:1", "chunk1:2", "end:2"]
