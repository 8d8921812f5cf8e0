"""SGLang's own radix-cache unit tests against our tree cache with sharing off.

With sharing off our tree cache (``KvcmasSharedTreeCache``, a subclass of SGLang's
``RadixCache``) must behave exactly as SGLang's. This script runs a copy of SGLang's unit tests
(``test/registered/unit/mem_cache/test_radix_cache_unit.py`` in SGLang's repository; the tests
are not part of SGLang's wheel, so fetch the copy yourself and keep it out of this tree) twice in
one process: as written, against SGLang's ``RadixCache``; then with the module's ``RadixCache``
replaced by our cache (its ``create_simulated`` builds ``KvcmasSharedTreeCache`` with sharing
off over the same parameters). Every test and subtest gets an outcome in each run; the check is
that the two runs agree test by test. A test that fails against SGLang's own class too (a copy
from another SGLang version than the one installed, or a device this machine lacks) does not
apply, and the result says why.

    curl -sLo /tmp/test_radix_cache_unit.py https://raw.githubusercontent.com/sgl-project/\
sglang/v0.5.23/test/registered/unit/mem_cache/test_radix_cache_unit.py
    python benchmark/serving/sglang_radix_unit.py --tests /tmp/test_radix_cache_unit.py

Ends with ``SGLANG_RADIX_UNIT tests= stock_passed= ours_passed= same_outcome= not_applicable=``;
writes ``results/sglang_radix_unit.json`` (each test's outcomes, and the copy's SHA-256).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import sys
import unittest
from pathlib import Path
from typing import Any

from sglang_kvcmas_bench.results import record

RESULTS = Path(__file__).resolve().parent / "results"


class Outcomes(unittest.TestResult):
    """Each test's and subtest's outcome: ``pass``, ``fail``, ``error`` or ``skip``, with the
    first line of what went wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, dict[str, str]] = {}

    def _put(self, test: Any, outcome: str, err: Any = None) -> None:
        why = ""
        if err is not None:
            why = f"{err[0].__name__}: {str(err[1]).splitlines()[0] if str(err[1]) else ''}"
        self.outcomes[test.id().split(".", 1)[-1]] = {"outcome": outcome, "why": why[:200]}

    def addSuccess(self, test: Any) -> None:
        self._put(test, "pass")

    def addFailure(self, test: Any, err: Any) -> None:
        self._put(test, "fail", err)

    def addError(self, test: Any, err: Any) -> None:
        self._put(test, "error", err)

    def addSkip(self, test: Any, reason: str) -> None:
        self.outcomes[test.id().split(".", 1)[-1]] = {"outcome": "skip", "why": reason}

    def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:
        self._put(subtest, "pass" if err is None else
                  ("fail" if issubclass(err[0], AssertionError) else "error"), err)


def load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ours_sharing_off(stock: type) -> type:
    """A stand-in for SGLang's ``RadixCache`` in the tests' module: our tree cache, sharing
    off, built by ``create_simulated`` over the same parameters as SGLang's."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang_kvcmas.integration.shared_tree_cache import KvcmasSharedTreeCache

    class KvcmasSharingOff(KvcmasSharedTreeCache):
        @classmethod
        def create_simulated(cls, disable: bool = False, mock_allocator: Any = None,
                             page_size: int = 1, **kwargs: Any) -> KvcmasSharingOff:
            return cls(CacheInitParams(disable=disable, req_to_token_pool=None,
                                       token_to_kv_pool_allocator=mock_allocator,
                                       page_size=page_size, **kwargs), share_context=False)

    assert issubclass(KvcmasSharingOff, stock)
    return KvcmasSharingOff


def run(path: Path, ours: bool) -> dict[str, dict[str, str]]:
    """Every test of the copy at ``path``; ``ours``: with ``RadixCache`` replaced."""
    module = load(path, f"sglang_radix_unit_{'ours' if ours else 'stock'}")
    if ours:
        module.RadixCache = ours_sharing_off(module.RadixCache)
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    result = Outcomes()
    out, err = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = io.StringIO()  # the tests print trees
    try:
        suite.run(result)
    finally:
        sys.stdout, sys.stderr = out, err
    return result.outcomes


def compare(stock: dict[str, dict], ours: dict[str, dict]) -> dict:
    """Test by test: the outcomes of both runs and whether they agree; those that do not pass
    against SGLang's own class are listed with its reason."""
    names = sorted(set(stock) | set(ours))
    rows = {n: {"stock": stock.get(n, {}).get("outcome", "absent"),
                "ours": ours.get(n, {}).get("outcome", "absent"),
                "why_stock": stock.get(n, {}).get("why", ""),
                "why_ours": ours.get(n, {}).get("why", "")} for n in names}
    not_applicable = {n: r["why_stock"] for n, r in rows.items() if r["stock"] != "pass"}
    return {"tests": len(names),
            "stock_passed": sum(r["stock"] == "pass" for r in rows.values()),
            "ours_passed": sum(r["ours"] == "pass" for r in rows.values()),
            "same_outcome": sum(r["stock"] == r["ours"] for r in rows.values()),
            "differing": [n for n, r in rows.items() if r["stock"] != r["ours"]],
            "not_applicable": not_applicable, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", type=Path, required=True,
                    help="a copy of SGLang's test_radix_cache_unit.py (see the docstring)")
    ap.add_argument("--source", default="",
                    help="where the copy came from (recorded with the result)")
    ap.add_argument("--out", type=Path, default=RESULTS / "sglang_radix_unit.json")
    args = ap.parse_args(argv)
    if not args.tests.is_file():
        ap.error(f"--tests: no file {args.tests}")
    import sglang

    summary = compare(run(args.tests, ours=False), run(args.tests, ours=True))
    result = {"command": "python benchmark/serving/sglang_radix_unit.py --tests <copy>"
                         + (f" --source {args.source!r}" if args.source else ""),
              "sglang": sglang.__version__, "source": args.source,
              "sha256": hashlib.sha256(args.tests.read_bytes()).hexdigest(), **summary}
    record(args.out, json.dumps(result, indent=1) + "\n", command=result["command"],
           what="SGLang's radix-cache unit tests: SGLang's RadixCache against our tree cache "
                "with sharing off, test by test")
    for name in summary["differing"]:
        row = summary["rows"][name]
        print(f"[sglang_radix_unit] differs: {name}: stock {row['stock']}, ours {row['ours']} "
              f"({row['why_ours']})", file=sys.stderr)
    print(f"SGLANG_RADIX_UNIT tests={summary['tests']} stock_passed={summary['stock_passed']} "
          f"ours_passed={summary['ours_passed']} same_outcome={summary['same_outcome']} "
          f"not_applicable={len(summary['not_applicable'])}")
    return 0 if not summary["differing"] else 1


if __name__ == "__main__":
    sys.exit(main())
