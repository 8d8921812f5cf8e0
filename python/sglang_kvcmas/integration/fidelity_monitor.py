"""The fidelity monitor: sampled reader turns checked against exact serving, in the server.

In the HTTP process, around ``TokenizerManager.generate_request`` (``request_hooks``):

1. **Levels.** Every single request of a namespace (``cache_salt``, ``extra_key``, adapter) is
   served at the level the loop holds for its namespace and agent (``policy/fidelity.py``):
   above 0 the request is marked ``custom_params.kvcmas_fidelity_level`` (set by the server
   only), and the tree cache raises what it recomputes, up to exact serving.
2. **Sampling.** The monitor keeps its samples at its share of reader turns
   (``--kvcmas-fidelity-share``, counted over finished turns that borrowed, and turns the loop
   served exactly, which stand for the readers they would have been). While it is behind,
   every request that could borrow (sharing on, not exact, token ids known, no logprobs asked
   by the client, one choice) is marked: it runs with SGLang's output log-probabilities on
   (top ``TOP_LOGPROBS`` per token), taken out of every output before anyone else sees them.
   Every request of a burst is marked, as its first is usually the leader, which borrows
   nothing; a marked turn becomes a sample when it finishes as a reader while the monitor is
   still behind. Marking costs every decode step its log-probabilities, so nothing is marked
   while none of the last ``READER_WINDOW`` finished candidates read (an idle server, whose
   spare passes serve every request exactly).
3. **The exact side.** After the sampled turn has finished, its prompt and its first
   ``FORCED_TOKENS`` generated tokens are prefilled exactly in a namespace of its own (a fresh
   ``cache_salt``: nothing is shared), with the exact log-probabilities of those positions (top
   1, and the reader's top tokens). One exact prefill runs at a time; past ``MAX_QUEUED``
   waiting, a turn is dropped (counted): a busy server samples less rather than queue work.
4. **Scores** (:func:`policy.fidelity.score_turn`) go to the loop, which may step a level, to
   the workflow's totals (``GET /kvcmas/workflows``, and responses' usage as
   ``kvcmas_fidelity_*``), to ``/server_info`` (``kvcmas.fidelity``) and to Prometheus:
   ``kvcmas:fidelity_top1_agreement`` and ``kvcmas:fidelity_kl`` (histograms per sampled turn),
   ``kvcmas:fidelity_turns_total{outcome}`` (``sampled``, ``diverged``, ``dropped``,
   ``failed``), ``kvcmas:fidelity_tokens_total{kind}`` (``prompt``, ``prefilled``: the
   monitor's cost) and ``kvcmas:fidelity_steps_total{direction}``. Every step is logged.

The monitor never delays or changes a response: the exact prefill starts after the response
has finished, and a failure of it is logged and counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import Any

from sglang_kvcmas.integration import metrics
from sglang_kvcmas.integration.prefill_requests import serving_config
from sglang_kvcmas.integration.reuse_accounting import META_KEY
from sglang_kvcmas.policy import fidelity
from sglang_kvcmas.policy.recompute import MIN_BORROWED
from sglang_kvcmas.policy.request_options import (
    EXACT_FIELD,
    FIDELITY_LEVEL_FIELD,
    RequestOptions,
)

logger = logging.getLogger(__name__)

RID_PREFIX = "kvcmas-exact-check-"
MAX_QUEUED = 4
"""Sampled turns waiting for their exact prefill; one past this is dropped."""
RECENT = 64
"""Last sampled turns kept for ``/server_info`` (their level and scores)."""
READER_WINDOW = 16
"""Finished candidate turns looked back over: with no reader among them, nothing is marked."""
LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
                "input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs",
                "output_token_ids_logprobs")
"""``meta_info`` entries a sampled request's outputs carry and the client did not ask for."""


@dataclass
class Totals:
    """What the monitor has seen and cost in this process."""

    reader_turns: int = 0
    sampled: int = 0
    pending: int = 0
    dropped: int = 0
    failed: int = 0
    scores: fidelity.Tally = field(default_factory=fidelity.Tally)
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    read: deque = field(default_factory=lambda: deque(maxlen=READER_WINDOW))
    """Whether each of the last finished candidate turns borrowed."""

    def behind(self, share: float) -> bool:
        """Whether a candidate should be marked: fewer samples than ``share`` of the reader
        turns (one more counted, so the first readers are sampled) while readers are seen."""
        readers_seen = len(self.read) < READER_WINDOW or any(self.read)
        return readers_seen and self.sampled < share * (self.reader_turns + 1)

    def to_json(self) -> dict[str, Any]:
        return {"reader_turns": self.reader_turns, "sampled": self.sampled,
                "dropped": self.dropped, "failed": self.failed, **self.scores.to_json(),
                "prompt_tokens": self.prompt_tokens, "prefilled_tokens": self.prefilled_tokens,
                "recent": list(self.recent)}


