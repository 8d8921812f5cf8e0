"""The head-to-head workload over HTTP: GSM8K debates and reviewer chains, every workflow at
once, each step's agents sent together; one record per agent turn (``turn_key`` names it the
same way in every arm), and a replay of recorded turns in the same order (``replay_steps``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglang_kvcmas_bench.server_calls import stream_generate
from sglang_kvcmas_bench.workflows import Workflow, chat_prompt_ids, debate, reviewer_chain


def build_workflows(n_debates: int, n_chains: int) -> list[Workflow]:
    from sglang_kvcmas_examples.datasets import gsm8k

    items = gsm8k()
    flows = [debate(i, items[i].question) for i in range(n_debates)]
    flows += [reviewer_chain(100 + i, items[50 + i].question) for i in range(n_chains)]
    return flows


def run_workload(url: str, flows: list[Workflow], tok, max_new: int) -> tuple[list[dict], float]:
    """Run every workflow concurrently; returns one record per agent turn and the makespan."""
    turns: list[dict] = []
    lock = threading.Lock()

    def one_flow(flow: Workflow) -> float:
        t0 = time.perf_counter()
        for step, agents in enumerate(flow.steps):
            prompts = {a: chat_prompt_ids(tok, flow.messages(step, a)) for a in agents}
            with ThreadPoolExecutor(len(agents)) as pool:
                outs = dict(zip(agents, pool.map(
                    lambda a: stream_generate(url, prompts[a], max_new), agents)))
            for a in agents:
                rec = {"kind": flow.kind, "wid": flow.wid, "step": step, "agent": a,
                       "prompt_ids": prompts[a], **outs[a]}
                with lock:
                    turns.append(rec)
            flow.record(step, {a: outs[a]["text"] for a in agents})
        return time.perf_counter() - t0

    with ThreadPoolExecutor(len(flows)) as pool:
        spans = list(pool.map(one_flow, flows))
    return turns, max(spans)


def turn_key(t: dict) -> tuple:
    """(kind, wid, step, agent): one agent turn, the same in every arm."""
    return (t["kind"], t["wid"], t["step"], t["agent"])


def replay_steps(turns: list[dict], flow_of, one) -> list[dict]:
    """``one(turn)`` for every turn, as the workflows ran: each workflow's steps in order, the
    turns of a step together, workflows concurrently (``flow_of(turn)``: its workflow key)."""
    by_flow: dict[Any, list[dict]] = {}
    for t in turns:
        by_flow.setdefault(flow_of(t), []).append(t)
    out: list[dict] = []
    lock = threading.Lock()

    def flow(ts: list[dict]) -> None:
        for step in sorted({t["step"] for t in ts}):
            group = [t for t in ts if t["step"] == step]
            with ThreadPoolExecutor(len(group)) as pool:
                res = list(pool.map(one, group))
            with lock:
                out.extend(res)

    with ThreadPoolExecutor(len(by_flow)) as pool:
        list(pool.map(flow, by_flow.values()))
    return out
