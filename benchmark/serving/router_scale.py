"""Two servers behind SGLang's router against one: sharing kept, workflow throughput, a worker killed.

Four arms, the same workload, one after another (same binary, ``server_arms`` flags and a KV
pool of ``--max-total-tokens`` 40000 per server, so no arm evicts):

    radix x1    one ``--kvcmas-stock-cache`` server, requests straight to it
    kvcmas x1   one ``--kvcmas-share-context`` server
    radix x2    two stock servers behind the router (``sglang_kvcmas.server.cluster.Cluster``)
    kvcmas x2   two sharing servers behind the router

Workload: N concurrent 3-agent debates + M reviewer chains (``workflows.py``), the agents of a
step together; every request of a workflow carries its id in ``X-SMG-Routing-Key`` (the router's
``manual`` policy keeps a key on one worker) and ``X-KVCMAS-Workflow``; ``/generate`` with token
ids, greedy, not streamed.

Measures:

(a) ``router_sharing_ratio`` = (prefill radix x2 - prefill kvcmas x2) / (prefill radix x1 -
    prefill kvcmas x1), prefill = prompt tokens not read from a cache (``prompt_tokens -
    cached_tokens``, summed over turns): 1.0 when the router keeps every workflow's agents
    together. ``workers_share_min`` = the smaller worker's share of the workflows in kvcmas x2,
    from each worker's request log (``split_workflows``: workflows seen by both, must be 0).
(b) ``throughput_2v1`` = workflows per second of kvcmas x2 over kvcmas x1 (makespan ratio).
    Every server runs one CPU thread (the launcher's default), so one server
    computes on one core and two on two; on a 2-core machine the router, the tokenizer
    processes and this client share those cores. ``--pin-cores`` pins worker i to core i.
    Throughput is a saturated server's: the default 24 workflows keep one server busy (with
    the embedded model its workflows per second stop rising between 12 and 24), so each of two
    servers gets 12. With fewer (``--quick``: 6, 3 per server) a server's batches are small,
    the weights it streams every step are shared by fewer requests, and two servers finish
    less than twice the work: the ratio then measures latency at low load, not capacity.
    Each arm records the CPU seconds its schedulers and every other process spent
    (``cpu_s``; cores busy = seconds / makespan), so a ratio below 2 can be told from cores
    the servers did not get.
(c) a kill run on the kvcmas x2 cluster (fresh workflows, every second agent streamed): once a
    third of the kill run's requests have completed, the worker holding most of its workflows is
    SIGKILLed with its process group. Every request is counted once: ``completed`` (a 200 with
    its finish reason; a non-streamed request in flight on the dead worker is retried by the
    router on the other one), ``clear_errors`` (an HTTP error status with a message, or a stream
    the router cut: it ends a stream whose worker died without an error event and without the
    ``data: [DONE]`` that ends every whole SGLang stream, so a client knows only by that missing
    terminator), ``lost`` (no answer within the timeout, or a complete answer without a finish
    reason). A workflow whose turn failed retries that turn once. ``router_out_s``: kill to
    the router marking the worker unhealthy.

Final line::

    ROUTER router_sharing_ratio=<x> workers_share_min=<x> throughput_2v1=<x> kill_sent=<n>
        kill_completed=<n> kill_clear_errors=<n> kill_lost=<n>

    python benchmark/serving/router_scale.py            # 16 debates + 8 chains, 64 tokens
    python benchmark/serving/router_scale.py --quick    # 4 debates + 2 chains, 48 tokens

Writes ``results/router_scale[_quick][_pinned].json`` (every arm summarized, placement, the kill
run's counts) and the servers' logs under ``--out`` (default ``/tmp/<that name>``). ``--model-path``
(``model_arg``) serves one model on every server; the JSON names it, and its name
gets ``_<model>`` for a model other than the embedded one.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from sglang_kvcmas.server.cluster import Cluster, RouterSettings, workflow_headers
from sglang_kvcmas_bench import provenance
from sglang_kvcmas_bench.model_arg import add_model_arg, model_from_args
from sglang_kvcmas_bench.results import record
from sglang_kvcmas_bench.reuse_records import of_meta
from sglang_kvcmas_bench.server_arms import ARMS, COMMON_FLAGS, ArmServer
from sglang_kvcmas_bench.workflows import Workflow, chat_prompt_ids, debate
from sglang_kvcmas_bench.workload_runs import build_workflows

RESULTS = Path(__file__).resolve().parent / "results"
POOL_TOKENS = 40000
REQUEST_TIMEOUT_S = 300.0


def say(text: str) -> None:
    print(f"[router_scale] {text}", file=sys.stderr, flush=True)


def routing_key(flow: Workflow) -> str:
    return f"{flow.kind}-{flow.wid}"


def prompt_ids(tok, flow: Workflow, step: int, agent: str) -> list[int]:
    return chat_prompt_ids(tok, flow.messages(step, agent))


# ----- one request, classified -----------------------------------------------------------------

@dataclass
class Outcome:
    """How one request ended.

    Attributes:
        kind: ``completed``, ``clear_error`` or ``lost``.
        how: what was seen (``200``, ``http 503``, ``stream cut``, ``timeout``, ...).
        text: the generated text ('' unless completed).
        meta: the response's ``meta_info`` ({} unless completed).
        seconds: from sending to the outcome.
    """

    kind: str
    how: str
    text: str = ""
    meta: dict = field(default_factory=dict)
    seconds: float = 0.0


def send(url: str, ids: list[int], max_new: int, key: str, stream: bool = False,
         timeout: float = REQUEST_TIMEOUT_S) -> Outcome:
    """One greedy ``/generate`` with the workflow's headers, never raising."""
    body = {"input_ids": ids, "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **workflow_headers(key)})
    t0 = time.perf_counter()

    def done(kind: str, how: str, last: dict | None = None) -> Outcome:
        last = last or {}
        return Outcome(kind, how, last.get("text", ""), last.get("meta_info", {}),
                       time.perf_counter() - t0)

    last: dict | None = None
    ended = False  # a stream's terminator, data: [DONE]
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if not stream:
                last = json.loads(r.read())
            else:
                for raw in r:
                    line = raw.decode().strip()
                    ended = ended or line == "data: [DONE]"
                    if line.startswith("data:") and line != "data: [DONE]":
                        last = json.loads(line[5:])
                        if "error" in last:
                            return done("clear_error", "stream error event")
    except urllib.error.HTTPError as e:
        message = e.read().decode(errors="replace")
        return done("clear_error" if 400 <= e.code and message.strip() else "lost",
                    f"http {e.code}")
    except (TimeoutError, OSError) as e:
        if "timed out" in str(e):
            return done("lost", "timeout")
        return done("clear_error", f"connection: {type(e).__name__}")
    except http.client.HTTPException as e:  # IncompleteRead: the body was cut
        return done("clear_error", f"stream cut: {type(e).__name__}")
    except ValueError:
        return done("lost", "200 with a body that is not JSON")
    if stream and not ended:  # what the router sends when the worker dies mid-stream
        return done("clear_error", "stream cut: no data: [DONE]")
    finish = ((last or {}).get("meta_info") or {}).get("finish_reason")
    if finish is None or finish.get("type") == "abort":
        return done("lost", "200 without a finish reason", last)
    return done("completed", "200", last)


# ----- a workload ------------------------------------------------------------------------------

def run_flows(url: str, flows: list[Workflow], tok, max_new: int) -> tuple[list[dict], float]:
    """Every workflow concurrently, the agents of a step together; one record per agent turn
    (prompt, cached and borrowed tokens, latency) and the makespan.

    Raises:
        RuntimeError: a turn did not complete (the measured arms must not fail).
    """
    turns: list[dict] = []
    lock = threading.Lock()

    def one_flow(flow: Workflow) -> float:
        t0 = time.perf_counter()
        for step, agents in enumerate(flow.steps):
            ids = {a: prompt_ids(tok, flow, step, a) for a in agents}
            with ThreadPoolExecutor(len(agents)) as pool:
                outs = dict(zip(agents, pool.map(
                    lambda a: send(url, ids[a], max_new, routing_key(flow)), agents)))
            for a, out in outs.items():
                if out.kind != "completed":
                    raise RuntimeError(f"{routing_key(flow)} step {step} {a}: {out.how}")
                with lock:
                    turns.append({"workflow": routing_key(flow), "step": step, "agent": a,
                                  "prompt_tokens": out.meta.get("prompt_tokens", len(ids[a])),
                                  "cached_tokens": out.meta.get("cached_tokens", 0),
                                  "completion_tokens": out.meta.get("completion_tokens", 0),
                                  "borrowed": of_meta(out.meta).get("borrowed", 0),
                                  "served_workflow": served_workflow(out.meta),
                                  "latency_s": out.seconds})
            flow.record(step, {a: outs[a].text for a in agents})
        return time.perf_counter() - t0

    with ThreadPoolExecutor(len(flows)) as pool:
        spans = list(pool.map(one_flow, flows))
    return turns, max(spans)


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """User + system CPU seconds of every process on the machine, by pid (name, seconds)."""
    out = {}
    for proc in psutil.process_iter(["name"]):
        try:
            t = proc.cpu_times()
            out[proc.pid] = (proc.info["name"], t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
             wall_s: float) -> dict[str, float]:
    """CPU seconds spent between two :func:`cpu_seconds` snapshots: the schedulers (the model's
    forward passes), every other process together (router, tokenizer and detokenizer
    processes, this client, the system), and the wall time they ran in."""
    sched = other = 0.0
    for pid, (name, t) in after.items():
        spent = t - before.get(pid, (name, 0.0))[1]
        if name == "sglang::scheduler":
            sched += spent
        else:
            other += spent
    return {"schedulers": round(sched, 1), "other": round(other, 1), "wall": round(wall_s, 1)}


def run_measured(url: str, flows: list[Workflow], tok, max_new: int
                 ) -> tuple[list[dict], float, dict[str, float]]:
    """:func:`run_flows` with the CPU seconds it cost (:func:`cpu_used`)."""
    before = cpu_seconds()
    turns, makespan = run_flows(url, flows, tok, max_new)
    return turns, makespan, cpu_used(before, cpu_seconds(), makespan)


def prefill_tokens(turns: list[dict]) -> int:
    """Prompt tokens computed (not read from any cache), over ``turns``."""
    return sum(t["prompt_tokens"] - t["cached_tokens"] for t in turns)


def worker_shares(placement: list[Counter], keys: set[str]) -> tuple[list[float], list[str]]:
    """Each worker's share of the workflows ``keys``, and the workflows seen by more than one."""
    owners: dict[str, set[int]] = {}
    for i, counts in enumerate(placement):
        for key in counts:
            if key in keys:
                owners.setdefault(key, set()).add(i)
    split = sorted(k for k, ws in owners.items() if len(ws) > 1)
    shares = [sum(1 for ws in owners.values() if i in ws) / max(1, len(keys))
              for i in range(len(placement))]
    return shares, split


# ----- the kill run ----------------------------------------------------------------------------

@dataclass
class KillCounts:
    """The kill run's requests and workflows.

    Attributes:
        sent, completed, clear_errors, lost: requests (a retried turn counts twice).
        how: what each request ended with (``Outcome.how``), counted.
        flows, finished_flows: workflows started and finished (every turn completed).
        victim: the index of the killed worker; victim_flows: the workflows it held.
        moved_flows: those of ``victim_flows`` that sent a request after the router took the
            victim out (a workflow can finish before the kill: it then never moves).
        router_out_s: kill to the router reporting the worker unhealthy (None: never).
        router_tries_on_victim: requests the router sent to the dead worker (each failed and
            was retried or answered with an error; from the router's log).
        lost_notes: what each lost request was.
    """

    sent: int = 0
    completed: int = 0
    clear_errors: int = 0
    lost: int = 0
    how: Counter = field(default_factory=Counter)
    flows: int = 0
    finished_flows: int = 0
    victim: int | None = None
    victim_flows: list[str] = field(default_factory=list)
    moved_flows: list[str] = field(default_factory=list)
    router_out_s: float | None = None
    router_tries_on_victim: int = 0
    lost_notes: list[str] = field(default_factory=list)

    def count(self, out: Outcome, what: str) -> None:
        self.sent += 1
        self.how[out.how] += 1
        if out.kind == "completed":
            self.completed += 1
        elif out.kind == "clear_error":
            self.clear_errors += 1
        else:
            self.lost += 1
            self.lost_notes.append(f"{what}: {out.how} after {out.seconds:.0f} s")


def served_workflow(meta: dict) -> str | None:
    """The workflow the server reported for a request (from the routing key behind the
    router)."""
    rec = (meta or {}).get("kvcmas_reuse")
    rec = rec[0] if isinstance(rec, list) and rec else rec
    return rec.get("workflow") if isinstance(rec, dict) else None


def kill_run(cluster: Cluster, flows: list[Workflow], tok, max_new: int,
             kill_after: int) -> KillCounts:
    """Run ``flows`` through ``cluster`` and SIGKILL one worker once ``kill_after`` requests
    have completed; see the module docstring, (c)."""
    counts = KillCounts(flows=len(flows))
    lock = threading.Lock()
    completed = threading.Event()
    taken_out = threading.Event()
    sent_after_out: set[str] = set()
    keys = {routing_key(f) for f in flows}

    def turn(flow: Workflow, step: int, agent: str, ids: list[int]) -> Outcome:
        stream = flow.steps[step].index(agent) % 2 == 1
        for attempt in range(2):
            if taken_out.is_set():
                with lock:
                    sent_after_out.add(routing_key(flow))
            out = send(cluster.url, ids, max_new, routing_key(flow), stream=stream)
            with lock:
                counts.count(out, f"{routing_key(flow)} step {step} {agent} try {attempt}")
                if counts.completed >= kill_after:
                    completed.set()
            if out.kind != "clear_error":
                return out
            time.sleep(1.0)  # the router takes a dead worker out within about 2 s
        return out

    def one_flow(flow: Workflow) -> bool:
        for step, agents in enumerate(flow.steps):
            ids = {a: prompt_ids(tok, flow, step, a) for a in agents}
            with ThreadPoolExecutor(len(agents)) as pool:
                outs = dict(zip(agents, pool.map(lambda a: turn(flow, step, a, ids[a]),
                                                 agents)))
            if any(o.kind != "completed" for o in outs.values()):
                return False
            flow.record(step, {a: outs[a].text for a in agents})
        return True

    def killer() -> None:
        completed.wait()
        placement = cluster.placement()
        held = [sum(n > 0 for k, n in c.items() if k in keys) for c in placement]
        counts.victim = max(range(len(held)), key=lambda i: held[i])
        counts.victim_flows = sorted(k for k in placement[counts.victim] if k in keys)
        victim_url = cluster.worker_urls[counts.victim]
        say(f"killing worker {counts.victim} ({victim_url}, workflows "
            f"{counts.victim_flows}) after {counts.completed} completed requests")
        t0 = time.monotonic()
        cluster.kill_worker(counts.victim)
        while time.monotonic() - t0 < 60:
            if victim_url not in cluster.healthy_workers():
                counts.router_out_s = time.monotonic() - t0
                taken_out.set()
                break
            time.sleep(0.1)

    def tries_on_victim() -> int:
        victim_url = cluster.worker_urls[counts.victim]
        log = (cluster.log_dir / "router.log").read_text(errors="replace")
        at_victim = re.compile(re.escape(victim_url) + r"(?!\d)")
        return sum("Failed to send" in line and bool(at_victim.search(line))
                   for line in log.splitlines())

    kill_thread = threading.Thread(target=killer, daemon=True)
    kill_thread.start()
    with ThreadPoolExecutor(len(flows)) as pool:
        counts.finished_flows = sum(pool.map(one_flow, flows))
    completed.set()
    kill_thread.join(timeout=120)
    counts.moved_flows = sorted(set(counts.victim_flows) & sent_after_out)
    if counts.victim is not None:
        counts.router_tries_on_victim = tries_on_victim()
    return counts


# ----- the benchmark ---------------------------------------------------------------------------

def arm_flags(arm: str, model_args: list[str] | None = None) -> list[str]:
    """One cluster worker's flags (``model_args``: the launcher's ``--model-path``, default the
    embedded model)."""
    return [*ARMS[arm][1], *COMMON_FLAGS, *(model_args or []), "--max-total-tokens",
            str(POOL_TOKENS)]


def measure_single(arm: str, out: Path, flows_fn, tok, max_new: int,
                   model_args: list[str] | None = None) -> dict:
    with ArmServer(arm, out / f"server_{arm}_x1.log",
                   [*(model_args or []), "--max-total-tokens", str(POOL_TOKENS)]) as server:
        send(server.url, tok.encode("Warm up."), 4, "warm-up")
        turns, makespan, cpu = run_measured(server.url, flows_fn(), tok, max_new)
    return {"arm": f"{arm}_x1", "turns": len(turns), "makespan_s": makespan, "cpu_s": cpu,
            "prefill_tokens": prefill_tokens(turns),
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns)}