@dataclass
class Ticket:
    """One request as the monitor follows it: its namespace and agent keys, the level it is
    served at, whether it could be a sample (``candidate``) and whether it runs marked, with
    its output log-probabilities on (``sampled``), and what its exact check needs."""

    namespace: Hashable
    agent: Hashable | None
    level: int
    workflow: str | None
    candidate: bool = False
    sampled: bool = False
    prompt: list[int] | None = None
    greedy: bool = False
    lora_path: Any = None
    extra_key: Any = None
    stream: bool = False


TOTALS = Totals()
LOOP = fidelity.FidelityLoop()
_QUEUE: list[asyncio.Queue] = []
_TASKS: set[asyncio.Task] = set()


def share() -> float:
    """The share of reader turns sampled (0: the monitor and its loop are off)."""
    cfg = serving_config()
    return cfg.fidelity_share if cfg.share_context else 0.0


def before_request(obj: Any, options: list[RequestOptions | None]) -> Ticket | None:
    """Apply the loop's level to ``obj`` and decide whether to sample it (module docstring);
    call before ``obj`` is sent. None: a request the monitor does not follow."""
    if len(options) != 1 or options[0] is None or share() <= 0.0:
        return None
    opts = options[0]
    if opts.exact or not isinstance(getattr(obj, "sampling_params", None), dict):
        return None
    namespace = (getattr(obj, "cache_salt", None), getattr(obj, "extra_key", None),
                 _adapter(obj))
    ids = getattr(obj, "input_ids", None)
    has_ids = isinstance(ids, list) and bool(ids) and isinstance(ids[0], int)
    agent = _agent_key(opts, ids) if has_ids else None
    ticket = Ticket(namespace, agent, LOOP.level(namespace, agent), opts.workflow)
    if ticket.level:
        if not isinstance(obj.sampling_params.get("custom_params"), dict):
            obj.sampling_params["custom_params"] = {}  # the OpenAI routes pass None
        obj.sampling_params["custom_params"][FIDELITY_LEVEL_FIELD] = ticket.level
    ticket.candidate = has_ids and _may_sample(obj, opts, ids)
    if ticket.candidate and TOTALS.behind(share()):
        TOTALS.pending += 1
        params = obj.sampling_params
        ticket.sampled, ticket.prompt = True, list(ids)
        ticket.greedy = params.get("temperature", 1.0) == 0 or params.get("top_k") == 1
        ticket.lora_path, ticket.extra_key = obj.lora_path, getattr(obj, "extra_key", None)
        ticket.stream = bool(getattr(obj, "stream", False))
        obj.return_logprob, obj.top_logprobs_num = True, fidelity.TOP_LOGPROBS
    return ticket


def _adapter(obj: Any) -> Any:
    path = getattr(obj, "lora_path", None)
    return path if isinstance(path, (str, type(None))) else repr(path)


def _agent_key(opts: RequestOptions, ids: list[int]) -> Hashable | None:
    if opts.head_len is None:
        return None
    head = repr((opts.agent, ids[:opts.head_len])).encode()
    return hashlib.blake2b(head, digest_size=8).hexdigest()


def _may_sample(obj: Any, opts: RequestOptions, ids: list[int]) -> bool:
    shared_end = opts.shared_end if opts.shared_end is not None else len(ids)
    params = obj.sampling_params
    return (shared_end - (opts.head_len or 0) >= MIN_BORROWED and not obj.return_logprob
            and params.get("n", 1) == 1 and not getattr(obj, "token_ids_logprob", None))


def watching(outputs: Any, ticket: Ticket | None, original: Any, manager: Any) -> Any:
    """``outputs`` (the tokenizer manager's async generator) as the monitor follows them: the
    sampled request's log-probabilities taken out, the finished turn counted, and a sampled
    reader turn queued for its exact prefill."""
    if ticket is None or not hasattr(outputs, "__aiter__"):
        return outputs
    return _watch(outputs, ticket, original, manager)


