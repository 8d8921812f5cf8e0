"""Grouped LoRA ops (``lora/grouped_ops.py``) against the token-by-token reference and SGLang's
own ``torch_native`` ops, over awkward batches: adapters interleaved one token each (decode),
long runs (prefill), mixed, base-model tokens between them, uneven ranks and slice widths."""

from __future__ import annotations

import pytest
import torch

from sglang_kvcmas.lora.grouped_ops import (
    AdapterGroups,
    lora_a,
    lora_a_reference,
    lora_b,
    lora_b_reference,
)

RANKS = [0, 8, 3, 16]  # slot 0: the base model (rank 0)
SCALINGS = [0.0, 2.0, 0.5, 1.25]
MAX_RANK = 16

BATCHES = {
    "decode interleaved": ([1] * 9, [1, 2, 3] * 3),
    "decode with base rows": ([1] * 7, [1, 0, 2, 0, 3, 1, 0]),
    "prefill runs": ([37, 5, 64, 1], [2, 3, 1, 2]),
    "mixed": ([200, 1, 1, 13, 1, 90], [3, 1, 1, 0, 2, 3]),
    "one adapter": ([11], [1]),
    "base only": ([4, 6], [0, 0]),
}


def weights(num_slices: int, d_in: int, offsets: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(len(RANKS), num_slices * MAX_RANK, d_in, generator=g)
    b = torch.randn(len(RANKS), offsets[-1], MAX_RANK, generator=g)
    return a, b


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("num_slices,offsets", [(1, [0, 24]), (2, [0, 40, 80]),
                                                (3, [0, 32, 40, 48])])
def test_grouped_ops_match_the_token_by_token_reference(name, num_slices, offsets):
    seg_lens, slots = BATCHES[name]
    groups = AdapterGroups.build(seg_lens, slots, RANKS, SCALINGS)
    x = torch.randn(sum(seg_lens), 20, generator=torch.Generator().manual_seed(1))
    wa, wb = weights(num_slices, 20, offsets)
    a = lora_a(x, wa, groups, num_slices)
    torch.testing.assert_close(a, lora_a_reference(x, wa, groups, num_slices))
    base = torch.randn(x.shape[0], offsets[-1])
    expected = lora_b_reference(a, wb, groups, offsets, base)
    out = lora_b(a, wb, groups, offsets, base.clone())
    torch.testing.assert_close(out, expected)
    base_rows = [t for t, s in enumerate(s for n, s in zip(seg_lens, slots) for _ in range(n))
                 if RANKS[s] == 0]
    assert torch.equal(out[base_rows], base[base_rows])  # the base model's rows untouched


def test_short_runs_are_gathered_and_long_runs_sliced():
    decode = AdapterGroups.build([1] * 6, [1, 2] * 3, RANKS, SCALINGS)
    assert all(isinstance(g.rows, torch.Tensor) for g in decode.groups)
    assert decode.groups[0].row_list() == [0, 2, 4]
    prefill = AdapterGroups.build([40, 30, 50], [1, 2, 1], RANKS, SCALINGS)
    assert prefill.groups[0].rows == (slice(0, 40), slice(70, 120))
    assert [g.slot for g in AdapterGroups.build([3, 3], [0, 2], RANKS, SCALINGS).groups] == [2]
    with pytest.raises(ValueError, match="segment lengths"):
        AdapterGroups.build([1, 2], [1], RANKS, SCALINGS)


@pytest.mark.parametrize("name", ["decode interleaved", "mixed", "prefill runs"])
def test_grouped_ops_match_sglangs_torch_native_ops(name):
    ops = pytest.importorskip("sglang.srt.lora.torch_ops.lora_ops")
    seg_lens, slots = BATCHES[name]
    groups = AdapterGroups.build(seg_lens, slots, RANKS, SCALINGS)
    offsets = [0, 32, 40, 48]
    x = torch.randn(sum(seg_lens), 20, generator=torch.Generator().manual_seed(2))
    wa, wb = weights(3, 20, offsets, seed=3)
    args = (torch.tensor(slots, dtype=torch.int32), torch.tensor(seg_lens, dtype=torch.int32),
            torch.tensor(RANKS, dtype=torch.int32))
    a_ref = ops.sgemm_lora_a_fwd(x, wa, *args, torch.tensor(SCALINGS), 3)
    torch.testing.assert_close(lora_a(x, wa, groups, 3), a_ref)
    base = torch.randn(x.shape[0], offsets[-1])
    b_ref = ops.sgemm_lora_b_fwd(a_ref, wb, *args, torch.tensor(offsets), base.clone())
    torch.testing.assert_close(lora_b(a_ref, wb, groups, offsets, base.clone()), b_ref)
