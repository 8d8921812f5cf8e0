"""Several sglang-kvcmas servers behind SGLang's gateway, every workflow's requests on one of them.

    python -m sglang_kvcmas.server.cluster --workers 2 --port 30000 --kvcmas-share-context \
        [--tenant-keys keys.txt]

starts N servers (our launcher, every one with the same flags, on 127.0.0.1 and the ports after
the gateway's) and SMG (SGLang's Rust gateway, PyPI ``smg``) in front of them, waits until the
gateway reports every worker healthy, and stops them all on SIGINT or SIGTERM. Clients talk to
the gateway's port as to one server.

Placement. Agents share KV only inside one server, so every request of a workflow must reach the
same one. SMG's ``manual`` policy keeps each routing key, the ``X-SMG-Routing-Key`` header, on
the worker it first sent it to; a new key goes to the worker with the fewest keys in flight
(``--assignment-mode min_group``; with equal counts, either); a key moves only when its worker
is unhealthy. Requests without a key go to a worker at random. (SMG's sticky sessions over
``cache_aware`` would place those by prefix, but they split a workflow whose agents send their
first requests together.) Clients send the workflow id in ``X-SMG-Routing-Key``
(:func:`workflow_headers`), which the server also takes as the workflow id when
``X-KVCMAS-Workflow`` (not forwarded) is absent.

Tenants (``--tenant-keys``: one ``name:key`` a line). SMG then admits a request only with one of
these keys (``Authorization: Bearer <key>``; any other: 401) and passes the header on unchanged;
every server scopes the request's KV namespace and workflow by that credential
(``policy/tenancy.py``), so tenants never read each other's KV, whatever salt, workflow or
header they send. Refused at start, since it could not hold: two tenants with one key, and
SGLang's ``--api-key`` on the servers (they would refuse the tenants' keys). The gateway's
control routes (``/workers``) then take a key of the cluster's own, made at start. The keys
are on SMG's command line: keep the host to the operator.

What SMG passes on (checked in ``test/server/test_cluster.py``): of the request headers
``authorization`` and ``x-smg-routing-key`` (not ``X-KVCMAS-Workflow``, nor a forged
``x-smg-tenant-id``); the ``/generate`` and ``/v1/chat/completions`` bodies with their
``cache_salt`` and ``custom_params`` (every ``kvcmas_*`` field). Responses come back unchanged
(``meta_info.kvcmas_reuse``, OpenAI usage).

Failures (:class:`RouterSettings`): the gateway checks every worker's ``/health`` (our servers
answer it without running the model) and takes a worker out after failed checks; a request
whose worker refuses the connection, or dies before answering, is retried on the worker the
policy picks then, and a worker's circuit breaker opens after failed requests. SMG's overload
veto (a worker over its KV-usage threshold left out of routing) is off: it would move workflows
off their KV, and with one worker down it could refuse requests a healthy worker would serve.
A stream already under way cannot be retried: when its worker dies the client's stream ends
early (``router_scale.py``'s kill run counts it as a clear error, never as an answer).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
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
"""The header the gateway's ``manual`` policy routes by."""
WORKFLOW_HEADER = "X-KVCMAS-Workflow"
"""Our workflow header (``policy/request_options.py``); the gateway does not forward it."""
ROUTER_MODULE = "smg.launch_router"
WORKER_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
"""Every worker answers the gateway's ``/health`` checks without running the model. By default
each check queues a one-token generation and waits for the scheduler's next output, which behind
a long CPU prefill outlasts the gateway's check timeout and would take a busy, healthy worker out
(moving its workflows). A killed worker still fails at once (connection refused);
``/health_generate`` still runs the model."""
REQUEST_LOG_DIR = "requests"
"""Under a worker's log folder: SGLang's request log (``--log-requests-target``), one JSON line
per request with the ``x-smg-routing-key`` header it came with (``request_log``)."""


def workflow_headers(workflow: str) -> dict[str, str]:
    """The headers a client sends with every request of one workflow (through the gateway or
    straight to a server)."""
    return {ROUTING_KEY_HEADER: workflow, WORKFLOW_HEADER: workflow}


@dataclass(frozen=True)
class RouterSettings:
    """The gateway's command line: policy, health checks, circuit breaker, retries.

    Attributes:
        policy: ``manual`` (sticky by ``X-SMG-Routing-Key``, atomic for a new key's
            concurrent first requests); SMG's others include ``cache_aware``, ``random``,
            ``round_robin`` and ``power_of_two``.
        assignment_mode: where ``manual`` puts a new key: ``min_group`` (the worker with the
            fewest keys in flight), ``min_load`` (fewest requests) or ``random``.
        health_failure_threshold: failed checks in a row that take a worker out.
        cb_timeout_s: seconds an open breaker waits before it lets one request try again.
        retry_max_retries: attempts per request (the first included).
        overload_protection: SMG's overload veto; off (see the module docstring).
    """

    policy: str = "manual"
    assignment_mode: str = "min_group"
    health_check_interval_s: int = 1
    health_failure_threshold: int = 2
    health_check_timeout_s: int = 5
    cb_failure_threshold: int = 3
    cb_timeout_s: int = 30
    retry_max_retries: int = 5
    overload_protection: bool = False
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
        if not self.overload_protection:
            out.append("--disable-worker-overload-protection")
        if self.policy == "manual":
            out += ["--assignment-mode", self.assignment_mode]
        return out