async def _watch(outputs: AsyncIterator[Any], ticket: Ticket, original: Any,
                 manager: Any) -> AsyncIterator[Any]:
    # SGLang's outputs carry the log-probabilities so far, or only each chunk's under its
    # incremental streaming output
    incremental = ticket.stream and bool(getattr(manager, "incremental_streaming_output", False))
    taken: dict[str, list] = {}
    finished = False
    try:
        async for out in outputs:
            meta = out.get("meta_info") if isinstance(out, dict) else None
            if isinstance(meta, dict):
                if ticket.sampled:
                    for key in LOGPROB_KEYS:
                        value = meta.pop(key, None)
                        if isinstance(value, list):
                            taken[key] = taken.get(key, []) + value if incremental else value
                if meta.get("finish_reason") is not None and not finished:
                    finished = True
                    _finished(ticket, meta, taken, original, manager)
            yield out
    finally:
        if ticket.sampled and not finished:
            TOTALS.pending -= 1


def _finished(ticket: Ticket, meta: dict, taken: dict, original: Any, manager: Any) -> None:
    for step in LOOP.served(ticket.namespace, ticket.agent, ticket.level):
        _log_step(step)
    rec = meta.get(META_KEY)
    rec = rec[0] if isinstance(rec, list) and rec else rec
    borrowed = isinstance(rec, dict) and rec.get("reused_factored", 0) + rec.get(
        "reused_repositioned", 0) > 0
    # a turn the loop serves exactly stands for the reader it would have been: sampling it
    # measures the raised level too
    borrowed = borrowed or (ticket.level == fidelity.EXACT_LEVEL and ticket.candidate)
    if borrowed:
        TOTALS.reader_turns += 1
    if ticket.candidate:
        TOTALS.read.append(borrowed)
    if not ticket.sampled:
        return
    TOTALS.pending -= 1
    tops = taken.get("output_top_logprobs") or []
    forced = [t[1] for t in (taken.get("output_token_logprobs") or [])][:fidelity.FORCED_TOKENS]
    if not borrowed or not forced or len(tops) < len(forced) \
            or TOTALS.sampled >= share() * TOTALS.reader_turns:
        return  # not a reader, or another marked reader of the same burst came first
    reader_top = [{int(e[1]): float(e[0]) for e in tops[j] if e[0] is not None}
                  for j in range(len(forced))]
    if _queue().full():
        TOTALS.dropped += 1
        _count("kvcmas:fidelity_turns", "outcome", "dropped")
        return
    TOTALS.sampled += 1
    _count("kvcmas:fidelity_turns", "outcome", "sampled")
    _queue().put_nowait((ticket, forced, reader_top, original, manager))
    _start_worker()


def _queue() -> asyncio.Queue:
    if not _QUEUE:
        _QUEUE.append(asyncio.Queue(maxsize=MAX_QUEUED))
    return _QUEUE[0]


def _start_worker() -> None:
    if any(not t.done() for t in _TASKS):  # a finished one leaves _TASKS a step later
        return
    task = asyncio.get_running_loop().create_task(_worker())
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _worker() -> None:
    queue = _queue()
    while not queue.empty():
        ticket, forced, reader_top, original, manager = queue.get_nowait()
        try:
            score = await exact_check(original, manager, ticket, forced, reader_top)
        except Exception:
            TOTALS.failed += 1
            _count("kvcmas:fidelity_turns", "outcome", "failed")
            logger.exception("sglang-kvcmas: a fidelity sample's exact prefill failed")
            continue
        record(ticket, score)


