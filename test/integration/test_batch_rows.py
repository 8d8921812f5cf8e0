"""Each forward batch carries its own rows' span metadata, in batch order, through the copies
SGLang's model runner makes of it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from sglang_kvcmas.attention.spans import (
    BatchRow,
    HeadMassProbe,
    KeyShifts,
    RowSpans,
    SharedSpan,
)
from sglang_kvcmas.integration.batch_rows import attach_rows, reads_delta, rows_of_forward


@dataclasses.dataclass
class FakeForwardBatch:
    batch_size: int
    rids: list | None = None


def _req(rid, row=None):
    return SimpleNamespace(rid=rid, kvcmas_row=row)


def test_rows_follow_the_batch_and_are_none_when_nothing_is_borrowed():
    row = BatchRow(RowSpans.of_reads("b", (SharedSpan(2, 3, 1),)))
    reqs = [_req("a"), _req("b", row), _req("c")]
    fb = attach_rows(FakeForwardBatch(3, ["a", "b", "c"]), FakeForwardBatch,
                     SimpleNamespace(reqs=reqs), "runner")
    assert rows_of_forward(fb) == (None, row, None) and list(fb.rids) == ["a", "b", "c"]
    plain = attach_rows(FakeForwardBatch(2, ["a", "c"]), FakeForwardBatch,
                        SimpleNamespace(reqs=reqs[::2]), "runner")
    assert rows_of_forward(plain) is None


def test_rows_survive_the_runner_copy_and_never_leak_into_a_later_batch():
    a = _req("a", BatchRow(RowSpans.of_reads("a", (SharedSpan(0, 4, 2),))))
    first = attach_rows(FakeForwardBatch(1, ["a"]), FakeForwardBatch, SimpleNamespace(reqs=[a]),
                        "runner")
    copied = dataclasses.replace(first, batch_size=1)  # what SGLang's eager runner does
    assert rows_of_forward(copied)[0].spans.rid == "a"
    a.kvcmas_row = None  # the request released its row
    second = attach_rows(FakeForwardBatch(1, ["a"]), FakeForwardBatch, SimpleNamespace(reqs=[a]),
                         "runner")
    assert rows_of_forward(second) is None and rows_of_forward(copied) is not None


def test_which_batches_take_the_delta_read_path():
    shifted = BatchRow(RowSpans.of_reads("b", (SharedSpan(2, 3, 1),)))
    masked = BatchRow(RowSpans("c", KeyShifts.none(), positions=torch.arange(4)))
    probed = BatchRow(probe=HeadMassProbe.for_row(0, 2, 8))
    for decode in (False, True):
        assert not reads_delta(None, decode) and not reads_delta((None, None), decode)
        assert reads_delta((None, shifted), decode)
    # A position mask or a head-mass probe matters in extend only.
    assert reads_delta((masked,), False) and not reads_delta((masked,), True)
    assert reads_delta((probed, None), False) and not reads_delta((probed, None), True)


def test_each_batch_keeps_its_own_cache_through_the_runner_copy():
    """The backend's per-batch work (slot orders, a kernel plan) lives on the batch, so a batch
    prepared while another runs (the overlap scheduler) never finds the other's."""
    from sglang_kvcmas.integration.batch_rows import cache_of_forward

    row = BatchRow(RowSpans.of_reads("a", (SharedSpan(0, 4, 2),)))
    first, second = (attach_rows(FakeForwardBatch(1, ["a"]), FakeForwardBatch,
                                 SimpleNamespace(reqs=[_req("a", row)]), "runner")
                     for _ in range(2))
    cache_of_forward(first)[(0, 9)] = "first's slots"
    assert cache_of_forward(dataclasses.replace(first, batch_size=1)) == {(0, 9): "first's slots"}
    assert cache_of_forward(second) == {}
    plain = FakeForwardBatch(1, ["a"])
    assert cache_of_forward(plain) is not cache_of_forward(plain)  # nothing kept without rows
