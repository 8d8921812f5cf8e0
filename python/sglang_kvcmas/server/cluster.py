"""Several sglang-kvcmas servers behind SGLang's router, every workflow's requests on one of them.

    python -m sglang_kvcmas.server.cluster --workers 2 --port 30000 --kvcmas-share-context

starts N servers (our launcher, every one with the same flags, on 127.0.0.1 and the ports after
the router's) and SGLang's router (PyPI ``sglang-router`` 0.3.2, a Rust load balancer) in front
of them, waits until the router reports every worker healthy, and stops them all on SIGINT or
SIGTERM. Clients talk to the router's port as to one server.

Placement. Agents share KV only inside one server, so every request of a workflow must reach the
same one. The router's ``manual`` policy keeps each routing key, the ``X-SMG-Routing-Key`` header,
on the worker it first sent it to; a new key goes to the worker with the fewest keys in flight
(``--assignment-mode min_group``; with equal counts, e.g. nothing in flight, to either at random);
a key moves only when its worker is unhealthy, and then stays on its new worker. The router hashes or reads no other header (its ``consistent_hashing`` policy,
not offered by its command line, reads the same one), so clients send the workflow id in
``X-SMG-Routing-Key`` (:func:`workflow_headers`), which the server also takes as the workflow id
when ``X-KVCMAS-Workflow`` (not forwarded) is absent.

What the router passes on (0.3.2; checked in ``test/server/test_cluster.py``): of the request
headers only ``authorization``, ``x-request-id*``, ``x-correlation-id``, ``traceparent``,
``tracestate`` and ``x-smg-routing-key``, so not ``X-KVCMAS-Workflow``; and it rebuilds the
``/generate`` and ``/v1/chat/completions`` bodies from its own request types, dropping
``custom_params`` (every ``kvcmas_*`` field) and ``cache_salt`` (and a chat request's ``rid``).
Behind the router, agents are told apart by ChatML detection only, and every tenant is in one
namespace (``cache_salt`` isolation does not hold). Responses come back unchanged (``meta_info.kvcmas_reuse``, OpenAI usage).

Failures (:class:`RouterSettings`): the router asks every worker's ``/health`` each second (our
servers answer it without running the model) and takes a worker out after two failures; a request
whose worker refuses the connection, or dies before answering, is retried on the worker the
policy picks then, and a worker's circuit breaker opens after three failed requests, so retries
leave a dead worker at once. A stream already under way cannot be retried: when its worker dies
the router ends it without an error event and without ``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sglang_kvcmas.server.process import HOST, ServerProcess, ServerStartError, free_port

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""The header the router's ``manual`` (and ``consistent_hashing``) policy routes by."""
WORKFLOW_HEADER = "X-KVCMAS-Workflow"
"""Our workflow header (``policy/request_options.py``); the router does not forward it."""
ROUTER_MODULE = "sglang_router.launch_router"
WORKER_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
"""Every worker answers the router's ``/health`` checks without running the model. By default
each check queues a one-token generation (51 per worker in two idle minutes at one check a
second) and waits up to 20 s for the scheduler's next output, longer than the router's 5 s check
timeout behind a long CPU prefill, which would take a busy, healthy worker out and move its
workflows. A killed worker still fails at once (connection refused); ``/health_generate`` still
runs the model."""
REQUEST_LOG_DIR = "requests"
"""Under a worker's log folder: SGLang's request log (``--log-requests-target``), one JSON line
per request with the ``x-smg-routing-key`` header it came with (``request_log``)."""


def workflow_headers(workflow: str) -> dict[str, str]:
    """The headers a client sends with every request of one workflow (through the router or
    straight to a server)."""
    return {ROUTING_KEY_HEADER: workflow, WORKFLOW_HEADER: workflow}


