"""The dispatch check's figures from a server's counters (no server)."""

from __future__ import annotations

from helpers.bench_scripts import load_script

dc = load_script("benchmark/serving/dispatch_check.py")


def test_everything_where_it_belongs_reads_as_ones():
    snap = {"forward_batches": {"stock": {"plain": 40, "probe": 3}, "kernel": {"reader": 6}}}
    out = dc.ratios(snap)
    assert (out["owner_batches_on_stock"], out["plain_batches_on_stock"],
            out["torch_fallback_batches"], out["reader_rows_on_kernel"]) == (1.0, 1.0, 0, 1.0)
    assert out["batches"] == {"owner": 3, "plain": 40, "reader": 6}


def test_fallbacks_are_counted_and_absent_batches_are_not_a_pass():
    snap = {"forward_batches": {"stock": {"plain": 10},
                                "torch": {"probe_on_torch_native": 1, "no_kernel": 3}}}
    out = dc.ratios(snap)
    assert out["owner_batches_on_stock"] == 0.0 and out["reader_rows_on_kernel"] == 0.0
    assert out["torch_fallback_batches"] == 4
    empty = dc.ratios({})
    assert empty["reader_rows_on_kernel"] is None and empty["owner_batches_on_stock"] is None