@dataclass(frozen=True)
class Tenants:
    """The tenants the gateway admits, each by its API key, and the cluster's own control key.

    Attributes:
        keys: tenant name -> API key (empty: no keys, one tenant, no authentication).
        control_key: the key the cluster polls the gateway's ``/workers`` with (made at
            start; never a tenant's).
    """

    keys: dict[str, str] = field(default_factory=dict)
    control_key: str = field(default_factory=lambda: secrets.token_hex(16))

    def __post_init__(self) -> None:
        for name, key in self.keys.items():
            if not name or ":" in name or not name.isprintable() or not key or \
                    any(c.isspace() for c in key):
                raise ValueError(f"tenant {name!r}: a name is printable without ':', a key "
                                 f"non-empty without spaces")
        if len(set(self.keys.values())) != len(self.keys):
            raise ValueError("two tenants share an API key: the gateway and the servers could "
                             "not tell them apart, so their KV would be shared")

    @classmethod
    def from_file(cls, path: Path) -> Tenants:
        """``name:key`` a line (blank lines and ``#`` comments skipped).

        Raises:
            ValueError: a line without ``:``, a name given twice, or :meth:`__post_init__`'s.
        """
        keys: dict[str, str] = {}
        for n, line in enumerate(path.read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, key = line.partition(":")
            if not sep or name.strip() in keys:
                raise ValueError(f"{path}:{n}: expected a new tenant as name:key")
            keys[name.strip()] = key.strip()
        return cls(keys)

    def argv(self) -> list[str]:
        if not self.keys:
            return []
        out = [a for name, key in self.keys.items() for a in ("--tenant-api-key", f"{name}:{key}")]
        return out + ["--control-plane-api-keys", f"cluster:kvcmas-cluster:admin:{self.control_key}"]

    def control_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.control_key}"} if self.keys else {}

    def headers(self, tenant: str) -> dict[str, str]:
        """The header a client of ``tenant`` sends with every request."""
        return {"Authorization": f"Bearer {self.keys[tenant]}"}


def free_ports(n: int, start: int = 30000, end: int = 31000) -> list[int]:
    """``n`` distinct free ports in ``[start, end)``, lowest first."""
    ports: list[int] = []
    for _ in range(n):
        ports.append(free_port(ports[-1] + 1 if ports else start, end, spread=False))
    return ports


def router_process(worker_urls: list[str], port: int, log_path: Path,
                   settings: RouterSettings = RouterSettings(),
                   tenants: Tenants | None = None) -> ServerProcess:
    """The gateway in front of ``worker_urls``, as a process to :meth:`~ServerProcess.start`
    (its ``/health`` answers once it listens; :func:`wait_for_workers` then waits for the
    workers)."""
    return ServerProcess(args=["--worker-urls", *worker_urls, *settings.argv(),
                               *(tenants.argv() if tenants else [])],
                         log_path=log_path, port=port, boot_timeout_s=120.0,
                         module=ROUTER_MODULE)


def router_workers(url: str, tenants: Tenants | None = None) -> list[dict]:
    """The gateway's view of its workers (``GET /workers``: url, is_healthy, load), or [] when
    the gateway does not answer."""
    headers = tenants.control_headers() if tenants else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/workers", headers=headers),
                                    timeout=10.0) as r:
            return list(json.loads(r.read()).get("workers", []))
    except (urllib.error.URLError, OSError, ValueError):
        return []