@dataclass(frozen=True)
class RouterSettings:
    """The router's command line: policy, health checks, circuit breaker, retries.

    Attributes:
        policy: ``manual`` (sticky by ``X-SMG-Routing-Key``); the router's others are
            ``random``, ``round_robin``, ``cache_aware`` and ``power_of_two``.
        assignment_mode: where ``manual`` puts a new key: ``min_group`` (the worker with the
            fewest keys in flight), ``min_load`` (fewest requests) or ``random``.
        health_check_interval_s: seconds between ``/health`` checks of each worker.
        health_failure_threshold: failed checks in a row that take a worker out.
        health_check_timeout_s: seconds a check waits.
        cb_failure_threshold: failed requests that open a worker's circuit breaker.
        cb_timeout_s: seconds an open breaker waits before it lets one request try again.
        retry_max_retries: attempts per request (the first included).
        request_timeout_s: longest a request may take end to end.
        log_level: the router's log level.
    """

    policy: str = "manual"
    assignment_mode: str = "min_group"
    health_check_interval_s: int = 1
    health_failure_threshold: int = 2
    health_check_timeout_s: int = 5
    cb_failure_threshold: int = 3
    cb_timeout_s: int = 30
    retry_max_retries: int = 5
    request_timeout_s: int = 1800
    log_level: str = "warn"

    def argv(self) -> list[str]:
        out = ["--policy", self.policy,
               "--health-check-interval-secs", str(self.health_check_interval_s),
               "--health-failure-threshold", str(self.health_failure_threshold),
               "--health-check-timeout-secs", str(self.health_check_timeout_s),
               "--cb-failure-threshold", str(self.cb_failure_threshold),
               "--cb-timeout-duration-secs", str(self.cb_timeout_s),
               "--retry-max-retries", str(self.retry_max_retries),
               "--request-timeout-secs", str(self.request_timeout_s),
               "--log-level", self.log_level]
        if self.policy == "manual":
            out += ["--assignment-mode", self.assignment_mode]
        return out


def free_ports(n: int, start: int = 30000, end: int = 31000) -> list[int]:
    """``n`` distinct free ports in ``[start, end)``, lowest first."""
    ports: list[int] = []
    for _ in range(n):
        ports.append(free_port(ports[-1] + 1 if ports else start, end, spread=False))
    return ports


def _get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def router_process(worker_urls: list[str], port: int, log_path: Path,
                   settings: RouterSettings = RouterSettings()) -> ServerProcess:
    """The router in front of ``worker_urls``, as a process to :meth:`~ServerProcess.start`
    (its ``/health`` answers once it listens; :func:`wait_for_workers` then waits for the
    workers)."""
    return ServerProcess(args=["--worker-urls", *worker_urls, *settings.argv()],
                         log_path=log_path, port=port, boot_timeout_s=120.0,
                         module=ROUTER_MODULE)


def router_workers(url: str) -> list[dict]:
    """The router's view of its workers (``GET /workers``: url, is_healthy, load), or [] when
    the router does not answer."""
    try:
        return list(_get_json(f"{url}/workers").get("workers", []))
    except (urllib.error.URLError, OSError, ValueError):
        return []


