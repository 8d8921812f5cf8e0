"""The fidelity monitor in the HTTP process (``integration/fidelity_monitor.py``), with a stand-in
for SGLang's ``generate_request``: what the client sees is never changed; sampled reader turns
get an exact prefill of their prompt and first generated tokens in a namespace of their own,
after the response; scores, costs and turns add up; the loop's level is stamped on requests and
stops sampling at exact serving; a client cannot stamp its own level."""

from __future__ import annotations

import asyncio
import copy
import json
import math
from types import SimpleNamespace

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang_kvcmas.integration import fidelity_monitor
from sglang_kvcmas.integration.fidelity_monitor import LOGPROB_KEYS, RID_PREFIX
from sglang_kvcmas.integration.request_hooks import label_and_check
from sglang_kvcmas.policy import fidelity
from sglang_kvcmas.policy.fidelity import EXACT_LEVEL, FORCED_TOKENS, HEALTHY_SAMPLES, MIN_SAMPLES
from sglang_kvcmas.policy.recompute import MIN_BORROWED
from sglang_kvcmas.policy.request_options import (
    FIDELITY_LEVEL_FIELD,
    RequestOptionError,
    RequestOptions,
)

HEAD = 7
GEN = [1000 + j for j in range(FORCED_TOKENS + 4)]
"""The tokens every served request generates."""
BAD = fidelity.TurnScore(positions=10, agreed=8, diverged_at=3, kl=0.2)


def reader_dist(j: int) -> dict[int, float]:
    """The reader's top tokens at generated position ``j`` (the generated one most likely)."""
    return {GEN[j]: math.log(0.8), 2000 + j: math.log(0.15), 3000 + j: math.log(0.05)}


@pytest.fixture(autouse=True)
def fresh(monkeypatch, knobs):
    knobs(share_context=True, fidelity_share=1.0)
    monkeypatch.setattr(fidelity_monitor, "TOTALS", fidelity_monitor.Totals())
    monkeypatch.setattr(fidelity_monitor, "LOOP", fidelity.FidelityLoop())
    monkeypatch.setattr(fidelity_monitor, "_QUEUE", [])
    monkeypatch.setattr(fidelity_monitor, "_TASKS", set())