def wait_for_workers(url: str, n: int, timeout_s: float = 120.0,
                     tenants: Tenants | None = None) -> None:
    """Block until the gateway at ``url`` reports ``n`` healthy workers.

    Raises:
        ServerStartError: not within ``timeout_s`` (the message has what it reports).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(bool(w.get("is_healthy")) for w in router_workers(url, tenants)) == n:
            return
        time.sleep(0.5)
    raise ServerStartError(f"the gateway at {url} did not report {n} healthy workers in "
                           f"{timeout_s:.0f} s; it reports {router_workers(url, tenants)}")


@dataclass
class Cluster:
    """N servers and the gateway. Use as a context manager, or call :meth:`start` / :meth:`stop`.

    Attributes:
        worker_args: launcher/SGLang flags of every server (``--port`` and ``--host`` added).
        log_dir: ``router.log``, ``worker<i>.log`` and, with ``request_log``, each worker's
            request log under ``worker<i>/requests/``.
        port: the gateway's port (a free one in 30000–30999 when None); the workers take the
            free ports after it.
        tenants: the tenants' API keys (none: one tenant, no authentication).
        request_log: have every worker log each request's routing key (SGLang's
            ``--log-requests``, metadata only), for :meth:`placement`.
        pin_cores: run worker ``i`` on core ``i mod cores`` only (the gateway on any).
        boot_timeout_s: how long each server may take to become healthy.
    """

    workers: int = 2
    worker_args: list[str] = field(default_factory=list)
    log_dir: Path = Path("sglang-kvcmas-cluster")
    port: int | None = None
    settings: RouterSettings = RouterSettings()
    tenants: Tenants = field(default_factory=Tenants)
    request_log: bool = False
    pin_cores: bool = False
    env: dict[str, str] = field(default_factory=dict)
    boot_timeout_s: float = 400.0
    servers: list[ServerProcess] = field(default_factory=list, init=False)
    router: ServerProcess | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        """The gateway's URL: the one address clients use."""
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
        """Boot the servers one after another, then the gateway; block until the gateway reports
        every worker healthy. (One at a time: a server sizes its KV pool from the host memory
        free when it boots, which a sibling still loading its weights would take.)

        Raises:
            ServerStartError: a server or the gateway failed to start (everything is stopped).
        """
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.tenants.keys and any(a == "--api-key" or a.startswith("--api-key=")
                                     for a in self.worker_args):
            raise ValueError("--api-key on the servers cannot serve tenants: each server would "
                             "refuse every tenant's key; the gateway checks the keys")
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
                                         self.log_dir / "router.log", self.settings,
                                         self.tenants)
            self.router.start()
            wait_for_workers(self.url, self.workers, tenants=self.tenants)
        except BaseException:
            self.stop()
            raise
        return self

    def healthy_workers(self) -> list[str]:
        """URLs of the workers the gateway now routes to."""
        return [w["url"] for w in router_workers(self.url, self.tenants) if w.get("is_healthy")]

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` and every process it started (a crash, not a shutdown)."""
        proc = self.servers[i].proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
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
        """Stop the gateway, then every server (together). A gateway that had already exited is
        reported on stderr with its exit status (a negative status: the signal that ended it)."""
        if self.router is not None:
            proc = self.router.proc
            if proc is not None and proc.poll() is not None:
                print(f"[cluster] the gateway had exited with status {proc.returncode}; log "
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
        description="N sglang-kvcmas servers behind SGLang's gateway SMG (sticky by "
                    "workflow; tenants isolated by their API keys). "
                    "Every other argument goes to every server.")
    parser.add_argument("--workers", type=int, default=2, help="servers (default 2)")
    parser.add_argument("--port", type=int, default=30000,
                        help="the gateway's port; servers take the free ports after it")
    parser.add_argument("--tenant-keys", type=Path, default=None,
                        help="a file of name:key lines: the gateway admits only these keys and "
                             "no two tenants share KV (default: one tenant, no keys)")
    parser.add_argument("--log-dir", type=Path, default=Path("sglang-kvcmas-cluster"),
                        help="gateway and server logs (default ./sglang-kvcmas-cluster)")
    parser.add_argument("--pin-cores", action="store_true",
                        help="run server i on core i mod cores only")
    parser.add_argument("--request-log", action="store_true",
                        help="servers log every request's routing key (metadata only)")
    return parser


def cluster_from_args(argv: list[str]) -> Cluster:
    """The cluster a command line asks for: our flags, and every other argument for every
    server."""
    ours, worker_args = _parser().parse_known_args(argv)
    tenants = Tenants.from_file(ours.tenant_keys) if ours.tenant_keys else Tenants()
    return Cluster(workers=ours.workers, worker_args=worker_args, log_dir=ours.log_dir,
                   port=ours.port, pin_cores=ours.pin_cores, request_log=ours.request_log,
                   tenants=tenants)


def main(argv: list[str] | None = None) -> int:
    try:
        cluster = cluster_from_args(sys.argv[1:] if argv is None else argv)
    except (OSError, ValueError) as e:
        print(f"[cluster] error: {e}", file=sys.stderr)
        return 2

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: ignored in a background job
        signal.signal(signum, interrupt)
    print(f"[cluster] starting {cluster.workers} servers "
          f"({' '.join(cluster.worker_args) or 'defaults'}) and the gateway; logs in "
          f"{cluster.log_dir}", flush=True)
    try:
        cluster.start()
        tenants = f"; {len(cluster.tenants.keys)} tenants" if cluster.tenants.keys else ""
        print(f"[cluster] gateway at {cluster.url} -> {', '.join(cluster.worker_urls)}; send "
              f"each workflow's id in {ROUTING_KEY_HEADER}{tenants} (Ctrl-C stops everything)",
              flush=True)
        while True:
            time.sleep(1.0)
    except (ServerStartError, ValueError) as e:
        print(f"[cluster] error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[cluster] stopping", flush=True)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