def wait_for_workers(url: str, n: int, timeout_s: float = 120.0) -> None:
    """Block until the router at ``url`` reports ``n`` healthy workers.

    Raises:
        ServerStartError: not within ``timeout_s`` (the message has what it reports).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(bool(w.get("is_healthy")) for w in router_workers(url)) == n:
            return
        time.sleep(0.5)
    raise ServerStartError(f"the router at {url} did not report {n} healthy workers in "
                           f"{timeout_s:.0f} s; it reports {router_workers(url)}")


@dataclass
class Cluster:
    """N servers and the router. Use as a context manager, or call :meth:`start` / :meth:`stop`.

    Attributes:
        workers: how many servers.
        worker_args: launcher/SGLang flags of every server (``--port`` and ``--host`` added).
        log_dir: ``router.log``, ``worker<i>.log`` and, with ``request_log``, each worker's
            request log under ``worker<i>/requests/``.
        port: the router's port (a free one in 30000–30999 when None); the workers take the
            free ports after it.
        settings: the router's policy, health checks and retries.
        request_log: have every worker log each request's routing key (SGLang's
            ``--log-requests``, metadata only), for :meth:`placement`.
        pin_cores: run worker ``i`` on core ``i mod cores`` only (the router on any).
        env: extra environment variables for every server.
        boot_timeout_s: how long each server may take to become healthy.
    """

    workers: int = 2
    worker_args: list[str] = field(default_factory=list)
    log_dir: Path = Path("sglang-kvcmas-cluster")
    port: int | None = None
    settings: RouterSettings = RouterSettings()
    request_log: bool = False
    pin_cores: bool = False
    env: dict[str, str] = field(default_factory=dict)
    boot_timeout_s: float = 400.0
    servers: list[ServerProcess] = field(default_factory=list, init=False)
    router: ServerProcess | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        """The router's URL: the one address clients use."""
        return f"http://{HOST}:{self.port}"

    @property
    def worker_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def _worker(self, i: int, port: int) -> ServerProcess:
        args = list(self.worker_args)
        if self.request_log:
            args += ["--log-requests", "--log-requests-level", "0", "--log-requests-format",
                     "json", "--log-requests-target", str(self._request_dir(i))]
        cpus = frozenset({i % (os.cpu_count() or 1)}) if self.pin_cores else None
        return ServerProcess(args=args, log_path=self.log_dir / f"worker{i}.log", port=port,
                             env={**WORKER_ENV, **self.env}, boot_timeout_s=self.boot_timeout_s,
                             cpus=cpus)

    def _request_dir(self, i: int) -> Path:
        return self.log_dir / f"worker{i}" / REQUEST_LOG_DIR

    def start(self) -> Cluster:
        """Boot the servers one after another, then the router; block until the router reports
        every worker healthy. (Booted together, a server sized its KV pool from host memory while
        the other was loading its weights and failed: "Loaded weights leave no GPU memory for the
        KV cache under --mem-fraction-static=0.1"; on 2 cores, booting together saved nothing.)

        Raises:
            ServerStartError: a server or the router failed to start (everything is stopped).
        """
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.port = free_port()
        ports = free_ports(self.workers, self.port + 1, self.port + 1000)
        for i in range(self.workers):  # SGLang appends to its request log: start it afresh
            shutil.rmtree(self._request_dir(i), ignore_errors=True)
        self.servers = [self._worker(i, p) for i, p in enumerate(ports)]
        try:
            for server in self.servers:  # one at a time: see start()
                server.start()
            self.router = router_process(self.worker_urls, self.port,
                                         self.log_dir / "router.log", self.settings)
            self.router.start()
            wait_for_workers(self.url, self.workers)
        except BaseException:
            self.stop()
            raise
        return self

    def healthy_workers(self) -> list[str]:
        """URLs of the workers the router now routes to."""
        return [w["url"] for w in router_workers(self.url) if w.get("is_healthy")]

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` and every process it started (a crash, not a shutdown)."""
        proc = self.servers[i].proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def placement(self) -> list[Counter]:
        """Per worker, how many requests of each routing key it received (from its request
        log; needs ``request_log``)."""
        out = []
        for i in range(len(self.servers)):
            keys: Counter = Counter()
            for path in sorted(self._request_dir(i).glob("*.log*")):
                for line in path.read_text(errors="replace").splitlines():
                    try:  # "[date time] {json}"
                        rec = json.loads(line[line.find("{"):])
                    except ValueError:
                        continue
                    if rec.get("event") == "request.received":
                        keys[(rec.get("headers") or {}).get("x-smg-routing-key")] += 1
            out.append(keys)
        return out

    def stop(self) -> None:
        """Stop the router, then every server (together). A router that had already exited is
        reported on stderr with its exit status (a negative status: the signal that ended it)."""
        if self.router is not None:
            proc = self.router.proc
            if proc is not None and proc.poll() is not None:
                print(f"[cluster] the router had exited with status {proc.returncode}; log "
                      f"{self.router.log_path}", file=sys.stderr, flush=True)
            self.router.stop()
            self.router = None
        if self.servers:
            with ThreadPoolExecutor(len(self.servers)) as pool:
                list(pool.map(ServerProcess.stop, self.servers))

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_kvcmas.server.cluster", allow_abbrev=False,
        description="N sglang-kvcmas servers behind SGLang's router (sticky by workflow). "
                    "Every other argument goes to every server.")
    parser.add_argument("--workers", type=int, default=2, help="servers (default 2)")
    parser.add_argument("--port", type=int, default=30000,
                        help="the router's port; servers take the free ports after it")
    parser.add_argument("--log-dir", type=Path, default=Path("sglang-kvcmas-cluster"),
                        help="router and server logs (default ./sglang-kvcmas-cluster)")
    parser.add_argument("--pin-cores", action="store_true",
                        help="run server i on core i mod cores only")
    parser.add_argument("--request-log", action="store_true",
                        help="servers log every request's routing key (metadata only)")
    return parser


def cluster_from_args(argv: list[str]) -> Cluster:
    """The cluster a command line asks for: our flags, and every other argument for every
    server."""
    ours, worker_args = _parser().parse_known_args(argv)
    return Cluster(workers=ours.workers, worker_args=worker_args, log_dir=ours.log_dir,
                   port=ours.port, pin_cores=ours.pin_cores, request_log=ours.request_log)


def main(argv: list[str] | None = None) -> int:
    cluster = cluster_from_args(sys.argv[1:] if argv is None else argv)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: ignored in a background job
        signal.signal(signum, interrupt)
    print(f"[cluster] starting {cluster.workers} servers "
          f"({' '.join(cluster.worker_args) or 'defaults'}) and the router; logs in "
          f"{cluster.log_dir}", flush=True)
    try:
        cluster.start()
        print(f"[cluster] router at {cluster.url} -> {', '.join(cluster.worker_urls)}; send "
              f"each workflow's id in {ROUTING_KEY_HEADER} (Ctrl-C stops everything)", flush=True)
        while True:
            time.sleep(1.0)
    except ServerStartError as e:
        print(f"[cluster] error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[cluster] stopping", flush=True)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
