"""The route of a forward batch: its path (stock, kernel, torch) and the reason, from a closed
set; decided once per batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_kvcmas.attention.deviation_factors import LeafReads, RowLeaves
from sglang_kvcmas.attention.spans import (
    BatchRow,
    HeadMassProbe,
    RecomputedTokens,
    RowSpans,
    SharedSpan,
)
from sglang_kvcmas.integration import dispatch_route
from sglang_kvcmas.integration.batch_rows import TaggedRids
from sglang_kvcmas.integration.dispatch_route import (
    PATHS,
    PLAIN_ROUTE,
    REASONS,
    Route,
    decide,
    route_of,
)

SHIFTED = BatchRow(RowSpans.of_reads("r", (SharedSpan(2, 3, 1),)))
UNSHIFTED = BatchRow(RowSpans.of_reads("r", ()))  # borrowed at the same positions
MASKED = BatchRow(RowSpans.of_reads("r", (), RecomputedTokens(4, (9,), (1,)),
                                    torch.tensor([0, 2, 3, 4, 1])))
PROBED = BatchRow(probe=HeadMassProbe.for_row(0, 2, 8))
SHIFTED_PROBED = BatchRow(SHIFTED.spans, PROBED.probe)


def _leaves(in_order: bool) -> BatchRow:
    rows = torch.tensor([3, 4])
    reads = LeafReads([(rows, rows if in_order else rows + 1, None)])
    return BatchRow(RowSpans(SHIFTED.spans.rid, SHIFTED.spans.key_shifts,
                             leaves=RowLeaves(reads)))


# rows, decode, probes_on_stock, kernel -> (path, reason)
CASES = [
    (None, False, True, True, ("stock", "plain")),
    ((None, None), True, True, True, ("stock", "plain")),
    ((PROBED,), True, True, True, ("stock", "plain")),  # a probe changes nothing in decode
    ((UNSHIFTED,), True, True, True, ("stock", "plain")),  # nor spans read unshifted
    ((PROBED, None), False, True, True, ("stock", "probe")),
    ((PROBED, None), False, False, True, ("torch", "probe_on_torch_native")),
    ((PROBED, SHIFTED), False, True, True, ("kernel", "reader")),
    ((SHIFTED_PROBED,), False, True, True, ("kernel", "reader")),
    ((None, SHIFTED), True, True, True, ("kernel", "reader")),
    ((MASKED,), False, True, True, ("kernel", "reader")),  # recomputed ones in torch inside
    ((UNSHIFTED,), False, True, True, ("kernel", "reader")),
    ((None, SHIFTED), True, True, False, ("torch", "no_kernel")),
    ((PROBED, SHIFTED), False, True, False, ("torch", "no_kernel")),
    ((_leaves(True),), True, True, True, ("kernel", "reader")),
    ((_leaves(False), SHIFTED), True, True, True, ("torch", "leaves_out_of_order")),
]


@pytest.mark.parametrize("rows, decode, probes_on_stock, kernel, want", CASES)
def test_each_batch_has_one_route(rows, decode, probes_on_stock, kernel, want):
    route = decide(rows, decode, probes_on_stock, kernel)
    assert (route.path, route.reason) == want
    assert route.path in PATHS and route.reason in REASONS


def test_every_reason_is_reachable():
    assert {decide(*case[:4]).reason for case in CASES} == set(REASONS)


def _batch(mode: str, *rows):
    rids = TaggedRids(f"r{i}" for i in range(len(rows)))
    rids.rows = rows
    return SimpleNamespace(forward_mode=ForwardMode[mode.upper()], rids=rids)


def test_route_is_decided_once_per_batch(monkeypatch):
    calls = []
    real = dispatch_route.decide
    monkeypatch.setattr(dispatch_route, "decide", lambda *a: calls.append(a) or real(*a))
    delta = SimpleNamespace(delta_kernel=True)
    fb = _batch("extend", PROBED, SHIFTED)
    for _ in range(5):  # every layer asks
        assert route_of(fb, True, delta) == Route("kernel", "reader")
    assert len(calls) == 1 and calls[0][1:] == (False, True, True)
    assert route_of(_batch("decode", PROBED), True, delta) is PLAIN_ROUTE
    assert route_of(SimpleNamespace(rids=["a"]), True, delta) is PLAIN_ROUTE  # no rows
    assert route_of(_batch("decode", SHIFTED), True, object()).reason == "no_kernel"
    assert len(calls) == 3  # the untagged batch decides nothing
