"""Multi-agent workloads over SGLang's OpenAI chat route: who says what, round by round, and a
streamed client that records each turn (TTFT, latency, tokens, what the server reused).

``build(name, ...)`` gives the agents of ``flows`` workflows of a workload (``panel``:
reviewers over a standard-library source file; ``recurring``: the panel with the same reviewers
in every workflow; ``debate``: three agents on a GSM8K question; ``chain``: planner, solver,
critic); :func:`run_flow` runs one workflow against a server, the agents of a round
concurrently, answers going back as assistant messages (``--history shared``, as in LangGraph)
or into each agent's own history (``own``, as in AutoGen). Used by ``benchmark/serving/
matrix.py`` and ``benchmark/serving/fidelity_monitor.py``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

REVIEWERS = ("security reviewer", "performance engineer", "API designer", "test engineer",
             "maintainer", "documentation writer", "newcomer", "release manager",
             "static-analysis expert", "concurrency expert", "accessibility reviewer",
             "data engineer", "SRE", "style reviewer", "architect", "product manager")
HISTORIES = {
    "shared": "one message list per workflow, as in LangGraph's shared state: every answer is "
              "appended as an assistant message tagged with its agent, then the next ask as a "
              "user message; each agent sends its own system prompt and that list",
    "own": "each agent its own history, as in AutoGen: its answers as assistant messages, the "
           "others' in the next user message (the transcripts part after the opening message)",
}
DEBATERS = ("solver", "skeptic", "judge")
CHAIN = ("planner", "solver", "critic")
SOURCES = ("difflib", "ipaddress", "statistics", "argparse", "dataclasses", "functools",
           "inspect", "logging", "pathlib", "random", "shutil", "subprocess", "tarfile",
           "threading", "typing", "zipfile")
"""Standard-library modules whose source the panels review (one per workflow; each over 8k
tokens)."""


# ----- workloads: who says what, round by round -----


@dataclass
class Agent:
    """One agent of one workflow: its conversation so far (OpenAI chat messages)."""

    flow: int
    name: str
    messages: list[dict]


@dataclass
class Turn:
    """One streamed chat completion."""

    flow: int
    round: int
    agent: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    text: str
    borrowed: int = 0
    recomputed: int = 0

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first / time from first to last token."""
        span = self.latency_s - self.ttft_s
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 \
            else None


def source_doc(tok, module: str, tokens: int) -> str:
    """The first ``tokens`` tokens of a standard-library module's source, cut at a line."""
    text = inspect.getsource(importlib.import_module(module))
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < tokens:
        raise ValueError(f"{module}.py holds {len(ids)} tokens, {tokens} asked")
    return tok.decode(ids[:tokens]).rsplit("\n", 1)[0]


def system(role: str, task: str) -> str:
    return f"You are the {role}. {task}"


@dataclass
class Workload:
    """A workload's shape: ``rounds(flow_agents, answers)`` gives each round's speakers and the
    user message each appends (the driver adds answers back as assistant messages)."""

    name: str
    flows: int
    answer: int
    rounds: int
    history: str = "shared"
    agents: list[list[Agent]] = field(default_factory=list)


def build(name: str, tok, flows: int, answer: int, agents: int, doc_tokens: int,
          history: str = "shared") -> Workload:
    """The agents of ``flows`` workflows of workload ``name``, with their opening messages."""
    from sglang_kvcmas_examples.datasets import gsm8k

    w = Workload(name, flows, answer, rounds=2 if name in ("panel", "recurring") else 3,
                 history=history)
    for f in range(flows):
        if name in ("panel", "recurring"):
            roles = (REVIEWERS[:agents] if name == "recurring" else
                     [REVIEWERS[(f * agents + a) % len(REVIEWERS)] for a in range(agents)])
            doc = source_doc(tok, SOURCES[f % len(SOURCES)], doc_tokens)
            opening = (f"Review this source file.\n\n```python\n{doc}\n```\n\nGive the most "
                       "important problem you see from your role, then a verdict: ship or fix.")
            task = "You review code in a team and answer in a few sentences."
        elif name == "debate":
            roles = list(DEBATERS)
            opening = (f"Question: {gsm8k()[f].question}\n\nReason step by step and end with "
                       "'Answer: <number>'.")
            task = "You solve math word problems in a team of three, reasoning step by step."
        elif name == "chain":
            roles = list(CHAIN)
            opening = (f"Task: {gsm8k()[100 + f].question}\n\nThe planner plans, the solver "
                       "solves, the critic checks. Speak only for your role.")
            task = "You work in a planner / solver / critic chain on math word problems."
        else:
            raise ValueError(f"unknown workload {name!r}")
        w.agents.append([Agent(f, r, [{"role": "system", "content": system(r, task)},
                                      {"role": "user", "content": opening}]) for r in roles])
    return w


