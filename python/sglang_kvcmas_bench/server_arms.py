"""Boot one SGLang server per benchmark arm (same binary, different tree cache), stop it cleanly.

Arms:
    kvcmas    ``sglang_kvcmas.launch_server --kvcmas-share-context`` (our tree cache + delta
              attention backend, cross-agent sharing on)
    radix     ``sglang_kvcmas.launch_server --kvcmas-stock-cache`` (SGLang's default radix cache)
    no_cache  ``sglang_kvcmas.launch_server --kvcmas-stock-cache --disable-radix-cache``

Each arm is a :class:`~sglang_kvcmas.server.process.ServerProcess` (127.0.0.1, its own process
group, output to a log file) on a port in 31000–31999.
"""

from __future__ import annotations

import json
import shlex
import sys
import urllib.request
from pathlib import Path

from sglang_kvcmas.envs import KVCMAS_BENCH_SERVER_ARGS, KVCMAS_SPARE_PREFILL
from sglang_kvcmas.server.process import ServerProcess, free_port

from sglang_kvcmas_bench.provenance import commit, machine

NO_SPARE_PASS = {KVCMAS_SPARE_PREFILL.name: "0"}
"""A server environment with the spare pass off: readers borrow on an idle server too (a script
that sends one request at a time and measures the read path needs it)."""
COMMON_FLAGS = ["--mem-fraction-static", "0.3"]
"""Every arm gets the same KV pool (``--max-total-tokens``, 16384 by default): SGLang sizes the
pool from the host memory free at boot, capped by that flag, and at the launcher's default
fraction a loaded machine left one arm a smaller pool than the others (5308 tokens seen)."""

ARMS: dict[str, tuple[str, list[str]]] = {
    "kvcmas": ("sglang_kvcmas.launch_server", ["--kvcmas-share-context"]),
    "radix": ("sglang_kvcmas.launch_server", ["--kvcmas-stock-cache"]),
    "no_cache": ("sglang_kvcmas.launch_server", ["--kvcmas-stock-cache", "--disable-radix-cache"]),
}


def ArmServer(
    arm: str,
    log_path: Path,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    boot_timeout_s: float = 400.0,
) -> ServerProcess:
    """The server process for one arm; use it as a context manager. ``KVCMAS_BENCH_SERVER_ARGS``
    (e.g. ``--device cuda``) is appended to every arm's flags."""
    module, flags = ARMS[arm]
    user = shlex.split(KVCMAS_BENCH_SERVER_ARGS.get())  # last: the user's flags win
    return ServerProcess(
        args=[*flags, *COMMON_FLAGS, *(extra_args or []), *user], log_path=log_path,
        env=dict(env or {}),
        port=free_port(31000, 32000), boot_timeout_s=boot_timeout_s, module=module,
    )


def kvcmas_state(url: str) -> dict:
    """The ``kvcmas`` entry of a server's ``/server_info`` (``internal_states``: the tree cache's
    class, the pool's slots and, with sharing on, ``shared_tree``); empty for a stock server."""
    with urllib.request.urlopen(url + "/server_info", timeout=60) as r:
        info = json.loads(r.read())
    for state in info.get("internal_states") or []:
        if "kvcmas" in state:
            return state["kvcmas"]
    return {}


def shared_tree_stats(url: str) -> dict:
    """The shared tree's sizes in ``kvcmas_state`` (shared and delta tokens, leaf bytes by
    agent, ...); empty for the stock cache or with sharing off."""
    return kvcmas_state(url).get("shared_tree") or {}


def run_header(script: str, argv: list[str] | None, model) -> dict:
    """A benchmark result's first fields: its command (``argv``, or this process's when None),
    the repository's commit, the machine and the model (a ``model_arg.BenchModel``)."""
    return {
        "command": shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)]),
        "commit": commit(),
        "machine": machine(),
        "model": "embedded SmolLM2-135M-Instruct" if model.is_embedded else model.name,
    }
