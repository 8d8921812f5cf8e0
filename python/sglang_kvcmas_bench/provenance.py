"""Where a benchmark ran: the checkout, its commit and the machine.

``REPO_ROOT`` is the checkout this package lives in (``python/sglang_kvcmas_bench/`` under it):
the benchmarks are run from a checkout, and their result folders are in it.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """The checkout's HEAD as a short hash ('' outside a git checkout)."""
    return subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()


def machine() -> str:
    """``<host> <arch> <n> cpus``: what a result's header says about the machine."""
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus"