def measure_cluster(arm: str, out: Path, flows_fn, tok, max_new: int, pin: bool,
                    kill: dict | None = None,
                    model_args: list[str] | None = None) -> tuple[dict, KillCounts | None]:
    with Cluster(workers=2, worker_args=arm_flags(arm, model_args), log_dir=out / f"cluster_{arm}",
                 request_log=True, pin_cores=pin,
                 settings=RouterSettings(log_level="info")) as cluster:
        say(f"{arm} x2 up: router {cluster.url} -> {cluster.worker_urls}")
        for i, wurl in enumerate(cluster.worker_urls):
            send(wurl, tok.encode("Warm up."), 4, f"warm-up-{i}")
        flows = flows_fn()
        turns, makespan, cpu = run_measured(cluster.url, flows, tok, max_new)
        keys = {routing_key(f) for f in flows}
        placement = cluster.placement()
        shares, split = worker_shares(placement, keys)
        summary = {"arm": f"{arm}_x2", "turns": len(turns), "makespan_s": makespan, "cpu_s": cpu,
                   "prefill_tokens": prefill_tokens(turns),
                   "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
                   "worker_shares": shares, "split_workflows": split,
                   "placement": [{k: n for k, n in c.items() if k in keys} for c in placement]}
        counts = None
        if kill is not None:
            counts = kill_run(cluster, kill["flows"](), tok, kill["max_new"], kill["after"])
    return summary, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 debates + 2 chains, 48 tokens")
    ap.add_argument("--debates", type=int, default=16)
    ap.add_argument("--chains", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--kill-debates", type=int, default=6,
                    help="2-round debates of the kill run")
    ap.add_argument("--pin-cores", action="store_true", help="pin worker i to core i")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the servers' logs (default /tmp/<results name>)")
    add_model_arg(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.debates, args.chains, args.max_new_tokens, args.kill_debates = 4, 2, 48, 4
    model = model_from_args(ap, args)
    name = model.named(Path("router_scale" + ("_quick" if args.quick else "")
                            + ("_pinned" if args.pin_cores else ""))).name
    logs = args.out or Path("/tmp") / name
    logs.mkdir(parents=True, exist_ok=True)
    from sglang_kvcmas_examples.datasets import gsm8k

    tok = model.tokenizer()
    questions = gsm8k()

    def flows_fn() -> list[Workflow]:
        return build_workflows(args.debates, args.chains)

    kill = {"flows": lambda: [debate(500 + i, questions[200 + i].question, rounds=2)
                              for i in range(args.kill_debates)],
            "max_new": args.max_new_tokens,
            "after": args.kill_debates * 3 * 2 // 3}
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    arms: dict[str, dict] = {}
    for arm in ("radix", "kvcmas"):
        arms[f"{arm}_x1"] = measure_single(arm, logs, flows_fn, tok, args.max_new_tokens,
                                           model.server_args)
        say(f"{arm} x1: {arms[f'{arm}_x1']['makespan_s']:.1f} s, prefill "
            f"{arms[f'{arm}_x1']['prefill_tokens']} ({time.perf_counter() - t_start:.0f} s)")
    arms["radix_x2"], _ = measure_cluster("radix", logs, flows_fn, tok, args.max_new_tokens,
                                          args.pin_cores, model_args=model.server_args)
    say(f"radix x2: {arms['radix_x2']['makespan_s']:.1f} s ({time.perf_counter() - t_start:.0f} s)")
    arms["kvcmas_x2"], counts = measure_cluster("kvcmas", logs, flows_fn, tok,
                                                args.max_new_tokens, args.pin_cores, kill,
                                                model.server_args)
    say(f"kvcmas x2: {arms['kvcmas_x2']['makespan_s']:.1f} s, kill run done "
        f"({time.perf_counter() - t_start:.0f} s)")

    saved_x1 = arms["radix_x1"]["prefill_tokens"] - arms["kvcmas_x1"]["prefill_tokens"]
    saved_x2 = arms["radix_x2"]["prefill_tokens"] - arms["kvcmas_x2"]["prefill_tokens"]
    ratio = saved_x2 / saved_x1 if saved_x1 else float("nan")
    share_min = min(arms["kvcmas_x2"]["worker_shares"])
    flows_n = args.debates + args.chains
    thr = arms["kvcmas_x1"]["makespan_s"] / arms["kvcmas_x2"]["makespan_s"]
    thr_radix = arms["radix_x1"]["makespan_s"] / arms["radix_x2"]["makespan_s"]
    commit = provenance.commit()
    machine = provenance.machine()
    result = {
        "command": "python benchmark/serving/router_scale.py " + " ".join(sys.argv[1:] if argv
                                                                           is None else argv),
        "commit": commit, "machine": machine, "model": model.name, "debates": args.debates, "chains": args.chains,
        "max_new_tokens": args.max_new_tokens, "pool_tokens": POOL_TOKENS,
        "pin_cores": args.pin_cores, "seconds": round(time.perf_counter() - t_start, 1),
        "load_average_1_5_15": {"start": load_start, "end": os.getloadavg()},
        "arms": arms, "prefill_saved_x1": saved_x1, "prefill_saved_x2": saved_x2,
        "prefill_saved_share_x1": saved_x1 / arms["radix_x1"]["prefill_tokens"],
        "prefill_saved_share_x2": saved_x2 / arms["radix_x2"]["prefill_tokens"],
        "router_sharing_ratio": ratio, "workers_share_min": share_min,
        "workflows_per_s": {a: flows_n / s["makespan_s"] for a, s in arms.items()},
        "throughput_2v1": thr, "throughput_2v1_radix": thr_radix,
        "kill": {**asdict(counts), "how": dict(counts.how)},
    }
    headline = (f"ROUTER router_sharing_ratio={ratio:.2f} workers_share_min={share_min:.2f} "
                f"throughput_2v1={thr:.2f} kill_sent={counts.sent} "
                f"kill_completed={counts.completed} kill_clear_errors={counts.clear_errors} "
                f"kill_lost={counts.lost}")
    record(RESULTS / f"{name}.json", json.dumps(result, indent=1),
           what=f"two servers behind SGLang's router against one, {args.debates} debates + "
                f"{args.chains} chains ({args.max_new_tokens} tokens, pool {POOL_TOKENS} per "
                f"server, {model.name}), and a server killed mid-run: `{headline}`; "
                f"{result['seconds']:.0f} s")
    print(f"{'arm':<10} {'makespan s':>10} {'prefill':>8} {'prompt':>8} {'sched cores':>11} "
          f"{'other cores':>11}  workers' shares")
    for a, s in arms.items():
        cpu = s["cpu_s"]
        print(f"{a:<10} {s['makespan_s']:>10.1f} {s['prefill_tokens']:>8} {s['prompt_tokens']:>8} "
              f"{cpu['schedulers'] / cpu['wall']:>11.2f} {cpu['other'] / cpu['wall']:>11.2f}  "
              f"{s.get('worker_shares', '-')}")
    print(f"prefill saved by sharing: one server {saved_x1} "
          f"({result['prefill_saved_share_x1']:.0%} of radix's), two behind the router "
          f"{saved_x2} ({result['prefill_saved_share_x2']:.0%}); split workflows "
          f"{arms['kvcmas_x2']['split_workflows']}")
    print(f"workflows/s kvcmas x2 over x1 {thr:.2f} (radix {thr_radix:.2f}); {machine}, one CPU "
          f"thread per server{', worker i pinned to core i' if args.pin_cores else ''}")
    print(f"kill run: victim worker {counts.victim} held {counts.victim_flows}; router took it "
          f"out after {counts.router_out_s} s; it sent {counts.router_tries_on_victim} requests "
          f"to the dead worker; outcomes {dict(counts.how)}; {counts.finished_flows} of "
          f"{counts.flows} workflows finished; lost: {counts.lost_notes or 'none'}")
    print(headline)
    say(f"total {time.perf_counter() - t_start:.0f} s; logs in {logs}")
    return 0 if counts.lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
