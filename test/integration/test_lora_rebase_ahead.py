"""``--kvcmas-lora-centroid-ahead``: the centroid prefills an adapter request's prompt plus its
answer so far while the answer streams (``integration/lora_rebase.py``), with a stand-in for
SGLang's ``generate_request``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput

from sglang_kvcmas.integration import lora_rebase, metrics
from sglang_kvcmas.policy.lora_share import CENTROID
from sglang_kvcmas.policy.request_options import RequestOptions

PROMPT = list(range(100, 140))
HEAD = 4
"""The prompts' explicit head (``kvcmas_head_len``), as the chat route sets it."""


@pytest.fixture(autouse=True)
def rebase_mode(monkeypatch, knobs):
    knobs(lora_share="rebase", lora_centroid_ahead=32, lora_centroid_handoff="response")
    monkeypatch.setattr(lora_rebase, "TOTALS", dict.fromkeys(lora_rebase.TOTALS, 0))
    monkeypatch.setattr(lora_rebase, "_IN_FLIGHT", {})
    monkeypatch.setattr(lora_rebase, "_AHEAD", {})


class StreamingManager:
    """An adapter request answers ``answer_len`` tokens, one output per token (cumulative ids,
    as SGLang's default non-incremental stream), every ``step_s``; a centroid prefill takes
    ``centroid_s``. Logs each centroid prefill's prompt ids and shared end, and when each
    request starts and ends."""

    def __init__(self, answer_len: int = 70, step_s: float = 0.001, centroid_s: float = 0.005,
                 abort: bool = False, incremental: bool = False):
        self.answer_len, self.step_s, self.centroid_s = answer_len, step_s, centroid_s
        self.abort, self.incremental = abort, incremental
        self.server_args = SimpleNamespace(incremental_streaming_output=incremental)
        self.centroid: list[tuple[list[int], int | None]] = []
        self.log: list[tuple[str, str, int]] = []

    async def original(self, manager, obj, request=None):
        n = len(obj.input_ids) if obj.input_ids is not None else 0
        if obj.lora_path == CENTROID:
            custom = obj.sampling_params.get("custom_params") or {}
            assert custom.get("kvcmas_head_len") in (None, HEAD)
            self.centroid.append((list(obj.input_ids or []), custom.get("kvcmas_shared_end")))
            self.log.append(("start", CENTROID, n))
            await asyncio.sleep(self.centroid_s)
            self.log.append(("end", CENTROID, n))
            yield {"meta_info": {"prompt_tokens": n, "cached_tokens": 0,
                                 "finish_reason": {"type": "length"}}}
            return
        self.log.append(("start", obj.lora_path, n))
        answer = []
        for i in range(self.answer_len):
            await asyncio.sleep(self.step_s)
            answer.append(900 + i)
            last = i == self.answer_len - 1
            reason = ({"type": "abort"} if self.abort else {"type": "stop"}) if last else None
            if obj.stream and self.incremental:
                yield {"output_ids": [answer[-1]], "meta_info": {"finish_reason": reason}}
            elif obj.stream or last:
                yield {"output_ids": answer, "meta_info": {"finish_reason": reason}}
        self.log.append(("end", obj.lora_path, n))


async def turn(fake: StreamingManager, adapter: str, ids: list[int] = PROMPT,
               stream: bool = True, text: str | None = None, head: bool = True) -> None:
    custom = {"kvcmas_head_len": HEAD} if head else {}
    obj = GenerateReqInput(input_ids=None if text else list(ids), text=text, lora_path=adapter,
                           stream=stream, sampling_params={"custom_params": custom})
    async for _ in lora_rebase.around_request(fake.original, fake, obj,
                                              [RequestOptions.parse(custom)],
                                              fake.original(None, obj)):
        pass
    await asyncio.sleep(fake.centroid_s + 0.05)  # let the last ahead prefill run


