"""Reliability of a sharing server: bad input, disconnects, aborts, an eviction storm, isolation.

Boots one server with sharing on (``--kvcmas-share-context``, a small KV pool, chunked prefill),
then runs each category, classifying every request it sends:

- ``completed``: a valid request answered 200;
- ``clear_errors``: an invalid request answered 4xx with a message naming what is wrong;
- ``dropped``: a request the client itself disconnected or aborted on purpose;
- ``lost``: anything else (a valid request that failed or hung, an invalid one answered 5xx or
  not at all, or answered 4xx without naming the field).

After each category it waits for the server to go idle and reads ``/server_info``'s ``kvcmas``
entry: pool slots not back (``leaked_slots`` = total − available − evictable when nothing runs),
the shared tree's invariants, leaders left pending; and the server log for scheduler exceptions.
Summary::

    RELIABILITY sent=<n> completed=<n> clear_errors=<n> lost=0 leaked_slots=0 scheduler_crashes=0

    python benchmark/serving/reliability.py --quick      # < 10 min on 2 cores
    python benchmark/serving/reliability.py              # the storm at 64 workflows

``--model-path`` (``model_arg``): the model served (or, with ``--url``, the one the
running server serves: its tokenizer builds the prompts); ``results/reliability[_quick].json``
names it, and gets ``_<model>`` for a model other than the embedded one.

Isolation note: a request under another ``cache_salt`` reads nothing across the salt and is never
held back by another salt's leader; what remains is what stock SGLang has (the shared scheduler's
queueing and batch timing are visible to every tenant).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sglang_kvcmas_bench.debate_prompts import Prompts
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.server_arms import ArmServer, kvcmas_state, shared_tree_stats
from sglang_kvcmas_bench.server_calls import Reply, call, raw_stream
from sglang_kvcmas_bench.workflows import DEBATERS

RESULTS = Path(__file__).resolve().parent / "results"


def say(text: str) -> None:
    print(f"[reliability] {text}", file=sys.stderr, flush=True)


# ----- HTTP without raising -------------------------------------------------------------------


# ----- outcome bookkeeping --------------------------------------------------------------------

@dataclass
class Category:
    name: str
    counts: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    leaked_slots: int = 0
    invariant_problems: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)

    def record(self, kind: str, note: str | None = None) -> None:
        self.counts["sent"] += 1
        self.counts[kind] += 1
        if note and kind == "lost":
            self.notes.append(note)


def judge_valid(cat: Category, reply: Reply, what: str) -> None:
    if reply.status == 200 and "error" not in reply.json():
        cat.record("completed")
    else:
        cat.record("lost", f"{what}: valid request got {reply.status}: {reply.body[:200]}")


def judge_invalid(cat: Category, reply: Reply, what: str, names: str | None) -> None:
    """An invalid request must get a 4xx whose message names ``names`` (when given)."""
    if reply.status is not None and 400 <= reply.status < 500 and (
            names is None or names in reply.body):
        cat.record("clear_errors")
    else:
        cat.record("lost", f"{what}: invalid request got {reply.status}: {reply.body[:200]}")


def judge_either(cat: Category, reply: Reply, what: str) -> None:
    """Odd but arguably valid input: it completes, or gets a clear 4xx; never a 5xx or hang."""
    if reply.status == 200 and "error" not in reply.json():
        cat.record("completed")
    elif reply.status is not None and 400 <= reply.status < 500 and len(reply.body) > 10:
        cat.record("clear_errors")
    else:
        cat.record("lost", f"{what}: got {reply.status}: {reply.body[:200]}")


# ----- the server's view ----------------------------------------------------------------------

def settle(url: str, cat: Category, timeout_s: float = 120.0) -> None:
    """Wait until nothing runs, then record leaked slots and tree problems."""
    deadline = time.monotonic() + timeout_s
    state = {}
    while time.monotonic() < deadline:
        state = kvcmas_state(url)
        pool = state.get("pool") or {}
        tree = state.get("shared_tree") or {}
        if pool and pool["protected"] == 0 and pool["available"] + pool["evictable"] == \
                pool["total"] and tree.get("pending_owners", 0) == 0:
            break
        time.sleep(1.0)
    pool = state.get("pool") or {}
    tree = state.get("shared_tree") or {}
    cat.leaked_slots = (pool.get("total", 0) - pool.get("available", 0)
                        - pool.get("evictable", 0)) if pool else -1
    cat.invariant_problems = list(tree.get("invariants", ["no kvcmas state"]))
    if tree.get("pending_owners"):
        cat.invariant_problems.append(f"{tree['pending_owners']} leaders left pending")


# ----- prompts --------------------------------------------------------------------------------


def generate_body(ids: list[int], max_new: int = 8, custom: dict | None = None, rid: str = "",
                  stream: bool = False, salt: str | None = None) -> dict:
    sampling: dict = {"temperature": 0, "max_new_tokens": max_new}
    if custom is not None:
        sampling["custom_params"] = custom
    body: dict = {"input_ids": ids, "sampling_params": sampling, "stream": stream}
    if rid:
        body["rid"] = rid
    if salt:
        body["cache_salt"] = salt
    return body


# ----- categories -----------------------------------------------------------------------------

BAD_FIELDS = [
    ({"kvcmas_head_len": None}, "kvcmas_head_len"),
    ({"kvcmas_head_len": [16]}, "kvcmas_head_len"),
    ({"kvcmas_head_len": {}}, "kvcmas_head_len"),
    ({"kvcmas_head_len": "16"}, "kvcmas_head_len"),
    ({"kvcmas_head_len": 1.5}, "kvcmas_head_len"),
    ({"kvcmas_head_len": True}, "kvcmas_head_len"),
    ({"kvcmas_head_len": -3}, "kvcmas_head_len"),
    ({"kvcmas_head_len": 10**12}, "kvcmas_head_len"),
    ({"kvcmas_head_len": 4, "kvcmas_shared_end": None}, "kvcmas_shared_end"),
    ({"kvcmas_head_len": 8, "kvcmas_shared_end": 4}, "kvcmas_shared_end"),
    ({"kvcmas_head_len": 4, "kvcmas_shared_end": 10**9}, "kvcmas_shared_end"),
    ({"kvcmas_shared_end": 5}, "kvcmas_shared_end"),
    ({"kvcmas_agent": 7, "kvcmas_head_len": 4}, "kvcmas_agent"),
    ({"kvcmas_agent": "x" * 10_000, "kvcmas_head_len": 4}, "kvcmas_agent"),
    ({"kvcmas_agent": "a"}, "kvcmas_agent"),
    ({"kvcmas_exact": "yes"}, "kvcmas_exact"),
    ({"kvcmas_exact": 1}, "kvcmas_exact"),
    ({"kvcmas_workflow": ""}, "kvcmas_workflow"),
    ({"kvcmas_workflow": ["w"]}, "kvcmas_workflow"),
    ({"kvcmas_recompute_boundary": -1}, "kvcmas_recompute_boundary"),
    ({"kvcmas_recompute_boundary": 2**70}, None),  # beyond JSON's safe integers: any clear 4xx
    ({"kvcmas_recompute_mass_fraction": math.nan}, None),  # not JSON: the body is refused
    ({"kvcmas_recompute_mass_fraction": math.inf}, None),
    ({"kvcmas_recompute_mass_fraction": 1.5}, "kvcmas_recompute_mass_fraction"),
    ({"kvcmas_recompute_tail": "3"}, "kvcmas_recompute_tail"),
    ({"kvcmas_min_borrowed": 4}, "kvcmas_min_borrowed"),
    ({"kvcmas_nonsense": 1}, "kvcmas_nonsense"),
    (5, "custom_params"),
    ([1, 2], "custom_params"),
    ("text", "custom_params"),
]


def bad_fields(url: str, p: Prompts, cat: Category, quick: bool) -> None:
    ids = p.ids("Ada", "Question: how many legs do three cats have?")
    for custom, names in BAD_FIELDS:
        judge_invalid(cat, call(url, "/generate", generate_body(ids, custom=custom)),
                      f"/generate {custom!r:.60}", names)
        chat = {"model": "default", "max_tokens": 4, "custom_params": custom,
                "messages": [{"role": "system", "content": DEBATERS["Ada"]},
                             {"role": "user", "content": "Question: 2 + 2?"}]}
        judge_invalid(cat, call(url, "/v1/chat/completions", chat), f"chat {custom!r:.60}",
                      names)
    # streamed: the 400 arrives as SGLang's error event (the stream has already started)
    streamed = call(url, "/generate", generate_body(ids, custom={"kvcmas_head_len": "x"},
                                                     stream=True))
    if streamed.status == 200 and '"error"' in streamed.body and "kvcmas_head_len" in \
            streamed.body and '"code": 400' in streamed.body.replace('"code":400', '"code": 400'):
        cat.record("clear_errors")
    else:
        cat.record("lost", f"streamed bad field got {streamed.status}: {streamed.body[:200]}")
    # a body naming one workflow and a header naming another
    judge_invalid(cat, call(url, "/generate", generate_body(ids, custom={"kvcmas_workflow": "a"}),
                            headers={"X-KVCMAS-Workflow": "b"}), "workflow mismatch",
                  "kvcmas_workflow")
    # SGLang's own custom_params keys pass through untouched; valid fields of ours work
    judge_valid(cat, call(url, "/generate", generate_body(ids, custom={"thinking_budget": 4})),
                "foreign key passes")
    judge_valid(cat, call(url, "/generate", generate_body(
        ids, custom={"kvcmas_agent": "ada", "kvcmas_head_len": 10, "kvcmas_exact": True,
                     "kvcmas_recompute_boundary": 0})), "all fields valid")


def odd_chat(url: str, p: Prompts, cat: Category, quick: bool) -> None:
    sys_msg = {"role": "system", "content": DEBATERS["Ben"]}
    cases = {
        "empty messages": [],
        "system only": [sys_msg],
        "empty user text": [sys_msg, {"role": "user", "content": ""}],
        "tool call and result": [
            sys_msg, {"role": "user", "content": "What is 6 times 7?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "calc", "arguments": "{\"expr\": \"6*7\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "multimodal-shaped content": [sys_msg, {"role": "user", "content": [
            {"type": "text", "text": "Describe this."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
        "text parts": [sys_msg, {"role": "user", "content": [
            {"type": "text", "text": "Question: 3 + 4?"}]}],
        "unknown role": [sys_msg, {"role": "wizard", "content": "hi"}],
    }
    for what, messages in cases.items():
        body = {"model": "default", "max_tokens": 4, "messages": messages}
        reply = call(url, "/v1/chat/completions", body)
        judge_either(cat, reply, what)
        cat.evidence.append(f"{what}: {reply.status}"
                            + (f" {reply.json().get('message', '')[:80]!r}"
                               if reply.status != 200 else ""))
    prefill_only = generate_body(p.ids("Ben", "Question: 5 + 5?"), max_new=0)
    judge_valid(cat, call(url, "/generate", prefill_only), "prefill only (max_new_tokens 0)")


def too_long(url: str, p: Prompts, cat: Category, quick: bool, pool: int, context: int) -> None:
    base = p.ids("Cleo", "x")
    over_context = base[:3] + [42] * (context + 100)
    judge_invalid(cat, call(url, "/generate", generate_body(over_context)), "past the context",
                  None)
    over_pool = base[:3] + [42] * (pool + 50)
    if len(over_pool) < context:  # under the context but past the pool
        judge_invalid(cat, call(url, "/generate", generate_body(over_pool), timeout=120),
                      "past the pool", None)
    fits = p.ids("Cleo", p.filler(min(pool, context) // 2, 1))
    judge_valid(cat, call(url, "/generate", generate_body(fits)), "half the pool or context")


def same_name(url: str, p: Prompts, cat: Category, quick: bool) -> None:
    """One explicit agent name sent with two different heads: two agents, never one mixed set
    of leaves (the second head never reads the first head's KV as its own)."""
    transcript = p.filler(300, 2)
    for round_ in range(2):
        for agent in ("Ada", "Ben"):
            ids = p.ids(agent, transcript + f"\n\nRound {round_}.")
            head_len = ids.index(p.tok.convert_tokens_to_ids("<|im_end|>")) + 2
            reply = call(url, "/generate", generate_body(ids, custom={
                "kvcmas_agent": "solver", "kvcmas_head_len": head_len}))
            judge_valid(cat, reply, f"{agent} as 'solver'")
            rec = (reply.json().get("meta_info", {}).get("kvcmas_reuse") or [{}])[0]
            if agent == "Ben" and rec.get("reused_exact", 0) > head_len + 8 and round_ == 0:
                cat.record("lost", f"Ben read {rec['reused_exact']} tokens as its own exact KV")


def disconnects(url: str, p: Prompts, cat: Category, quick: bool) -> None:
    n = 12 if quick else 30
    rng = random.Random(3)
    transcript = p.filler(400, 4)

    def one(i: int) -> None:
        agent = p.agents[i % 3]
        body = {"model": "default", "max_tokens": 48, "stream": True, "temperature": 0,
                "messages": [{"role": "system", "content": DEBATERS[agent]},
                             {"role": "user", "content": transcript + f"\n\nTurn {i // 3}."}]}
        drop = rng.choice([0, 1, 3, 10, None, None])
        seen = raw_stream(url, body, drop)
        if drop is None:
            cat.record("completed" if seen > 1 else "lost", f"stream {i}: {seen} chunks")
        else:
            cat.record("dropped")

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(n)))