def exact_request(ticket: Ticket, forced: list[int], reader_top: list[dict[int, float]]) -> Any:
    """The exact side of a sampled turn: its prompt then ``forced``, in a namespace of its own,
    with the exact log-probabilities of the forced positions."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    prompt = ticket.prompt or []
    ids = sorted({t for top in reader_top for t in top})
    return GenerateReqInput(
        input_ids=prompt + forced, lora_path=ticket.lora_path,
        rid=f"{RID_PREFIX}{uuid.uuid4().hex}",
        sampling_params={"max_new_tokens": 1, "temperature": 0,
                         "custom_params": {EXACT_FIELD: True}},
        cache_salt=f"{RID_PREFIX}{uuid.uuid4().hex}", extra_key=ticket.extra_key,
        # SGLang gives no log-probability at the start position: start one before the forced
        return_logprob=True, logprob_start_len=len(prompt) - 1, top_logprobs_num=1,
        token_ids_logprob=ids)


async def exact_check(original: Any, manager: Any, ticket: Ticket, forced: list[int],
                      reader_top: list[dict[int, float]]) -> fidelity.TurnScore:
    """Prefill the exact side (:func:`exact_request`) through SGLang's unhooked
    ``generate_request`` and score the turn against it."""
    meta: dict = {}
    async for out in original(manager, exact_request(ticket, forced, reader_top), None):
        meta = out.get("meta_info", meta) if isinstance(out, dict) else meta
    prompt = int(meta.get("prompt_tokens", 0))
    prefilled = prompt - int(meta.get("cached_tokens", 0))
    TOTALS.prompt_tokens += prompt
    TOTALS.prefilled_tokens += prefilled
    cost = metrics.counter("kvcmas:fidelity_tokens", "Tokens of the fidelity monitor's exact "
                           "prefills (prompt, prefilled).", ["kind"])
    if cost is not None:
        cost.labels(kind="prompt").inc(prompt)
        cost.labels(kind="prefilled").inc(prefilled)
    k = len(forced)
    top1 = [max(pos, key=lambda e: e[0])[1] for pos in meta["input_top_logprobs"][1:k + 1]]
    on_reader = [{int(e[1]): float(e[0]) for e in pos}
                 for pos in meta["input_token_ids_logprobs"][1:k + 1]]
    return fidelity.score_turn(reader_top, top1, on_reader, ticket.greedy)


def record(ticket: Ticket, score: fidelity.TurnScore) -> None:
    """Add a scored turn to the totals, the loop, the workflow and Prometheus."""
    TOTALS.scores.add(score)
    TOTALS.recent.append({"level": ticket.level, "positions": score.positions,
                          "agreed": score.agreed, "diverged_at": score.diverged_at,
                          "kl": score.kl})
    if score.diverged_at is not None:
        _count("kvcmas:fidelity_turns", "outcome", "diverged")
    _observe("kvcmas:fidelity_top1_agreement", score.agreement,
             (0.5, 0.75, 0.875, 0.9375, 1.0))
    if score.kl is not None:
        _observe("kvcmas:fidelity_kl", score.kl, (0.001, 0.01, 0.03, 0.1, 0.3, 1.0))
    if ticket.workflow is not None:
        from sglang_kvcmas.integration.workflow_accounting import LEDGER

        LEDGER.add_fidelity(ticket.workflow, score)
    for step in LOOP.add(ticket.namespace, ticket.agent, score, ticket.level):
        _log_step(step)


def _log_step(step: fidelity.Step) -> None:
    logger.info("sglang-kvcmas: fidelity level %s -> %d for %r (top-1 agreement %.4f over %d "
                "turns)", step.before, step.after, step.key, step.agreement, step.samples)
    _count("kvcmas:fidelity_steps", "direction", step.direction)


def _count(name: str, label: str, value: str) -> None:
    counter = metrics.counter(name, f"sglang-kvcmas fidelity monitor: {name}", [label])
    if counter is not None:
        counter.labels(**{label: value}).inc()


def _observe(name: str, value: float, buckets: tuple[float, ...]) -> None:
    histogram = metrics.histogram(name, f"sglang-kvcmas fidelity monitor: {name} per sampled "
                                  "reader turn", buckets)
    if histogram is not None:
        histogram.observe(value)


def snapshot() -> dict[str, Any]:
    """The monitor's state for ``/server_info``."""
    return {"share": share(), "target": LOOP.target, **TOTALS.to_json(), **LOOP.snapshot()}


INTERNAL_STATE_TARGET = ("sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin."
                         "get_internal_state")


async def internal_state_around(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook for the HTTP process's ``get_internal_state``: each scheduler's ``kvcmas``
    entry of ``/server_info`` gets the monitor's state (``fidelity``)."""
    states = await original(manager, *args, **kwargs)
    for state in states if isinstance(states, list) else ():
        if isinstance(state, dict) and isinstance(state.get("kvcmas"), dict):
            state["kvcmas"]["fidelity"] = snapshot()
    return states