def _aheads(fake: StreamingManager) -> list[int]:
    """Answer tokens of each ahead prefill, in order (the first centroid prefill is the
    prompt's own)."""
    assert fake.centroid[0] == (PROMPT, None)
    out = []
    for ids, end in fake.centroid[1:]:
        assert ids[: len(PROMPT)] == PROMPT and end == len(ids)  # the answer is shared context
        out.append(len(ids) - len(PROMPT))
    return out


def test_a_streamed_answer_is_prefilled_every_n_tokens_and_nothing_at_its_end():
    counter = metrics.counter("kvcmas:lora_centroid_ahead_requests", "", [])
    before = counter._value.get()
    fake = StreamingManager(answer_len=70, step_s=0.003, centroid_s=0.002)
    asyncio.run(turn(fake, "planner"))
    assert _aheads(fake) == [32, 64]
    assert fake.centroid[-1][0][len(PROMPT):] == list(range(900, 964))
    assert lora_rebase.TOTALS["ahead"] == 2 and lora_rebase.TOTALS["requests"] == 3
    assert counter._value.get() == before + 2  # visible in /metrics
    fake = StreamingManager(answer_len=70, step_s=0.003, centroid_s=0.002, incremental=True)
    asyncio.run(turn(fake, "planner"))  # each output carries the new tokens only
    assert _aheads(fake) == [32, 64]
    assert fake.centroid[-1][0][len(PROMPT):] == list(range(900, 964))
    fake = StreamingManager(answer_len=40, step_s=0.003, centroid_s=0.001, abort=True)
    asyncio.run(turn(fake, "planner"))
    assert _aheads(fake) == [32]


def test_an_ahead_prefill_in_flight_is_not_doubled():
    """While one ahead prefill runs, the answer's next crossings send none."""
    fake = StreamingManager(answer_len=70, step_s=0.001, centroid_s=0.5)
    asyncio.run(turn(fake, "planner"))
    assert _aheads(fake) == [32]


def test_a_turn_that_does_not_stream_prefills_nothing_ahead():
    fake = StreamingManager(answer_len=40)
    asyncio.run(turn(fake, "planner", stream=False))
    assert fake.centroid == [(PROMPT, None)]


def test_off_text_prompts_no_head_and_later_speakers_prefill_nothing_ahead(knobs):
    fake = StreamingManager(answer_len=40)

    async def together():
        await asyncio.gather(turn(fake, "planner"), turn(fake, "solver"), turn(fake, "critic"))

    asyncio.run(together())  # one centroid prefill of the prompt, the first speaker's aheads
    assert _aheads(fake) == [32]
    fake = StreamingManager(answer_len=40)
    asyncio.run(turn(fake, "planner", text="a text prompt"))
    assert len(fake.centroid) == 1
    fake = StreamingManager(answer_len=40)
    asyncio.run(turn(fake, "planner", head=False))  # no explicit head: nothing ahead
    assert fake.centroid == [(PROMPT, None)]
    knobs(lora_centroid_ahead=0)
    fake = StreamingManager(answer_len=40)
    asyncio.run(turn(fake, "planner"))
    assert fake.centroid == [(PROMPT, None)]


def test_the_next_turns_centroid_prefill_waits_for_the_answers_ahead_prefill():
    """A prompt that extends an answered prompt starts its centroid prefill only once the
    ahead prefill of that answer in flight is done (else both would compute the answer)."""
    fake = StreamingManager(answer_len=40, step_s=0.001, centroid_s=0.3)
    nxt = PROMPT + list(range(900, 940)) + [7, 8]

    async def chain():  # the answer ends while its ahead prefill runs; the next turn comes
        custom = {"kvcmas_head_len": HEAD}
        obj = GenerateReqInput(input_ids=list(PROMPT), lora_path="planner", stream=True,
                               sampling_params={"custom_params": custom})
        async for _ in lora_rebase.around_request(fake.original, None, obj,
                                                  [RequestOptions.parse(custom)],
                                                  fake.original(None, obj)):
            pass
        await turn(fake, "solver", ids=nxt)

    asyncio.run(chain())
    events = [(e, n) for e, who, n in fake.log if who == CENTROID]
    assert events.index(("end", len(PROMPT) + 32)) < events.index(("start", len(nxt)))