def speakers(w: Workload, rnd: int) -> list[list[int]]:
    """Per step of round ``rnd``, the agents (indices) that answer at once."""
    n = len(w.agents[0])
    return [[a] for a in range(n)] if w.name == "chain" else [list(range(n))]


def after_step(w: Workload, flow: list[Agent], rnd: int, spoke: list[int],
               answers: dict[int, str]) -> None:
    """Append what the step's answers mean to every agent's conversation (:data:`HISTORIES`)."""
    if w.history == "shared":
        said = [{"role": "assistant", "content": f"[{flow[a].name}] {answers[a]}"} for a in spoke]
        if w.name == "chain":
            ask = f"Next: the {flow[(spoke[0] + 1) % len(flow)].name}."
        elif w.name == "debate":
            ask = "Reconsider your reasoning and end with 'Answer: <number>'."
        else:
            ask = "Give your final verdict, ship or fix, in one sentence."
        for agent in flow:
            agent.messages += [*said, {"role": "user", "content": ask}]
        return
    for a in spoke:
        flow[a].messages.append({"role": "assistant", "content": answers[a]})
    if w.name == "chain":
        said = f"The {flow[spoke[0]].name} said:\n{answers[spoke[0]]}"
        for a, agent in enumerate(flow):
            if a not in spoke:
                agent.messages.append({"role": "user", "content": said})
            else:
                agent.messages.append({"role": "user", "content": "Go on."})
        return
    others = "\n".join(f"- The {flow[a].name}: {answers[a]}" for a in spoke)
    ask = ("Give your final verdict, ship or fix, in one sentence." if w.name != "debate"
           else "Reconsider your reasoning and end with 'Answer: <number>'.")
    for agent in flow:
        agent.messages.append({"role": "user", "content": f"The team said:\n{others}\n\n{ask}"})


# ----- the client -----


def chat(url: str, model: str, messages: list[dict], max_tokens: int, workflow: str) -> dict:
    """One streamed chat completion: text, TTFT, latency, usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-KVCMAS-Workflow": workflow})
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - t0
    return {"text": "".join(text), "ttft_s": ttft if ttft is not None else latency,
            "latency_s": latency, "usage": usage}


def run_flow(url: str, model: str, w: Workload, f: int, tag: str) -> list[Turn]:
    flow, turns = w.agents[f], []
    for rnd in range(w.rounds):
        for spoke in speakers(w, rnd):
            with ThreadPoolExecutor(len(spoke)) as pool:
                outs = list(pool.map(lambda a: chat(url, model, list(flow[a].messages),
                                                    w.answer, f"{tag}-{w.name}-{f}"), spoke))
            answers = {}
            for a, out in zip(spoke, outs):
                usage = out["usage"]
                details = usage.get("prompt_tokens_details") or {}
                borrowed = int(details.get("kvcmas_reused_repositioned") or 0) + int(
                    details.get("kvcmas_reused_factored") or 0)
                turns.append(Turn(f, rnd, flow[a].name, out["ttft_s"], out["latency_s"],
                                  int(usage.get("prompt_tokens") or 0),
                                  int(usage.get("completion_tokens") or 0), out["text"],
                                  borrowed, int(details.get("kvcmas_recomputed_borrowed") or 0)))
                answers[a] = " ".join(out["text"].split())
            after_step(w, flow, rnd, spoke, answers)
    return turns


def answer_of(workload: str, text: str) -> str:
    """What a turn decides: a panel's verdict (``ship``, ``fix``, both or neither), a debate's or
    chain's last ``Answer: <number>``; empty when it gives none."""
    if workload in ("panel", "recurring"):
        return "".join(w for w in ("ship", "fix") if re.search(rf"\b{w}\b", text, re.IGNORECASE))
    found = re.findall(r"Answer:\s*\$?(-?[\d,]*\.?\d+)", text)
    return found[-1].replace(",", "") if found else ""
