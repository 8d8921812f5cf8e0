"""Boot SGLang's own HTTP server (``sglang.launch_server.run_server``) with our plugin loaded.

Launcher glue that needs ``sglang.srt``; the command line itself is built in
``sglang_kvcmas.server.options``. Call :func:`sglang_kvcmas.integration.cpu_runtime.
prepare_cpu_server_process` first when serving on CPU: importing this module imports SGLang.
"""

from __future__ import annotations

import argparse
import os

from sglang.launch_server import run_server
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.utils import kill_process_tree

_UNSET = object()


def explicit_dests(argv: list[str]) -> set[str]:
    """The ``ServerArgs`` fields that ``argv`` sets, by SGLang's own parser (aliases included)."""
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:
        action.default = _UNSET
        action.required = False
        action.choices = None  # values are SGLang's to check, after plugins add theirs
    known, _ = parser.parse_known_args(argv)
    return {dest for dest, value in vars(known).items() if value is not _UNSET}


def serve(argv: list[str]) -> None:
    """Load plugins (ours included), parse ``argv`` as SGLang does, and serve until stopped.

    Mirrors ``python -m sglang.launch_server``; on exit every child process is killed.
    """
    load_plugins()
    from sglang.srt.entrypoints.http_server import app

    from sglang_kvcmas.integration.workflow_accounting import add_routes

    add_routes(app)  # /kvcmas/workflows
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