def aborts(url: str, p: Prompts, cat: Category, quick: bool) -> None:
    """Readers aborted while the turn order holds them; a leader aborted mid-prefill (its
    chunks in flight) while readers wait for it: every waiting reader proceeds."""
    for trial in range(2 if quick else 4):
        for victim in ("readers", "leader"):
            transcript = f"Session {uuid.uuid4().hex[:8]}.\n\n" + p.filler(900, 10 + trial)
            # every head cached first, so the readers can borrow (and are held back)
            for a in p.agents:
                judge_valid(cat, call(url, "/generate", generate_body(
                    p.ids(a, f"Warm up {trial}."), max_new=1)), "warm-up")
            rids = {a: f"{victim}-{trial}-{a}-{uuid.uuid4().hex[:6]}" for a in p.agents}
            replies: dict[str, Reply] = {}

            def send(a: str) -> None:
                replies[a] = call(url, "/generate", generate_body(
                    p.ids(a, transcript), max_new=8, rid=rids[a]), timeout=300)

            threads = [threading.Thread(target=send, args=(a,)) for a in p.agents]
            for t in threads:
                t.start()
                time.sleep(0.05)  # the first agent arrives first and leads
            time.sleep(1.0)  # the leader is prefilling its first chunks; readers are held
            tree = shared_tree_stats(url)
            cat.evidence.append(f"{victim} trial {trial}: {tree.get('held_back')} held back, "
                                f"{tree.get('pending_owners')} leader(s) in flight at the abort")
            doomed = p.agents[1:] if victim == "readers" else p.agents[:1]
            for a in doomed:
                call(url, "/abort_request", {"rid": rids[a]}, timeout=30)
            for t in threads:
                t.join(timeout=320)
            for a in p.agents:
                r = replies.get(a, Reply(None, "no reply"))
                if a in doomed:
                    finish = (r.json().get("meta_info") or {}).get("finish_reason") or {}
                    done = r.status == 200 and finish.get("type") != "abort"
                    cat.record("completed" if done else "dropped")  # finished before the abort
                else:
                    judge_valid(cat, r, f"{victim} trial {trial}: {a} after the abort")


