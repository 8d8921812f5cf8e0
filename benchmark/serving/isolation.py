"""Two tenants behind SGLang's gateway: no KV crosses between them, sharing within each holds.

Two sharing servers behind SMG (``sglang_kvcmas.server.cluster``) with one API key per tenant;
both tenants run the same debates (same agents, questions and workflow ids, so each workflow of
the second tenant lands on the server that holds the first tenant's KV for it) and send the same
body ``cache_salt``; the second also sends a forged ``X-SMG-Tenant-Id`` naming the first. Every
turn runs alone, in the same order in each run (greedy), so a tenant's namespace evolves the
same way whoever ran before it:

- **cross-tenant reuse** (accounting): per turn, the tokens the second tenant reused (SGLang's
  cached prefix plus tokens borrowed from another agent) beyond what the first reused on the
  same turn, summed; 0 when nothing crossed;
- **timing probe**: the first turn of each workflow, the second tenant's time over the first's
  (about 1 when it computed its prompt itself) against the first tenant's own repeat of that
  turn (a cache hit: what a leak would look like);
- **within-tenant sharing**: tokens borrowed behind the gateway over the same workload's on one
  server with no gateway (the same tenant key), every agent's head cached on every server first
  (:func:`warm`), in both tenants alike;
- **forged salts**: a body ``cache_salt`` in a tenant's reserved form is refused (400), a key
  the gateway does not know is refused (401), and the forged header changes nothing.

The spare pass is off in every server (``KVCMAS_SPARE_PREFILL=0``): on an idle server it serves
readers exactly, and borrowing is the path that could leak.

    python benchmark/serving/isolation.py --quick   # 4 debates x 2 rounds; about 10 minutes

Ends with ``ISOLATION gateway= tenants=2 cross_tenant_reused_tokens= within_tenant_sharing_ratio=
forged_salt_rejected=``; writes ``results/isolation[_quick].json`` (``_<model>`` for another
model).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_kvcmas.policy.tenancy import TENANT_SALT_PREFIX, tenant_of
from sglang_kvcmas.server.cluster import Cluster, Tenants, workflow_headers
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.reuse_records import of_meta
from sglang_kvcmas_bench.server_arms import ARMS, COMMON_FLAGS, NO_SPARE_PASS, ArmServer, run_header
from sglang_kvcmas_bench.workflows import Workflow, chat_prompt_ids, debate

RESULTS = Path(__file__).resolve().parent / "results"
TENANTS = {"acme": "key-acme-7f1c", "globex": "key-globex-02be"}
BODY_SALT = "team-salt"
"""Both tenants send this ``cache_salt``: a salt a client chooses never joins two tenants."""
SIZES = {True: {"debates": 4, "rounds": 2, "max_new": 16},
         False: {"debates": 8, "rounds": 3, "max_new": 32}}
POOL_TOKENS = 16384


def say(text: str) -> None:
    print(f"[isolation] {text}", file=sys.stderr, flush=True)


def flows(n: int, rounds: int, first: int = 0) -> list[Workflow]:
    """``n`` debates from GSM8K item ``first`` on, each question followed by five others (a
    transcript long enough that the agents of a round borrow it from the first)."""
    from sglang_kvcmas_examples.datasets import gsm8k

    items = gsm8k()
    return [debate(i, items[i].question + "\n\nOther questions: " + " ".join(
        items[100 + i + j].question for j in range(5)), rounds=rounds)
        for i in range(first, first + n)]


def key(flow: Workflow) -> str:
    return f"{flow.kind}-{flow.wid}"


def post(url: str, body: dict, headers: dict) -> tuple[int, dict, float]:
    """``/generate``: (HTTP status, the JSON answer or the error's, seconds)."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read()), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}, time.perf_counter() - t0


def generate(url: str, ids: list[int], max_new: int, headers: dict) -> tuple[dict, float]:
    status, out, seconds = post(url, {"input_ids": ids, "cache_salt": BODY_SALT,
                                      "sampling_params": {"temperature": 0,
                                                          "max_new_tokens": max_new}}, headers)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {out}")
    return out, seconds


def warm(urls: list[str], tok, headers: dict) -> None:
    """Every agent's head cached on every server, in the tenant's namespace: the first round
    of a debate outside the workload, one token a turn, sent to each server itself. (Without
    it each server's first workflow computes its agents' heads, a cost of adding a server that
    the sharing ratio is not about.)"""
    (flow,) = flows(1, 1, first=90)
    for url in urls:
        for agent in flow.steps[0]:
            generate(url, chat_prompt_ids(tok, flow.messages(0, agent)), 1, headers)


def run(url: str, tok, sizes: dict, headers: dict) -> list[dict]:
    """Every turn of every workflow, one at a time, in one fixed order; one record a turn."""
    turns = []
    for flow in flows(sizes["debates"], sizes["rounds"]):
        for step, agents in enumerate(flow.steps):
            texts = {}
            for agent in agents:
                ids = chat_prompt_ids(tok, flow.messages(step, agent))
                out, seconds = generate(url, ids, sizes["max_new"],
                                        {**headers, **workflow_headers(key(flow))})
                meta = out.get("meta_info", {})
                reuse = of_meta(meta)
                turns.append({"workflow": key(flow), "step": step, "agent": agent,
                              "prompt_tokens": meta.get("prompt_tokens", len(ids)),
                              "cached": meta.get("cached_tokens", 0),
                              "borrowed": reuse.get("borrowed", 0), "seconds": seconds,
                              "ids": ids})
                texts[agent] = out.get("text", "")
            flow.record(step, texts)
    return turns


def first_turns(turns: list[dict]) -> list[int]:
    """Indices of each workflow's first turn."""
    return [i for i, t in enumerate(turns) if i == 0 or t["workflow"] != turns[i - 1]["workflow"]]


def reused(turn: dict) -> int:
    return turn["cached"] + turn["borrowed"]


def summarize(ref: list[dict], first: list[dict], second: list[dict], repeat: list[float],
              forged: dict) -> dict:
    """The headline's figures from the three runs, matched turn by turn."""
    assert [t["ids"] for t in first] == [t["ids"] for t in second], "the runs' prompts differ"
    cross = sum(max(0, reused(b) - reused(a)) for a, b in zip(first, second))
    borrowed_ref = sum(t["borrowed"] for t in ref)
    borrowed_gw = sum(t["borrowed"] for t in first)
    firsts = first_turns(first)
    cold_a = [first[i]["seconds"] for i in firsts]
    cold_b = [second[i]["seconds"] for i in firsts]
    rejected = int(forged["reserved_salt_status"] == 400 and forged["unknown_key_status"] == 401
                   and cross == 0)
    return {
        "cross_tenant_reused_tokens": cross,
        "reused_tokens": {"first": sum(map(reused, first)), "second": sum(map(reused, second))},
        "within_tenant_sharing_ratio": borrowed_gw / borrowed_ref if borrowed_ref else None,
        "borrowed_tokens": {"one_server": borrowed_ref, "gateway_first": borrowed_gw,
                            "gateway_second": sum(t["borrowed"] for t in second)},
        "timing_probe": {
            "first_turn_s": {"first": cold_a, "second": cold_b, "first_repeat": repeat},
            "second_over_first": statistics.median(b / a for a, b in zip(cold_a, cold_b)),
            "repeat_over_first": statistics.median(r / a for a, r in zip(cold_a, repeat))},
        "forged": forged,
        "forged_salt_rejected": rejected,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 debates x 2 rounds, 16 tokens")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default: results/isolation[_quick].json)")
    add_model_arg(ap)
    args = ap.parse_args(argv)
    model = model_from_args(ap, args)
    sizes = SIZES[args.quick]
    out = model.out_or_named(args.out, RESULTS / f"isolation{'_quick' if args.quick else ''}.json")
    logs = model.named(RESULTS / "isolation")
    logs.mkdir(parents=True, exist_ok=True)
    tok = model.tokenizer()
    tenants = Tenants(dict(TENANTS))
    acme, globex = tenants.headers("acme"), tenants.headers("globex")
    flags = [*model.server_args, "--max-total-tokens", str(POOL_TOKENS)]
    t_start = time.monotonic()

    say(f"one server, no gateway: {sizes}")
    with ArmServer("kvcmas", logs / "one_server.log", flags, env=NO_SPARE_PASS) as server:
        warm([server.url], tok, acme)
        ref = run(server.url, tok, sizes, acme)
    say(f"one server: {sum(t['borrowed'] for t in ref)} tokens borrowed")

    worker_args = [*ARMS["kvcmas"][1], *COMMON_FLAGS, *flags]
    with Cluster(workers=2, worker_args=worker_args, log_dir=logs / "cluster",
                 tenants=tenants, request_log=True, env=NO_SPARE_PASS) as cluster:
        say(f"gateway {cluster.url} -> {cluster.worker_urls}; tenant acme")
        for headers in (acme, globex):
            warm(cluster.worker_urls, tok, headers)
        first = run(cluster.url, tok, sizes, acme)
        starts = [first[i] for i in first_turns(first)]
        repeat = [generate(cluster.url, t["ids"], sizes["max_new"],
                           {**acme, **workflow_headers(t["workflow"])})[1] for t in starts]
        say("tenant globex: the same turns, the same salt, a forged tenant header")
        second = run(cluster.url, tok, sizes, {**globex, "X-SMG-Tenant-Id": "acme"})
        probe = first[0]["ids"]
        reserved = f"{TENANT_SALT_PREFIX}{tenant_of({'authorization': acme['Authorization']})}"
        forged = {
            "reserved_salt_status": post(cluster.url, {
                "input_ids": probe, "cache_salt": reserved,
                "sampling_params": {"max_new_tokens": 1}}, globex)[0],
            "unknown_key_status": post(cluster.url, {
                "input_ids": probe, "sampling_params": {"max_new_tokens": 1}},
                {"Authorization": "Bearer key-acme"})[0],
            "forged_header_turns": len(second)}
        placement = cluster.placement()
    result = {**run_header("benchmark/serving/isolation.py", argv, model),
              "gateway": f"smg-{importlib.metadata.version('smg')}", "sizes": sizes,
              **summarize(ref, first, second, repeat, forged),
              "workflows_split_over_servers": sum(
                  sum(1 for c in placement if c.get(key(f))) > 1
                  for f in flows(sizes["debates"], 1)),
              "turns": {name: [{k: v for k, v in t.items() if k != "ids"} for t in turns]
                        for name, turns in (("one_server", ref), ("first", first),
                                            ("second", second))},
              "seconds": round(time.monotonic() - t_start, 1)}
    record(out, json.dumps(result, indent=1) + "\n", command=result["command"],
           what="two tenants behind SMG: cross-tenant reuse, timing probe, sharing within a "
                "tenant against one server, forged salts")
    ratio = result["within_tenant_sharing_ratio"]
    probe_t = result["timing_probe"]
    say(f"reused tokens acme {result['reused_tokens']['first']}, globex "
        f"{result['reused_tokens']['second']}; first turns globex/acme "
        f"{probe_t['second_over_first']:.2f}x, acme's repeat {probe_t['repeat_over_first']:.2f}x; "
        f"{result['seconds']:.0f} s; wrote {out}")
    print(f"ISOLATION gateway={result['gateway']} tenants=2 "
          f"cross_tenant_reused_tokens={result['cross_tenant_reused_tokens']} "
          f"within_tenant_sharing_ratio={'nan' if ratio is None else f'{ratio:.2f}'} "
          f"forged_salt_rejected={result['forged_salt_rejected']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
