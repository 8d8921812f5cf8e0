"""Several servers behind SGLang's gateway SMG (``sglang_kvcmas.server.cluster``).

The gateway's contract first, against two stub workers (no model, a few seconds): a routing key
stays on one worker and keys spread over both; of our headers only ``X-SMG-Routing-Key`` and
``Authorization`` reach a worker, the body keeps ``custom_params`` and ``cache_salt``; with
tenant keys any other key is refused; a dead worker's keys move. Then two CPU sharing servers
behind the gateway (one boot for the module; the kill test runs last): every request of a
workflow lands on one server, workflows spread over both, readers there read the leader's KV; one
server SIGKILLed mid-run: the gateway takes it out, every request is answered or fails clearly,
none is lost, the other server's workflows finish. Tenant isolation with real servers: one server
in ``test_shared_server.py``, through the gateway ``benchmark/serving/isolation.py``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers.bench_scripts import load_script
from sglang_kvcmas.server.cluster import (
    ROUTING_KEY_HEADER,
    Cluster,
    RouterSettings,
    Tenants,
    cluster_from_args,
    free_ports,
    router_process,
    router_workers,
    wait_for_workers,
    workflow_headers,
)

pytest.importorskip("smg")


def test_clients_send_the_workflow_in_the_routers_header_too():
    assert ROUTING_KEY_HEADER.lower() == "x-smg-routing-key"
    assert workflow_headers("w") == {"X-SMG-Routing-Key": "w", "X-KVCMAS-Workflow": "w"}


def test_command_line_gives_every_other_argument_to_every_server():
    c = cluster_from_args(["--workers", "3", "--port", "31500", "--kvcmas-share-context",
                           "--max-total-tokens", "4096", "--pin-cores"])
    assert (c.workers, c.port, c.pin_cores, c.request_log) == (3, 31500, True, False)
    assert c.worker_args == ["--kvcmas-share-context", "--max-total-tokens", "4096"]
    assert "--policy" in RouterSettings().argv() and "manual" in RouterSettings().argv()
    assert "--disable-worker-overload-protection" in RouterSettings().argv()


def test_tenants_are_checked_and_refused_where_they_could_not_hold(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# tenants\nacme: k-1\n\nglobex:k-2\n")
    t = Tenants.from_file(keys)
    assert t.keys == {"acme": "k-1", "globex": "k-2"} and t.headers("acme") == {
        "Authorization": "Bearer k-1"}
    assert t.argv()[:4] == ["--tenant-api-key", "acme:k-1", "--tenant-api-key", "globex:k-2"]
    assert t.control_key not in t.keys.values() and Tenants().argv() == []
    with pytest.raises(ValueError, match="share an API key"):
        Tenants({"a": "k", "b": "k"})
    keys.write_text("a:k\na:j\n")
    with pytest.raises(ValueError, match="keys.txt:2"):
        Tenants.from_file(keys)
    for api_key in (["--api-key", "x"], ["--api-key=x"]):
        with pytest.raises(ValueError, match="--api-key"):
            Cluster(worker_args=api_key, tenants=Tenants({"a": "k"}), log_dir=tmp_path).start()


# ----- the router's contract, against stub workers ---------------------------------------------

class StubWorker:
    """An HTTP server that answers what the gateway asks a worker (SGLang's info routes and
    ``/v1/models``) and records each POST it receives (headers, path, body), answering after
    ``delay_s`` once ``gate`` is open (it is unless a test closes it, to hold requests in
    flight)."""

    def __init__(self, port: int, delay_s: float = 0.2):
        self.port, self.received = port, []
        self.gate = threading.Event()
        self.gate.set()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, out: dict) -> None:
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.startswith("/v1/models"):
                    return self._answer({"object": "list", "data": [
                        {"id": "stub", "object": "model", "owned_by": "stub", "root": "stub"}]})
                self._answer({"model_path": "stub", "tokenizer_path": "stub",
                              "served_model_name": "stub", "is_generation": True, "dp_size": 1})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                stub.gate.wait(timeout=60)
                time.sleep(delay_s)
                if "chat" in self.path:
                    return self._answer({
                        "id": "c", "object": "chat.completion", "created": 0, "model": "stub",
                        "choices": [{"index": 0, "finish_reason": "stop", "message": {
                            "role": "assistant", "content": "ok"}}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                  "total_tokens": 2}, "port": stub.port})
                self._answer({"text": "ok", "port": stub.port,
                              "meta_info": {"finish_reason": {"type": "stop"}}})

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def post(url: str, body: dict, headers: dict, path: str = "/generate") -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


TENANTS = Tenants({"acme": "key-acme", "globex": "key-globex"})


@pytest.fixture(params=[None, TENANTS], ids=["open", "tenants"])
def stub_router(tmp_path, request):
    tenants = request.param
    router_port, *ports = free_ports(3, 32000, 32999)
    stubs = [StubWorker(p) for p in ports]
    router = router_process([s.url for s in stubs], router_port, tmp_path / "router.log",
                            RouterSettings(log_level="info"), tenants)
    try:
        router.start()
        wait_for_workers(router.url, 2, timeout_s=60, tenants=tenants)
        yield router.url, stubs, tenants
    finally:
        router.stop()
        for s in stubs:
            s.close()


def key_headers(tenants: Tenants | None, key: str, tenant: str = "acme") -> dict[str, str]:
    return {**workflow_headers(key), **(tenants.headers(tenant) if tenants else {})}


def test_router_keeps_a_key_on_one_worker_and_spreads_keys(stub_router):
    url, stubs, tenants = stub_router
    keys = [f"wf-{i}" for i in range(8)]
    # min_group: a new key goes to the worker with the fewest keys in flight (equal counts: at
    # random). Each key's first request is sent once every earlier one is held in flight at a
    # worker, so the split is 4/4 whatever the timing of this machine.
    for s in stubs:
        s.gate.clear()
    first: dict[str, int] = {}

    def send_first(key: str) -> None:
        first[key] = post(url, {"input_ids": [1, 2, 3]}, key_headers(tenants, key))["port"]

    threads = []
    for i, key in enumerate(keys):
        threads.append(threading.Thread(target=send_first, args=(key,), daemon=True))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while sum(len(s.received) for s in stubs) < i + 1:
            assert time.monotonic() < deadline, f"{key} never reached a worker"
            time.sleep(0.01)
    for s in stubs:
        s.gate.set()
    for t in threads:
        t.join(timeout=60)
    assert sorted(first) == sorted(keys), first

    def later(key: str) -> set[int]:  # the key's next requests, with nothing else in flight
        return {post(url, {"input_ids": [1, 2, 3]}, key_headers(tenants, key))["port"]
                for _ in range(2)}

    with ThreadPoolExecutor(len(keys)) as pool:
        ports = {k: p | {first[k]} for k, p in zip(keys, pool.map(later, keys))}
    assert all(len(p) == 1 for p in ports.values()), ports
    per_worker = [sum(p == {s.port} for p in ports.values()) for s in stubs]
    assert per_worker == [4, 4], per_worker


def test_a_new_keys_concurrent_first_requests_reach_one_worker(stub_router):
    """A workflow's agents send their first requests together: the policy must pin the key
    once (SMG's sticky sessions over ``cache_aware`` split most such keys)."""
    url, _stubs, tenants = stub_router
    got: dict[str, list[int]] = {}
    lock = threading.Lock()

    def send(key: str) -> None:
        port = post(url, {"input_ids": [1, 2, 3]}, key_headers(tenants, key))["port"]
        with lock:
            got.setdefault(key, []).append(port)

    with ThreadPoolExecutor(18) as pool:
        list(pool.map(send, [f"new-{k}" for k in range(6) for _ in range(3)]))
    assert all(len(set(ports)) == 1 for ports in got.values()), got


def test_gateway_forwards_our_fields_the_salt_and_the_credential(stub_router):
    """What reaches a worker through SMG 1.13: the body's ``custom_params`` and ``cache_salt``,
    the routing key and the credential; not our workflow header, nor a forged tenant header.
    With tenant keys, a request with any other key (or none) is refused there."""
    url, stubs, tenants = stub_router
    custom = {"kvcmas_workflow": "wf-x", "kvcmas_exact": True}
    headers = {**key_headers(tenants, "wf-x"), "X-SMG-Tenant-Id": "globex"}
    post(url, {"input_ids": [1, 2, 3], "cache_salt": "s-1", "rid": "r-1",
               "sampling_params": {"max_new_tokens": 4, "custom_params": custom}}, headers)
    post(url, {"model": "stub", "max_tokens": 4, "cache_salt": "s-1", "custom_params": custom,
               "messages": [{"role": "user", "content": "hi"}]}, headers,
         path="/v1/chat/completions")
    (gen_headers, gen), (chat_headers, chat) = [r for s in stubs for r in s.received]
    for h in (gen_headers, chat_headers):
        assert h["x-smg-routing-key"] == "wf-x"
        assert "x-kvcmas-workflow" not in h and "x-smg-tenant-id" not in h
        assert h.get("authorization") == (f"Bearer {TENANTS.keys['acme']}" if tenants else None)
    assert gen["input_ids"] == [1, 2, 3] and gen["rid"] == "r-1" and gen["cache_salt"] == "s-1"
    assert gen["sampling_params"]["custom_params"] == custom
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["custom_params"] == custom and chat["cache_salt"] == "s-1"
    if tenants:
        for bad in ({}, {"Authorization": "Bearer key-nobody"},
                    {"Authorization": f"Bearer {tenants.control_key}"}):
            with pytest.raises(urllib.error.HTTPError) as e:
                post(url, {"input_ids": [1]}, {**workflow_headers("wf-x"), **bad})
            assert e.value.code == 401
        assert len([r for s in stubs for r in s.received]) == 2  # none reached a worker


def test_router_moves_a_dead_workers_keys(stub_router):
    url, stubs, tenants = stub_router
    first = {k: post(url, {"input_ids": [1]}, key_headers(tenants, k))["port"]
             for k in ("a", "b", "c", "d", "e", "f")}
    dead = stubs[0]
    dead.close()
    t0 = time.monotonic()
    after = {k: post(url, {"input_ids": [1]}, key_headers(tenants, k))["port"] for k in first}
    assert time.monotonic() - t0 < 10
    assert all(p != dead.port for p in after.values()), after
    assert all(after[k] == p for k, p in first.items() if p != dead.port)  # the others stay
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len([w for w in router_workers(url, tenants)
                                               if w["is_healthy"]]) != 1:
        time.sleep(0.2)
    assert [w["url"] for w in router_workers(url, tenants) if w["is_healthy"]] == [stubs[1].url]


# ----- two sharing servers behind the router ---------------------------------------------------

CLUSTER_FLAGS = ["--kvcmas-share-context", "--max-total-tokens", "4096",
                 "--chunked-prefill-size", "256", "--mem-fraction-static", "0.3"]
"""The sharing fixture's flags (``conftest.SHARING_FLAGS``) and the benchmark arms' memory
fraction (``server_arms.COMMON_FLAGS``): with two servers on the host, the launcher's 0.1 left
one of them too little to size its pool."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(workers=2, worker_args=CLUSTER_FLAGS, request_log=True,
                log_dir=tmp_path_factory.mktemp("kvcmas-cluster"), boot_timeout_s=400)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def tok():
    from sglang_kvcmas.models.resolve import resolve_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_path(None)))


def debates(first: int, n: int, rounds: int = 2) -> list:
    """``n`` debates of ``rounds`` rounds, each question followed by about 300 tokens of other
    questions, so the agents of the first round share a transcript long enough to borrow."""
    from sglang_kvcmas_bench.workflows import debate
    from sglang_kvcmas_examples.datasets import gsm8k

    items = gsm8k()
    return [debate(first + i, items[first + i].question + "\n\nOther questions: " + " ".join(
        items[100 + first + i + j].question for j in range(5)), rounds=rounds) for i in range(n)]


@pytest.mark.server
@pytest.mark.slow
def test_a_workflow_stays_on_one_server(cluster, tok):
    rs = load_script("benchmark/serving/router_scale.py")

    for i, url in enumerate(cluster.worker_urls):  # every agent's head cached on both
        for flow in debates(90, 1):
            for agent in flow.steps[0]:
                rs.send(url, rs.prompt_ids(tok, flow, 0, agent), 1, f"warm-up-{i}")
    flows = debates(0, 4)
    turns, _ = rs.run_flows(cluster.url, flows, tok, max_new=16)
    keys = {rs.routing_key(f) for f in flows}
    placement = cluster.placement()
    shares, split = rs.worker_shares(placement, keys)
    assert not split, placement
    assert all(sum(c[k] for c in placement) == 6 for k in keys), placement  # 3 agents x 2 rounds
    assert min(shares) >= 0.25, (shares, placement)
    # the agents of a workflow, all on one server, read the KV one of them computed
    borrowed = {t["workflow"] for t in turns if t["borrowed"] > 0}
    assert borrowed == keys, (borrowed, turns)
    # the router forwards only its routing key: the server takes it as the workflow id
    assert all(t["served_workflow"] == t["workflow"] for t in turns), turns


@pytest.mark.server
@pytest.mark.slow
def test_a_killed_server_is_taken_out_and_nothing_is_lost(cluster, tok):
    """Runs last: it kills one of the module's servers."""
    rs = load_script("benchmark/serving/router_scale.py")

    flows = debates(20, 4, rounds=3)  # a third round: the victim's workflows go on after the kill
    counts = rs.kill_run(cluster, flows, tok, max_new=32, kill_after=6)
    print(counts)
    assert counts.victim is not None and counts.victim_flows
    assert counts.lost == 0, counts.lost_notes
    assert counts.sent == counts.completed + counts.clear_errors
    assert counts.router_out_s is not None and counts.router_out_s < 10
    assert counts.finished_flows == counts.flows  # a failed turn is retried once and completes
    survivor = 1 - counts.victim
    assert cluster.healthy_workers() == [cluster.worker_urls[survivor]]
    # the victim's workflows that went on after the router took it out went on on the survivor
    assert counts.moved_flows, counts
    assert all(k in cluster.placement()[survivor] for k in counts.moved_flows), counts

