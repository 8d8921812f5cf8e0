"""Load a benchmark script by its path, for tests of what only that script does.

The scripts under ``benchmark/`` are not a package (they are run by path); what more than one
script uses is in ``sglang_kvcmas_bench``, which tests import directly. Tests reach this module
as ``helpers.bench_scripts``: ``test/`` is on ``sys.path`` because ``test/conftest.py`` is
loaded from there.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(rel: str) -> ModuleType:
    """The module of the script at ``rel`` (from the repository root), loaded once; its
    ``__main__`` block does not run."""
    path = ROOT / rel
    name = "bench_script_" + "_".join(Path(rel).with_suffix("").parts)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]
