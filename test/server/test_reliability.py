"""The reliability suite (``benchmark/serving/reliability.py --quick``) against a sharing
server: bad input answered 4xx naming the field, disconnects, readers and leaders aborted while
others wait, isolation across ``cache_salt``, and an eviction storm at about a quarter of the
pool the workflows want. Every valid request completes, no slot leaks, the tree stays
consistent, the scheduler never crashes."""

from __future__ import annotations

import pytest
from helpers.bench_scripts import load_script

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_quick_reliability_suite(sharing_server):
    rel = load_script("benchmark/serving/reliability.py")

    cats = rel.run(sharing_server.url, sharing_server.log_path, quick=True,
                   names=rel.CATEGORIES, pool=4096, context=8192)
    line = rel.summary_line(cats, rel.crashes(sharing_server.url, sharing_server.log_path))
    print(line)
    lost = [n for c in cats for n in c.notes]
    problems = {c.name: c.invariant_problems for c in cats if c.invariant_problems}
    assert " lost=0 " in line and " leaked_slots=0 " in line, (line, lost[:5])
    assert " scheduler_crashes=0" in line and not problems, (line, problems)
    by_name = {c.name: c for c in cats}
    assert by_name["bad_fields"].counts["clear_errors"] >= 60
    assert by_name["aborts"].counts["dropped"] > 0  # the aborts took effect
    assert any("2 held back" in e for e in by_name["aborts"].evidence)  # readers were waiting
    assert by_name["storm"].counts["completed"] == by_name["storm"].counts["sent"]