def storm(url: str, p: Prompts, cat: Category, quick: bool) -> None:
    """Many concurrent workflows (3 agents x 2 rounds, the agents of a round together) with the
    pool far below their demand: every request completes or fails clearly."""
    n = 16 if quick else 64
    answers: dict[int, list[str]] = {w: [] for w in range(n)}

    def workflow(w: int) -> None:
        q = p.questions[w % len(p.questions)]
        for round_ in range(2):
            transcript = "\n\n".join([f"Question: {q}", *answers[w]])
            with ThreadPoolExecutor(3) as pool:
                replies = list(pool.map(lambda a: call(url, "/generate", generate_body(
                    p.ids(a, transcript), max_new=16), timeout=600), p.agents))
            for a, r in zip(p.agents, replies):
                judge_either(cat, r, f"workflow {w} round {round_} {a}")
                answers[w].append(f"{a}: {r.json().get('text', '')}")

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(workflow, range(n)))


def isolation(url: str, p: Prompts, cat: Category, quick: bool) -> None:
    transcript = p.filler(300, 5)
    for salt in ("tenant-a", "tenant-b"):
        for a in p.agents:
            call(url, "/generate", generate_body(p.ids(a, "hello"), max_new=1, salt=salt))
    owner = call(url, "/generate", generate_body(p.ids("Ada", transcript), salt="tenant-a"))
    judge_valid(cat, owner, "tenant-a owner")
    other = call(url, "/generate", generate_body(p.ids("Ben", transcript), salt="tenant-b"))
    judge_valid(cat, other, "tenant-b reader")
    rec = (other.json().get("meta_info", {}).get("kvcmas_reuse") or [{}])[0]
    if rec.get("reused_repositioned", 0) or rec.get("reused_factored", 0):
        cat.record("lost", f"tenant-b read across the salt: {rec}")
    same = call(url, "/generate", generate_body(p.ids("Ben", transcript), salt="tenant-a"))
    judge_valid(cat, same, "tenant-a reader")


