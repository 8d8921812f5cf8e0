"""``python -m sglang_kvcmas.integration.shared_launch``: our launcher with the shared-context
serving path (tree cache ``kvcmas-shared`` + attention backend ``kvcmas_delta``) registered.

Flags of our own, removed before the rest goes to ``sglang_kvcmas.launch_server``:

- ``--kvcmas-share-context``: opt in to cross-agent sharing for this deployment (without it the
  tree cache behaves exactly like SGLang's radix cache, and the backend like torch_native);
- ``--kvcmas-turn-order {leader,fifo}``: agent-turn ordering policy (default leader).

Every server process must register our extensions before SGLang applies plugin hooks. The
launcher registers in its own process; SGLang starts schedulers with ``spawn``, which imports
this module as ``__mp_main__`` in each child, and the import registers there (guarded by
``KVCMAS_SERVING_EXTENSIONS``, which the launcher sets).

Until ``sglang_kvcmas.plugin`` calls :func:`shared_registration.register` itself, this is the
way to serve the shared path; afterwards ``python -m sglang_kvcmas.launch_server`` suffices.
"""

from __future__ import annotations

import argparse
import os
import sys

from sglang_kvcmas import envs
from sglang_kvcmas.server.options import parse_launcher_args


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--kvcmas-share-context", action="store_true")
    p.add_argument("--kvcmas-turn-order", choices=("leader", "fifo"), default=None)
    return p.parse_known_args(argv)


def _has(flag: str, argv: list[str]) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = _parse(argv)
    os.environ[envs.KVCMAS_SERVING_EXTENSIONS.name] = "1"
    os.environ[envs.KVCMAS_SHARE_CONTEXT.name] = "1" if ours.kvcmas_share_context else "0"
    if ours.kvcmas_turn_order:
        os.environ[envs.KVCMAS_TURN_ORDER.name] = ours.kvcmas_turn_order
    if not _has("--radix-cache-backend", rest) and not _has("--kvcmas-stock-cache", rest):
        rest += ["--radix-cache-backend", "kvcmas-shared"]
    if not _has("--attention-backend", rest):
        rest += ["--attention-backend", "kvcmas_delta"]
    options = parse_launcher_args(rest)
    if options.on_cpu:
        # Same thread count as the launcher would choose, set before torch is imported below.
        os.environ.setdefault("OMP_NUM_THREADS", str(options.cpu_threads))
        from sglang_kvcmas.integration.cpu_runtime import prepare_cpu_server_process

        prepare_cpu_server_process()
    from sglang_kvcmas.integration.shared_registration import register

    register()
    from sglang_kvcmas.launch_server import main as launch_main

    return launch_main(rest)


if __name__ == "__mp_main__" and envs.KVCMAS_SERVING_EXTENSIONS.get_bool():
    from sglang_kvcmas.integration.shared_registration import register as _register

    _register()

if __name__ == "__main__":
    sys.exit(main())