class FakeSGLang:
    """SGLang's ``generate_request`` as the monitor sees it. A served request generates ``GEN``
    in ``chunks`` outputs (the last one finished), its reuse record saying ``reused`` borrowed
    tokens, and log-probabilities when asked; an exact check (rid ``RID_PREFIX...``) answers
    with the prompt logprobs of the forced positions in SGLang's convention (entry 0, the start
    position, is None), from ``exact_dist`` (default: the reader's, so both agree)."""

    def __init__(self, reused=200, chunks=1, incremental=False, exact_dist=None,
                 exact_cached=0, fail=False, record=True):
        self.reused, self.chunks, self.record = reused, chunks, record
        self.exact_dist, self.exact_cached, self.fail = exact_dist or reader_dist, exact_cached, fail
        self.manager = SimpleNamespace(incremental_streaming_output=incremental)
        self.sent: list = []

    @property
    def checks(self) -> list:
        return [r for r in self.sent if str(r.rid).startswith(RID_PREFIX)]

    async def original(self, manager, obj, request=None):
        self.sent.append(obj)
        outs = self.exact(obj) if str(obj.rid).startswith(RID_PREFIX) else self.served(obj)
        for out in outs:
            yield out

    def served(self, obj) -> list[dict]:
        incremental = obj.stream and self.manager.incremental_streaming_output
        bounds = [len(GEN) * (c + 1) // self.chunks for c in range(self.chunks)]
        outs, begin = [], 0
        for end in bounds:
            first = begin if incremental else 0
            last = end == len(GEN)
            meta = {"id": "r", "prompt_tokens": len(obj.input_ids or ()), "cached_tokens": 100,
                    "completion_tokens": end,
                    "finish_reason": {"type": "length", "length": len(GEN)} if last else None}
            if last and self.record:
                meta["kvcmas_reuse"] = [{"reused_exact": 100, "reused_factored": self.reused,
                                         "reused_repositioned": 0, "recomputed": 3}]
            if obj.return_logprob:
                meta["input_token_logprobs"] = []
                meta["output_token_logprobs"] = [(reader_dist(j)[GEN[j]], GEN[j], None)
                                                 for j in range(first, end)]
                meta["output_token_logprobs_length"] = end - first
                meta["output_top_logprobs"] = [
                    sorted(((lp, t, None) for t, lp in reader_dist(j).items()), reverse=True)
                    [:obj.top_logprobs_num] for j in range(first, end)]
            outs.append({"text": " ".join(map(str, GEN[first:end])),
                         "output_ids": GEN[first:end], "meta_info": meta})
            begin = end
        return outs

    def exact(self, obj) -> list[dict]:
        if self.fail:
            raise RuntimeError("the exact prefill failed")
        start = obj.logprob_start_len
        forced = obj.input_ids[start + 1:]
        tops, on_reader = [None], [None]
        for j in range(len(forced)):
            dist = self.exact_dist(j)
            best = max(dist, key=dist.__getitem__)
            tops.append([(dist[best], best, None)])
            on_reader.append([(dist.get(t, math.log(1e-6)), t, None)
                              for t in obj.token_ids_logprob])
        return [{"text": "", "meta_info": {
            "prompt_tokens": len(obj.input_ids), "cached_tokens": self.exact_cached,
            "completion_tokens": 1, "finish_reason": {"type": "length", "length": 1},
            "input_token_logprobs": [None] + [(0.0, t, None) for t in forced],
            "input_top_logprobs": tops, "input_token_ids_logprobs": on_reader}}]


def request(shared: int = MIN_BORROWED, salt: str | None = "t1", stream: bool = False,
            head: int | None = HEAD, **sampling) -> GenerateReqInput:
    n = (head or 0) + shared
    custom = {} if head is None else {"kvcmas_head_len": head, "kvcmas_shared_end": n}
    params = {"temperature": 0, "max_new_tokens": len(GEN), **sampling}
    if custom:
        params.setdefault("custom_params", custom)
    return GenerateReqInput(input_ids=list(range(1, n + 6)), cache_salt=salt, stream=stream,
                            sampling_params=params)


async def turn(fake: FakeSGLang, obj, close_after: int | None = None):
    """One request through the monitor as ``request_hooks.generate_around`` wires it: the
    ticket and the outputs the client sees (``close_after``: the client leaves after that
    many)."""
    ticket = fidelity_monitor.before_request(obj, label_and_check(obj, None))
    outputs = fidelity_monitor.watching(fake.original(fake.manager, obj, None), ticket,
                                        fake.original, fake.manager)
    seen = []
    async for out in outputs:
        seen.append(out)
        if close_after is not None and len(seen) == close_after:
            await outputs.aclose()
            break
    return ticket, seen


async def drain() -> None:
    """Wait for the monitor's exact prefills."""
    while fidelity_monitor._TASKS:
        await asyncio.gather(*list(fidelity_monitor._TASKS))


async def turns(fake: FakeSGLang, objs) -> list:
    out = []
    for obj in objs:
        out.append(await turn(fake, obj))
        await drain()
    return out


def run(coro):
    return asyncio.run(coro)


async def burst(fakes: list[FakeSGLang]) -> None:
    """One request per stand-in, all sent (and marked: output log-probabilities on) before any
    finishes, then each finished through its stand-in before the worker runs."""
    objs = [request() for _ in fakes]
    tickets = [fidelity_monitor.before_request(o, label_and_check(o, None)) for o in objs]
    assert all(t.sampled for t in tickets)
    for fake, obj, ticket in zip(fakes, objs, tickets):
        async for _ in fidelity_monitor.watching(fake.original(fake.manager, obj), ticket,
                                                 fake.original, fake.manager):
            pass
    await drain()


# ----- the response -----

@pytest.mark.parametrize("stream,chunks,incremental",
                         [(False, 1, False), (True, 3, False), (True, 4, True)])
def test_a_sampled_response_is_the_one_the_client_would_get(stream, chunks, incremental):
    """The outputs of a sampled turn equal the same stand-in's for the request unsampled: no
    log-probabilities the client did not ask for, text and everything else as they were; the
    exact check teacher-forces the first generated tokens whether SGLang streams the
    log-probabilities so far or each chunk's own."""
    fake = FakeSGLang(chunks=chunks, incremental=incremental)
    obj = request(stream=stream)
    plain = copy.deepcopy(obj)
    (ticket, seen), = run(turns(fake, [obj]))
    assert ticket.sampled and fake.sent[0] is obj
    assert obj.return_logprob is True and obj.top_logprobs_num == fidelity.TOP_LOGPROBS
    assert seen == fake.served(plain)  # unsampled: no logprobs at all
    assert len(seen) == chunks and seen[-1]["meta_info"]["finish_reason"] is not None
    assert not any(k in out["meta_info"] for out in seen for k in LOGPROB_KEYS)
    (check,) = fake.checks
    assert check.input_ids == plain.input_ids + GEN[:FORCED_TOKENS]
    assert fidelity_monitor.TOTALS.scores.turns == 1


def test_a_client_that_asks_for_logprobs_is_not_sampled_and_keeps_them():
    fake = FakeSGLang()
    asks = request()
    asks.return_logprob, asks.top_logprobs_num = True, 3
    ids_only = request()
    ids_only.token_ids_logprob = [5, 6]
    (ticket, seen), _ = run(turns(fake, [asks, ids_only]))
    assert ticket is not None and not ticket.sampled
    meta = seen[-1]["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == GEN
    assert len(meta["output_top_logprobs"][0]) == 3
    assert fake.checks == [] and fidelity_monitor.TOTALS.sampled == 0
    assert fidelity_monitor.TOTALS.pending == 0 and fidelity_monitor.TOTALS.reader_turns == 2


def test_requests_that_could_not_borrow_are_not_sampled(knobs):
    fake = FakeSGLang()
    short = request(MIN_BORROWED - 1)  # too little shared transcript to borrow
    several = request(n=2)
    exact = request(custom_params={"kvcmas_head_len": HEAD, "kvcmas_exact": True})
    text = GenerateReqInput(text="hello", sampling_params={"temperature": 0})
    batch = GenerateReqInput(input_ids=[[1, 2], [3, 4]], sampling_params=[{}, {}])
    tickets = [t for t, _ in run(turns(fake, [short, several, exact, text]))]
    assert [t is not None and t.sampled for t in tickets] == [False] * 4
    assert tickets[2] is None  # an exact request: not followed at all
    assert fidelity_monitor.before_request(batch, label_and_check(batch, None)) is None
    knobs(share_context=False)
    off = request()
    assert fidelity_monitor.before_request(off, label_and_check(off, None)) is None
    knobs(share_context=True, fidelity_share=0.0)
    assert fidelity_monitor.before_request(off, label_and_check(off, None)) is None
    assert off.return_logprob is None and fake.checks == []
    assert fidelity_monitor.TOTALS.pending == 0


# ----- the exact side -----

def test_the_exact_check_is_in_a_namespace_of_its_own_and_forces_the_first_tokens():
    fake = FakeSGLang()
    readers = [request(), request()]
    readers[1].extra_key, readers[1].lora_path = "ek", "adapter-a"
    prompts = [list(r.input_ids) for r in readers]
    run(turns(fake, readers))
    checks = fake.checks
    assert len(checks) == 2 and len(fake.sent) == 4  # each reader, then its check
    salts = {c.cache_salt for c in checks}
    assert len(salts) == 2 and "t1" not in salts and all(s.startswith(RID_PREFIX) for s in salts)
    assert len({c.rid for c in checks}) == 2
    top_ids = sorted({t for j in range(FORCED_TOKENS) for t in reader_dist(j)})
    for check, prompt in zip(checks, prompts):
        assert check.input_ids == prompt + GEN[:FORCED_TOKENS]
        assert check.logprob_start_len == len(prompt) - 1
        assert check.return_logprob is True and check.top_logprobs_num == 1
        assert check.token_ids_logprob == top_ids  # every reader top token, at every position
        params = check.sampling_params
        assert params["custom_params"] == {"kvcmas_exact": True}
        assert (params["max_new_tokens"], params["temperature"]) == (1, 0)
        assert RequestOptions.parse(params["custom_params"]).exact
    assert (checks[0].extra_key, checks[0].lora_path) == (None, None)
    assert (checks[1].extra_key, checks[1].lora_path) == ("ek", "adapter-a")


def test_a_short_answer_forces_only_the_tokens_it_has():
    ticket = fidelity_monitor.Ticket(("s", None, None), None, 0, None, sampled=True,
                                     prompt=[1, 2, 3], greedy=True)
    req = fidelity_monitor.exact_request(ticket, [7, 8], [{7: -0.1, 9: -2.0}, {8: -0.2}])
    assert req.input_ids == [1, 2, 3, 7, 8] and req.logprob_start_len == 2
    assert req.token_ids_logprob == [7, 8, 9]
    fake = FakeSGLang()
    score = run(fidelity_monitor.exact_check(fake.original, fake.manager, ticket, [7, 8],
                                             [{7: -0.1, 9: -2.0}, {8: -0.2}]))
    assert score.positions == 2  # the stand-in's top-1 is GEN[j]: neither agrees
    assert (score.agreed, score.diverged_at) == (0, 0)


# ----- accounting -----

def test_scores_and_costs_add_up_over_several_samples():
    fake = FakeSGLang(exact_cached=3)
    readers = [request(MIN_BORROWED + 10 * i) for i in range(3)]
    lengths = [len(r.input_ids) for r in readers]
    run(turns(fake, readers))
    totals = fidelity_monitor.TOTALS
    tally = totals.scores.to_json()
    assert tally["turns"] == 3 and tally["top1_agreement"] == 1.0 and tally["diverged"] == 0
    assert tally["kl"] == pytest.approx(0.0, abs=1e-9)
    assert totals.prompt_tokens == sum(n + FORCED_TOKENS for n in lengths)
    assert totals.prefilled_tokens == totals.prompt_tokens - 3 * 3
    assert (totals.sampled, totals.reader_turns, totals.pending, totals.failed) == (3, 3, 0, 0)
    assert [r["level"] for r in totals.recent] == [0, 0, 0]
    assert all(r["positions"] == FORCED_TOKENS and r["agreed"] == FORCED_TOKENS
               for r in totals.recent)


def test_a_sampled_turn_that_decodes_at_temperature_has_no_kl():
    fake = FakeSGLang()
    run(turns(fake, [request(temperature=0.7)]))
    assert fidelity_monitor.TOTALS.scores.to_json()["kl"] is None
    assert fidelity_monitor.TOTALS.scores.to_json()["top1_agreement"] == 1.0
    run(turns(fake, [request(temperature=0.7, top_k=1)]))  # greedy all the same
    assert fidelity_monitor.TOTALS.scores.kl_turns == 1


def test_reader_turns_count_finished_turns_that_borrowed_and_pending_returns_to_zero():
    totals = fidelity_monitor.TOTALS

    async def scenario():
        obj = request()
        ticket = fidelity_monitor.before_request(obj, label_and_check(obj, None))
        assert ticket.sampled and totals.pending == 1  # counted while it runs
        fake = FakeSGLang()
        async for _ in fidelity_monitor.watching(fake.original(fake.manager, obj), ticket,
                                                 fake.original, fake.manager):
            pass
        assert totals.pending == 0 and totals.sampled == 1
        await drain()
        nothing = FakeSGLang(reused=0)  # sampled, borrowed nothing: not a sample
        (t, _), = await turns(nothing, [request()])
        assert t.sampled and nothing.checks == []
        unrecorded = FakeSGLang(record=False)  # no reuse record: not a reader turn
        await turns(unrecorded, [request()])
        left = FakeSGLang(chunks=3)  # the client leaves before the turn finishes
        t, seen = await turn(left, request(stream=True), close_after=1)
        assert t.sampled and len(seen) == 1 and totals.pending == 0
        await drain()
        assert left.checks == [] and unrecorded.checks == []

    run(scenario())
    assert (totals.reader_turns, totals.sampled, totals.pending) == (1, 1, 0)
    assert totals.scores.turns == 1


def test_about_the_share_of_reader_turns_is_sampled(knobs):
    knobs(fidelity_share=0.25)
    fake = FakeSGLang()
    tickets = [t for t, _ in run(turns(fake, [request() for _ in range(40)]))]
    sampled = sum(t.sampled for t in tickets)
    assert 9 <= sampled <= 11
    assert len(fake.checks) == sampled == fidelity_monitor.TOTALS.sampled
    assert fidelity_monitor.TOTALS.reader_turns == 40


def test_a_busy_monitor_drops_samples_rather_than_queueing_them():
    """Turns that finish while ``MAX_QUEUED`` exact prefills wait are dropped (counted)."""
    n = fidelity_monitor.MAX_QUEUED + 2
    fake = FakeSGLang()
    run(burst([fake] * n))
    totals = fidelity_monitor.TOTALS
    assert (totals.sampled, totals.dropped, totals.pending) == (fidelity_monitor.MAX_QUEUED, 2, 0)
    assert len(fake.checks) == totals.scores.turns == fidelity_monitor.MAX_QUEUED


# ----- the loop -----

def test_disagreeing_turns_raise_the_level_of_their_namespace_and_agent():
    """The exact side's top token differs at position 5 of every turn: after MIN_SAMPLES
    sampled turns the namespace and the agent rise, and the next request is stamped."""
    def moved(j):
        if j != 5:
            return reader_dist(j)
        return {GEN[j]: math.log(0.05), 2000 + j: math.log(0.9), 3000 + j: math.log(0.05)}

    fake = FakeSGLang(exact_dist=moved)
    run(turns(fake, [request() for _ in range(MIN_SAMPLES)]))
    totals = fidelity_monitor.TOTALS
    assert totals.recent[0]["diverged_at"] == 5 and totals.recent[0]["kl"] > 0
    assert totals.recent[0]["agreed"] == FORCED_TOKENS - 1
    assert totals.scores.to_json()["diverged"] == MIN_SAMPLES
    ticket, _ = run(turns(fake, [request()]))[0]
    assert ticket.level == 1 and totals.recent[-1]["level"] == 1
    assert fake.sent[-2].sampling_params["custom_params"][FIDELITY_LEVEL_FIELD] == 1
    assert fidelity_monitor.LOOP.level(("t1", None, None)) == 1
    assert {s["key"] for s in fidelity_monitor.snapshot()["steps"]} == {
        repr(("t1", None, None)), repr((("t1", None, None), ticket.agent))}


def test_a_raised_level_is_stamped_and_the_exact_level_is_sampled_too():
    loop = fidelity_monitor.LOOP
    for _ in range(MIN_SAMPLES):
        loop.add(("t1", None, None), None, BAD)
    fake = FakeSGLang()
    raised, other, plain = request(), request(salt="t2"), request(head=None)
    plain.sampling_params.pop("custom_params", None)
    (t1, _), (t2, _), (t3, _) = run(turns(fake, [raised, other, plain]))
    assert raised.sampling_params["custom_params"][FIDELITY_LEVEL_FIELD] == 1
    assert RequestOptions.parse(raised.sampling_params["custom_params"]).fidelity_level == 1
    assert FIDELITY_LEVEL_FIELD not in other.sampling_params["custom_params"]
    assert plain.sampling_params["custom_params"] == {FIDELITY_LEVEL_FIELD: 1}
    assert (t1.level, t2.level, t3.level) == (1, 0, 1) and t1.sampled and t3.sampled
    assert all(FIDELITY_LEVEL_FIELD not in c.sampling_params["custom_params"]
               for c in fake.checks)  # the exact side is exact, whatever the level
    for _ in range(2 * MIN_SAMPLES):
        loop.add(("t1", None, None), None, BAD)
    assert loop.level(("t1", None, None)) == EXACT_LEVEL
    fake = FakeSGLang()
    exact_turns = run(turns(fake, [request() for _ in range(HEALTHY_SAMPLES)]))
    # served exactly, the turns stand for their readers: sampled, the level measured
    assert exact_turns[0][0].level == EXACT_LEVEL and all(t.sampled for t, _ in exact_turns)
    assert len(fake.checks) == HEALTHY_SAMPLES
    assert fake.sent[0].sampling_params["custom_params"][FIDELITY_LEVEL_FIELD] == EXACT_LEVEL
    # HEALTHY_SAMPLES agreeing samples at the exact level (2 of them the extra bad adds
    # above, which landed in its window): one step down, and no further
    assert loop.level(("t1", None, None)) == EXACT_LEVEL - 1
    last = loop.steps[-1]
    assert (last.before, last.after, last.samples) == (EXACT_LEVEL, EXACT_LEVEL - 1,
                                                       HEALTHY_SAMPLES)
    assert fidelity_monitor.TOTALS.scores.turns >= HEALTHY_SAMPLES
    assert fidelity_monitor.TOTALS.pending == 0


def test_a_request_with_custom_params_none_is_stamped_at_a_raised_level():
    for _ in range(MIN_SAMPLES):
        fidelity_monitor.LOOP.add(("t1", None, None), None, BAD)
    obj = request(head=None, custom_params=None)
    fidelity_monitor.before_request(obj, label_and_check(obj, None))
    assert obj.sampling_params["custom_params"] == {FIDELITY_LEVEL_FIELD: 1}


def test_a_client_cannot_stamp_its_own_level():
    obj = request()
    obj.sampling_params["custom_params"][FIDELITY_LEVEL_FIELD] = 0
    with pytest.raises(RequestOptionError,
                       match=f"custom_params.{FIDELITY_LEVEL_FIELD} is set by the server only"):
        label_and_check(obj, None)
    assert RequestOptions.parse({FIDELITY_LEVEL_FIELD: 2}).fidelity_level == 2
    assert RequestOptions.parse({}).fidelity_level == 0
    with pytest.raises(RequestOptionError, match=FIDELITY_LEVEL_FIELD):
        RequestOptions.parse({FIDELITY_LEVEL_FIELD: -1})


# ----- failures and state -----

def test_a_failing_exact_check_is_counted_and_never_reaches_the_response(caplog):
    fake = FakeSGLang(fail=True)
    obj = request()
    plain = copy.deepcopy(obj)
    (ticket, seen), = run(turns(fake, [obj]))
    assert ticket.sampled and seen == fake.served(plain)
    totals = fidelity_monitor.TOTALS
    assert (totals.failed, totals.sampled, totals.pending, totals.scores.turns) == (1, 1, 0, 0)
    assert "exact prefill failed" in caplog.text
    fake.fail = False
    run(turns(fake, [request()]))  # the next sample is checked
    assert (totals.failed, totals.scores.turns) == (1, 1)


def test_server_info_gains_the_monitors_state():
    fake = FakeSGLang()
    run(turns(fake, [request()]))

    async def states(manager):
        return [{"kvcmas": {"held": 0}}, {"kvcmas": None}, {"other": 1}, "x"]

    got = run(fidelity_monitor.internal_state_around(states, None))
    snap = got[0]["kvcmas"]["fidelity"]
    assert snap == fidelity_monitor.snapshot() and json.loads(json.dumps(snap)) == snap
    assert got[0]["kvcmas"]["held"] == 0 and got[1:] == [{"kvcmas": None}, {"other": 1}, "x"]
    assert snap["share"] == 1.0 and snap["sampled"] == 1 and snap["top1_agreement"] == 1.0
    assert snap["target"] == fidelity.AGREEMENT_TARGET and snap["raised"] == {}


def test_a_sample_queued_as_the_worker_finishes_is_still_checked():
    first_gate, last_gate = asyncio.Event(), asyncio.Event()

    class Gated(FakeSGLang):
        async def original(self, manager, obj, request=None):
            self.sent.append(obj)
            if str(obj.rid).startswith(RID_PREFIX):
                await first_gate.wait()
                for out in self.exact(obj):
                    yield out
                return
            outs = self.served(obj)
            if obj is late:
                await last_gate.wait()
            for out in outs:
                yield out

    fake = Gated()
    late = request()

    async def scenario():
        await turn(fake, request())  # its exact check waits at first_gate
        other = asyncio.create_task(turn(fake, late))  # waits at last_gate
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        first_gate.set()  # the worker's check and the late turn finish in one iteration
        last_gate.set()
        await other
        await drain()

    run(scenario())
    assert len(fake.checks) == 2 and fidelity_monitor.TOTALS.scores.turns == 2


def test_a_burst_whose_first_request_leads_still_gives_its_sample(knobs):
    """Requests that arrive together are all marked while the monitor is behind: the first is
    usually the leader and borrows nothing, and a later one that reads becomes the sample; the
    share still holds (one sample, not one per marked request)."""
    knobs(fidelity_share=0.02)
    leader, reader = FakeSGLang(reused=0), FakeSGLang()
    run(burst([leader, reader, reader, reader]))
    totals = fidelity_monitor.TOTALS
    assert (totals.reader_turns, totals.sampled, totals.pending) == (3, 1, 0)
    assert len(reader.checks) == 1 and totals.scores.turns == 1


def test_an_idle_server_whose_turns_read_nothing_stops_marking_until_a_reader_finishes():
    """Marking costs every decode step its log-probabilities: once ``READER_WINDOW`` finished
    candidates in a row borrowed nothing (an idle server's spare passes serve them exactly),
    no request is marked; a reader turn finishing unmarked starts it again."""
    window = fidelity_monitor.READER_WINDOW
    exact = FakeSGLang(reused=0)
    marked = [t.sampled for t, _ in run(turns(exact, [request() for _ in range(window + 3)]))]
    assert marked == [True] * window + [False] * 3
    assert exact.checks == [] and fidelity_monitor.TOTALS.reader_turns == 0
    reader = FakeSGLang()
    (unmarked, _), (next_one, _) = run(turns(reader, [request(), request()]))
    assert not unmarked.sampled and next_one.sampled
    assert len(reader.checks) == 1 and fidelity_monitor.TOTALS.reader_turns == 2
