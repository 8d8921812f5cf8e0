"""What the example workflows report per agent turn, and how a turn runs with streaming.

Every example (``debate``, ``panel``, ``fanout``) runs its agents' turns as SGLang frontend
programs and records each as a :class:`Turn`: what the agent said, its prompt and cached tokens,
the time to its first token on the client and on the server, and the server's reuse record
(``meta_info.kvcmas_reuse``) when sglang-kvcmas serves it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One agent turn: what it said and what it cost.

    Attributes:
        round: 1-based round of the workflow.
        agent: the agent's name.
        answer: generated text.
        prompt_tokens: tokens in the turn's prompt.
        cached_tokens: prompt tokens the server reused from its tree cache.
        completion_tokens: generated tokens.
        ttft_client_s: seconds from sending the request to the first streamed text chunk.
        ttft_server_s: the server's ``first_token_latency`` (request received → first token).
        latency_s: seconds until the turn finished, on the client.
        reuse: the server's reuse record (``meta_info.kvcmas_reuse``: tokens reused exactly,
            factored, re-positioned, recomputed), or None when the server kept none (SGLang's
            own tree cache).
    """

    round: int
    agent: str
    answer: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_client_s: float
    ttft_server_s: float | None
    latency_s: float
    reuse: dict | None = None


class TurnTotals:
    """Prompt and cached tokens summed over a run's ``turns`` (a mixin of the examples' run
    records)."""

    turns: list[Turn]

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.turns)

    @property
    def cached_tokens(self) -> int:
        return sum(t.cached_tokens for t in self.turns)


def turn_of(answer: str, meta: dict | None, round_: int, agent: str, start: float, end: float,
            first_chunk: float | None) -> Turn:
    """The :class:`Turn` of a finished generation: its text and ``meta_info``; one without
    client timing of its first chunk (a fork) takes the server's."""
    meta = meta or {}
    server = meta.get("first_token_latency")
    ttft = (first_chunk - start if first_chunk is not None
            else server if server is not None else end - start)
    return Turn(
        round=round_, agent=agent, answer=answer,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", 0)),
        ttft_client_s=ttft, ttft_server_s=server, latency_s=end - start,
        reuse=(meta.get("kvcmas_reuse") or [None])[0],
    )


def stream_turn(program: Any, backend: Any, round_: int, agent: str, var: str,
                **arguments: Any) -> Turn:
    """Run ``program`` (an ``sgl.function`` generating ``var``) once with streaming, timing its
    first chunk on the client.

    Raises:
        RuntimeError: the program run failed (the server's error in the message).
    """
    start = time.perf_counter()
    state = program.run(**arguments, backend=backend, stream=True)
    first_chunk = None
    for chunk in state.text_iter(var):
        if chunk and first_chunk is None:
            first_chunk = time.perf_counter()
    end = time.perf_counter()
    if state.error() is not None:
        raise RuntimeError(f"{agent}'s turn failed: {state.error()}")
    return turn_of(state[var], state.get_meta_info(var), round_, agent, start, end,
                   first_chunk or end)


def run_parallel(calls: Sequence[Callable[[], Turn]]) -> list[Turn]:
    """Run agent turns at the same time (one client thread each, as concurrent requests);
    their turns in the order given."""
    with ThreadPoolExecutor(max(1, len(calls))) as pool:
        return list(pool.map(lambda call: call(), calls))


def print_turn(turn: Turn) -> None:
    """One progress line per turn: round, agent, prompt and cached tokens, client and server
    TTFT (ms), output tokens, the start of the answer."""
    server = f"{turn.ttft_server_s * 1000:7.0f}" if turn.ttft_server_s is not None else "      ?"
    answer = " ".join(turn.answer.split())
    print(f"{turn.round:>5} {turn.agent:<12} {turn.prompt_tokens:>7} {turn.cached_tokens:>7} "
          f"{turn.ttft_client_s * 1000:>9.0f} {server:>9} {turn.completion_tokens:>5}  "
          f"{answer[:60]}{'…' if len(answer) > 60 else ''}", flush=True)