CATEGORIES = ("bad_fields", "odd_chat", "too_long", "same_name", "disconnects", "aborts",
              "isolation", "storm")


def run(url: str, log: Path, quick: bool, names: tuple[str, ...], pool: int,
        context: int, model_folder: Path | None = None) -> list[Category]:
    p = Prompts(model_folder)
    cats = []
    for name in names:
        cat = Category(name)
        t0 = time.perf_counter()
        fn = globals()[name]
        if name == "too_long":
            fn(url, p, cat, quick, pool, context)
        else:
            fn(url, p, cat, quick)
        settle(url, cat)
        cats.append(cat)
        say(f"{name}: {dict(cat.counts)} leaked_slots={cat.leaked_slots} "
            f"problems={cat.invariant_problems} ({time.perf_counter() - t0:.0f} s)")
        for note in cat.notes[:5]:
            say(f"  lost: {note}")
        for note in cat.evidence:
            say(f"  {note}")
    return cats


def crashes(url: str, log: Path) -> int:
    text = log.read_text(errors="replace") if log.exists() else ""
    dead = call(url, "/health", timeout=30).status != 200
    return text.count("Scheduler hit an exception") + text.count("SIGQUIT") + int(dead)


def summary_line(cats: list[Category], scheduler_crashes: int) -> str:
    total = sum((c.counts for c in cats), Counter())
    # at the end, after everything; -1: the pool could not be read, which is no pass
    leaked = cats[-1].leaked_slots if cats else 0
    leaked = "unknown" if leaked < 0 else leaked
    return (f"RELIABILITY sent={total['sent']} completed={total['completed']} "
            f"clear_errors={total['clear_errors']} lost={total['lost']} leaked_slots={leaked} "
            f"scheduler_crashes={scheduler_crashes} dropped_by_client={total['dropped']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small counts, storm of 16 workflows")
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--pool", type=int, default=None,
                    help="KV pool tokens (default: about a quarter of the storm's demand)")
    ap.add_argument("--url", help="an already running sharing server (skips booting one)")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder of reliability[_quick][_<model>].json (default: results/); "
                         "the server's log goes to a folder of that name in it")
    add_model_arg(ap)
    args = ap.parse_args(argv)
    model = model_from_args(ap, args)
    name = model.named(Path("reliability" + ("_quick" if args.quick else ""))).name
    names = tuple(n for n in args.categories.split(",") if n)
    unknown = set(names) - set(CATEGORIES)
    if unknown:
        ap.error(f"unknown categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}")
    pool = args.pool or (4096 if args.quick else 16384)
    context = 8192
    (args.out / name).mkdir(parents=True, exist_ok=True)
    log = args.out / name / "server.log"
    t0 = time.perf_counter()
    if args.url:
        cats = run(args.url, log, args.quick, names, pool, context, model.folder)
        n_crash = crashes(args.url, log)
    else:
        flags = [*model.server_args, "--max-total-tokens", str(pool), "--chunked-prefill-size",
                 "256"]
        with ArmServer("kvcmas", log, flags) as server:
            say(f"sharing server up at {server.url} (pool {pool}, chunks of 256)")
            cats = run(server.url, log, args.quick, names, pool, context, model.folder)
            n_crash = crashes(server.url, log)
    rows = [{"category": c.name, **c.counts, "leaked_slots": c.leaked_slots,
             "invariant_problems": c.invariant_problems, "lost_notes": c.notes,
             "evidence": c.evidence} for c in cats]
    line = summary_line(cats, n_crash)
    problems = [p for c in cats for p in c.invariant_problems]
    seconds = round(time.perf_counter() - t0, 1)
    record(args.out / f"{name}.json", json.dumps(
        {"model": model.name, "quick": args.quick, "pool": pool, "seconds": seconds,
         "categories": rows, "summary": line}, indent=1),
        what=f"the reliability suite{' (--quick)' if args.quick else ''}: {len(cats)} "
             f"categories against a sharing server (pool {pool}, {model.name}), per category "
             f"sent / completed / 4xx / dropped / lost, leaked slots and tree invariants: "
             f"`{line}`; {seconds:.0f} s")
    print(f"{'category':<12} {'sent':>5} {'done':>5} {'4xx':>5} {'drop':>5} {'lost':>5} "
          f"{'leaked':>6}  problems")
    for c in cats:
        k = c.counts
        print(f"{c.name:<12} {k['sent']:>5} {k['completed']:>5} {k['clear_errors']:>5} "
              f"{k['dropped']:>5} {k['lost']:>5} {c.leaked_slots:>6}  "
              f"{'; '.join(c.invariant_problems) or '-'}")
    print(line)
    print(f"[reliability] {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    bad = "lost=0 " not in line or "leaked_slots=0 " not in line or \
        "scheduler_crashes=0" not in line or problems
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
