"""Head mass recorded beside attention: a batch's probed rows, keys read from the pool, equal
each row's softmax mass on its head measured on its own, over awkward sizes (on CUDA through the
Triton kernel, on CPU through the torch reference)."""

from __future__ import annotations

import pytest
import torch

from sglang_kvcmas.attention import span_reads
from sglang_kvcmas.attention.probe_reads import add_row_mass, pool_keys, record_head_mass
from sglang_kvcmas.attention.spans import HeadMassProbe, is_probe_layer

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEV == "cuda" else 1e-5


def _softmax_mass(q, k, q_pos, k_pos, scale, lo, hi):
    """The definition: softmax over each query's visible keys, mass on rows [lo, hi), mean
    over query heads."""
    kk = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    p = ((q @ kk.transpose(1, 2)) * scale).masked_fill(
        k_pos[None, None] > q_pos[None, :, None], float("-inf")).softmax(-1)
    return p[:, :, lo:hi].sum(-1).mean(0)


def test_probe_layers_are_two_six_ten():
    assert [i for i in range(16) if is_probe_layer(i)] == [2, 6, 10, 14]


# (prefix, new tokens, probe (head_from, head_to, row_len) or None) per row; heads, KV heads
BATCHES = [
    ([(8, 3, (1, 5, 11)), (0, 7, None), (13, 1, (0, 3, 14))], 4, 2),
    ([(0, 1, (0, 1, 1))], 3, 1),  # one token, its own head
    ([(5, 300, (2, 9, 305)), (40, 17, (0, 40, 30))], 6, 3),  # several blocks; a short row_len
    ([(0, 9, None), (3, 4, (3, 3, 7))], 2, 2),  # an empty head range
]


@pytest.mark.parametrize("rows, h, hkv", BATCHES)
def test_batch_mass_from_the_pool_equals_each_row_alone(rows, h, hkv, monkeypatch):
    torch.manual_seed(len(rows) * 10 + h)
    monkeypatch.setattr(span_reads, "PROBE_BLOCK", 64)  # several query blocks where long
    d, scale = 16, 0.3
    n_kv = [p + n for p, n, _ in rows]
    k_cache = torch.randn(sum(n_kv) + 7, hkv, d, device=DEV)
    req_to_token = torch.zeros(len(rows) + 2, max(n_kv) + 3, dtype=torch.int64, device=DEV)
    slots = torch.randperm(k_cache.shape[0], device=DEV)
    idx = torch.arange(len(rows), device=DEV) + 1  # batch row i is pool row i + 1
    at = 0
    for i, n in enumerate(n_kv):
        req_to_token[idx[i], :n] = slots[at : at + n]
        at += n
    query = torch.randn(sum(n for _, n, _ in rows), h, d, device=DEV)
    probes = [HeadMassProbe.for_row(*p) if p else None for _, _, p in rows]
    record_head_mass(query, probes, [p for p, _, _ in rows], [n for _, n, _ in rows],
                     pool_keys(k_cache, req_to_token, idx), scale)
    start = 0
    for i, (prefix, n, probe) in enumerate(rows):
        q = query[start : start + n].movedim(0, 1)
        start += n
        if probe is None:
            continue
        head_from, head_to, row_len = probe
        k = k_cache[req_to_token[idx[i], : prefix + n]].movedim(0, 1)
        pos = torch.arange(prefix + n, device=DEV)
        want = _softmax_mass(q, k, pos[prefix:], pos, scale, head_from, head_to).cpu()
        kept = max(0, min(prefix + n, row_len) - prefix)
        got = probes[i]
        torch.testing.assert_close(got.sums[prefix : prefix + kept], want[:kept], atol=TOL,
                                   rtol=1e-4)
        assert got.counts[prefix : prefix + kept].eq(1).all()
        assert got.sums[:prefix].eq(0).all() and got.counts[:prefix].eq(0).all()


def test_row_mass_takes_true_positions():
    """Keys out of position order (a reader's recomputed tokens): causal by position."""
    torch.manual_seed(4)
    q, k = torch.randn(4, 3, 16, device=DEV), torch.randn(2, 9, 16, device=DEV)
    pos = torch.tensor([0, 1, 5, 6, 2, 3, 4, 7, 8], device=DEV)  # rows 6..: new; 4..5 recomputed
    probe = HeadMassProbe.for_row(0, 2, 9)
    add_row_mass(probe, q, k, pos, 6, 0.25)
    want = _softmax_mass(q, k, pos[6:], pos, 0.25, 0, 2).cpu()
    torch.testing.assert_close(probe.sums[6:], want, atol=TOL, rtol=1e-4)


def test_pool_keys_reads_a_copy_at_row_indices():
    k_cache = torch.randn(10, 2, 4)
    req_to_token = torch.tensor([[0, 0, 0], [7, 2, 5]])
    k, pos = pool_keys(k_cache, req_to_token, torch.tensor([1]))(0, 2)
    assert torch.equal(k, k_cache[[7, 2]].movedim(0, 1)) and pos.tolist() == [0, 1]
    k.zero_()
    assert k_cache[7].abs().sum() > 0  # the pool is never written
