"""The delta kernel's decode over re-positioned borrowed keys (the GPU path) equals the torch
reference (rotate the keys, then SDPA) over awkward batches; on CPU the kernel runs in Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_kvcmas.attention.rope import ShiftRope, rope_inv_freq
from sglang_kvcmas.attention.span_reads import rotate_keys
from sglang_kvcmas.attention.spans import KeyShifts, RowSpans, SharedSpan
from sglang_kvcmas.attention.kernel_reads import (
    kernel_serves,
    plan_shifted,
    row_runs,
    shifted_attention,
)

pytestmark = pytest.mark.slow  # the interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter

# rows: (n_kv, spans (start, length, shift)); heads, kv heads, head_dim
CASES = [
    ([(1, []), (17, [(2, 7, -5)]), (130, [(5, 40, 11), (45, 50, -29), (95, 34, 11)])], 8, 2, 64),
    ([(257, [(0, 100, 3), (100, 1, -1), (200, 56, 4000)]), (33, [])], 4, 4, 128),  # 1:1, far
    # exact leaves scattered through a borrowed span: dozens of short runs, two owners
    ([(301, [(10 + 9 * j, 8, -40 if j % 3 else 17) for j in range(30)])], 8, 2, 64),
    ([(70, [(3, 60, 0)]), (9, [(0, 8, -2)])], 2, 1, 256),  # a shift-0 run; head_dim 256
]


def reference(q, k_pool, v_pool, kv, shifts, rope):
    """[H, d]: the row's keys re-positioned in one gather (extend's path), then SDPA."""
    k = rotate_keys(k_pool[kv], shifts, rope) if shifts is not None else k_pool[kv]
    return scaled_dot_product_attention(q[:, None][None], k.movedim(0, 1)[None],
                                        v_pool[kv].movedim(0, 1)[None], enable_gqa=True)[0, :, 0]


@pytest.mark.parametrize("rows, h, hkv, d", CASES)
def test_kernel_decode_equals_the_reference(rows, h, hkv, d):
    torch.manual_seed(len(rows) * d)
    rope = ShiftRope.full(rope_inv_freq(d, 1e4))
    pool = sum(n for n, _ in rows) + 5
    k_pool, v_pool = torch.randn(pool, hkv, d, device=DEV), torch.randn(pool, hkv, d, device=DEV)
    slots = torch.randperm(pool, device=DEV)
    kvs, shifts, at = [], [], 0
    for n, spans in rows:
        kvs.append(slots[at : at + n])
        at += n
        shifts.append(RowSpans.of_reads("r", tuple(SharedSpan(*s) for s in spans)).key_shifts
                      if spans else None)
    q = torch.randn(len(rows), h, d, device=DEV)
    out = shifted_attention(q, k_pool, v_pool,
                            plan_shifted(kvs, shifts, hkv, rope, DEV), d ** -0.5)
    for i, (kv, s) in enumerate(zip(kvs, shifts)):
        torch.testing.assert_close(out[i], reference(q[i], k_pool, v_pool, kv, s, rope),
                                   atol=2e-5, rtol=1e-4)


def test_runs_stay_inside_the_prefix_and_skip_shift_zero():
    ks = KeyShifts.of_row(2, torch.tensor([3, 3, 0, -5, -5, 3]))
    assert row_runs(ks, 6) == (SharedSpan(2, 2, 3), SharedSpan(5, 1, -5))
    assert row_runs(None, 10) == () and row_runs(ks, 2) == ()


def test_which_models_the_kernel_serves():
    inv = rope_inv_freq(128, 1e4)
    assert kernel_serves(ShiftRope.full(inv))
    assert not kernel_serves(ShiftRope(inv, 128, neox=False))  # GPT-J pairs
    assert not kernel_serves(ShiftRope(inv[:32], 128))  # partial rotary
    assert not kernel_serves(ShiftRope.full(rope_inv_freq(80, 1e4)))  # head_dim 80


def pooled_rows(n_kv: list[int], hkv: int, d: int):
    """A random pool and a ``req_to_token`` whose rows 1.. hold ``n_kv[i]`` scattered slots."""
    pool = sum(n_kv) + 3
    k_cache, v_cache = torch.randn(pool, hkv, d, device=DEV), torch.randn(pool, hkv, d, device=DEV)
    req_to_token = torch.zeros(len(n_kv) + 1, 128, dtype=torch.int64, device=DEV)
    slots, at = torch.randperm(pool, device=DEV), 0
    for i, n in enumerate(n_kv):
        req_to_token[i + 1, :n] = slots[at : at + n]
        at += n
    return k_cache, v_cache, req_to_token


def test_backend_extend_through_the_kernel_equals_its_torch_path():
    """A batch of a plain row, a re-positioned row and a reader whose recomputed tokens lead its
    extend (row order != position order): the kernel path (new tokens after the recomputed ones
    in one launch, the recomputed ones masked by position in torch) equals the torch path."""
    from sglang_kvcmas.attention.spans import BatchRow, RecomputedTokens
    from sglang_kvcmas.integration.delta_attention_backend import DeltaAttnBackend

    torch.manual_seed(5)
    h, hkv, d = 9, 3, 64
    rope = ShiftRope.full(rope_inv_freq(d, 1e4))
    moved = (12, 13, 40)  # positions recomputed by the reader
    borrowed = [p for p in range(5, 61) if p not in moved]
    order = list(range(5)) + borrowed + list(moved) + list(range(61, 70))  # row -> position
    prefix_c = 5 + len(borrowed)
    rows = (None,
            BatchRow(RowSpans.of_reads("b", (SharedSpan(3, 40, -7), SharedSpan(43, 30, 250)))),
            BatchRow(RowSpans.of_reads("c", (SharedSpan(5, len(borrowed), -9),),
                                       RecomputedTokens(prefix_c, (1, 2, 3), moved),
                                       torch.tensor(order[: prefix_c + len(moved)]))))
    n_kv, n_prefix = [37, 90, len(order)], [30, 80, prefix_c]
    k_cache, v_cache, req_to_token = pooled_rows(n_kv, hkv, d)
    n_q = [k - p for k, p in zip(n_kv, n_prefix)]
    query = torch.randn(sum(n_q), h, d, device=DEV)

    def extend(kernel):
        be = DeltaAttnBackend.__new__(DeltaAttnBackend)  # the math only; no model runner
        be.shift_rope, be._layer_id, be._groups, be._batch_rows = rope, 0, {}, rows
        be.delta_kernel = kernel
        out = torch.empty_like(query)
        be._run_sdpa_forward_extend(
            query, out, k_cache, v_cache, req_to_token, torch.tensor([1, 2, 3], device=DEV),
            torch.tensor(n_kv, device=DEV), torch.tensor(n_prefix, device=DEV),
            torch.tensor(n_q, device=DEV), scaling=d ** -0.5, enable_gqa=True, causal=True)
        return out, be._groups

    (ref, _), (got, cache) = extend(False), extend(True)
    assert any(key[0] == "kernel" for key in cache)  # the kernel path ran
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def _factors(m: int, layers: int, hkv: int, d: int, r: int):
    """Random coefficients of ``m`` tokens under one orthonormal basis per layer and KV head."""
    from sglang_kvcmas.attention.deviation_factors import FactorBasis, TokenFactors

    basis = [torch.linalg.qr(torch.randn(layers, hkv, d, r))[0] for _ in range(2)]
    return TokenFactors(torch.randn(layers, m, hkv, r), torch.randn(layers, m, hkv, r),
                        FactorBasis(basis[0], basis[1], m))


# rows: (n_kv, spans (start, length, shift), factored parts (row indices, rank)); heads, kv
# heads, head_dim. Factored tokens inside shifted runs, in a shift-0 region (a run the plan
# adds), two parts of different bases and ranks in one span, a row without leaves between.
LEAF_CASES = [
    ([(90, [(4, 40, -7), (44, 30, 250)], [([5, 6, 43, 44, 73], 4), ([10, 60], 8)]),
      (33, [(2, 20, 3)], []),
      (70, [(10, 20, 5)], [([1, 2, 15, 50, 51, 68], 4)])], 8, 2, 64),
    ([(200, [(0, 64, 9), (64, 1, -1), (65, 100, 40)], [(list(range(60, 70)), 16)])], 4, 4, 128),
]


@pytest.mark.parametrize("rows, h, hkv, d", LEAF_CASES)
def test_kernel_decode_reads_factored_leaves_as_the_reference(rows, h, hkv, d):
    """Decode through the kernel with factored tokens' deviations packed per span equals the
    torch path: keys re-positioned, each factored token's deviation added (its key deviation
    rotated at its position), then SDPA; at two layers (each packs its own factors)."""
    from sglang_kvcmas.attention.deviation_factors import LeafReads

    torch.manual_seed(d + len(rows))
    layers = 3
    rope = ShiftRope.full(rope_inv_freq(d, 1e4))
    pool = sum(n for n, _, _ in rows) + 5
    k_pool, v_pool = torch.randn(pool, hkv, d, device=DEV), torch.randn(pool, hkv, d, device=DEV)
    slots = torch.randperm(pool, device=DEV)
    kvs, shifts, leaves, at = [], [], [], 0
    for n, spans, parts in rows:
        kvs.append(slots[at : at + n])
        at += n
        shifts.append(RowSpans.of_reads("r", tuple(SharedSpan(*s) for s in spans)).key_shifts)
        idx = [torch.tensor(t, dtype=torch.int64) for t, _ in parts]
        leaves.append(LeafReads([(i, i, _factors(len(i), layers, hkv, d, r))
                                 for i, (_, r) in zip(idx, parts)]) if parts else None)
    q = torch.randn(len(rows), h, d, device=DEV)
    planned = plan_shifted(kvs, shifts, hkv, rope, DEV, leaves=leaves)
    for layer in (0, 2):
        out = shifted_attention(q, k_pool, v_pool, planned, d ** -0.5, layer)
        for i, (kv, s, lr) in enumerate(zip(kvs, shifts, leaves)):
            k, v = rotate_keys(k_pool[kv], s, rope), v_pool[kv]
            if lr is not None:
                k, v = lr.layer(layer).apply(k, v, rope)
            want = scaled_dot_product_attention(
                q[i][:, None][None], k.movedim(0, 1)[None], v.movedim(0, 1)[None],
                enable_gqa=True)[0, :, 0]
            torch.testing.assert_close(out[i], want, atol=3e-5, rtol=1e-4)


def test_runs_hold_every_factored_token_and_placement_finds_them():
    """A shift-0 region becomes a span where it holds a factored token (only there); every
    token lands on its own packed row; a token outside the spans is refused."""
    from sglang_kvcmas.attention.kernel_reads import place_leaves
    from sglang_kvcmas.attention.deviation_factors import LeafReads

    ks = KeyShifts.of_row(2, torch.tensor([3, 3, 0, 0, -5, -5, 0, 0]))  # rows 2..9
    rows = torch.tensor([3, 4, 9])  # the shift-0 rows 0..1 hold none: no span there
    runs = row_runs(ks, 10, rows)
    assert runs == (SharedSpan(2, 2, 3), SharedSpan(4, 2, 0), SharedSpan(6, 2, -5),
                    SharedSpan(8, 2, 0))
    assert row_runs(ks, 10, torch.tensor([], dtype=torch.int64)) == row_runs(ks, 10)
    f = _factors(3, 1, 1, 32, 4)
    placed = place_leaves([runs], [LeafReads([(rows, rows, f)])])
    # packed rows: span 0 -> 0..1, span 1 -> 2..3, span 2 -> 4..5, span 3 -> 6..7
    assert placed.parts[0][1].tolist() == [1, 2, 7] and placed.block_r == 16
    assert placed.num_rows == 8 and placed.num_spans == 4
    with pytest.raises(ValueError, match="outside"):
        place_leaves([runs[:1]], [LeafReads([(rows, rows, f)])])


def test_backend_decode_and_extend_read_factored_rows_through_the_kernel():
    """A batch with a reader over factored leaves stays on the kernel (decode, and an extend
    without recomputed tokens) and equals the torch path; a row whose factored tokens are not
    at their row index sends the batch to the torch path."""
    from sglang_kvcmas.attention.deviation_factors import LeafReads, RowLeaves
    from sglang_kvcmas.attention.spans import BatchRow
    from sglang_kvcmas.integration.delta_attention_backend import DeltaAttnBackend

    torch.manual_seed(11)
    h, hkv, d, layers = 6, 2, 64, 2
    rope = ShiftRope.full(rope_inv_freq(d, 1e4))
    at = torch.tensor([4, 5, 30, 41, 42])
    shifted = RowSpans.of_reads("f", (SharedSpan(3, 40, -7), SharedSpan(43, 30, 250)))

    def factored(rows, positions):
        leaves = LeafReads([(rows, positions, _factors(rows.numel(), layers, hkv, d, 4))])
        return BatchRow(RowSpans(shifted.rid, shifted.key_shifts, leaves=RowLeaves(leaves)))

    n_kv, n_prefix = [37, 90, 80], [30, 80, 75]
    k_cache, v_cache, req_to_token = pooled_rows(n_kv, hkv, d)
    n_q = [k - p for k, p in zip(n_kv, n_prefix)]
    idx = torch.tensor([1, 2, 3], device=DEV)

    def run(rows, kernel, layer, decode):
        be = DeltaAttnBackend.__new__(DeltaAttnBackend)  # the math only; no model runner
        be.shift_rope, be._layer_id, be._groups, be._batch_rows = rope, layer, {}, rows
        be.delta_kernel = kernel
        if decode:
            query = torch.randn(3, h, d, generator=torch.Generator().manual_seed(layer))
            out = torch.empty_like(query)
            be._run_sdpa_forward_decode(query.to(DEV), out, k_cache, v_cache, req_to_token, idx,
                                        torch.tensor(n_kv, device=DEV), scaling=d ** -0.5,
                                        enable_gqa=True)
        else:
            query = torch.randn(sum(n_q), h, d, generator=torch.Generator().manual_seed(layer))
            out = torch.empty_like(query)
            be._run_sdpa_forward_extend(
                query.to(DEV), out, k_cache, v_cache, req_to_token, idx,
                torch.tensor(n_kv, device=DEV), torch.tensor(n_prefix, device=DEV),
                torch.tensor(n_q, device=DEV), scaling=d ** -0.5, enable_gqa=True, causal=True)
        if decode and not kernel:  # the torch path: the factored row in the batched read
            plan = next(v for key, v in be._groups.items() if key[0] == "decode")
            assert 2 not in plan.rest and 2 in torch.cat([b.rows for b in plan.buckets])
        return out, any(key[0] == "kernel" for key in be._groups)

    rows = (None, BatchRow(RowSpans.of_reads("b", (SharedSpan(3, 40, -7),))), factored(at, at))
    for decode in (True, False):
        for layer in (0, 1):
            (ref, _) = run(rows, False, layer, decode)
            got, kernel = run(rows, True, layer, decode)
            assert kernel
            torch.testing.assert_close(got, ref, atol=3e-5, rtol=1e-4)
    moved = (*rows[:2], factored(at, at + 2))  # rows are not positions: the torch path
    (ref, _), (got, kernel) = run(moved, False, 0, True), run(moved, True, 0, True)
    assert not kernel
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("ranks", [(4, 4, 4, 4), (4, 8, 4, 4)])
def test_packing_a_layer_in_one_scatter_equals_the_part_by_part_reference(ranks):
    """Three rows, parts of one rank (the scatter) or mixed ranks (the reference itself):
    every packed coefficient and basis column as the reference places it; a span that holds
    none of a part's tokens carries none of its basis."""
    from sglang_kvcmas.attention.kernel_reads import place_leaves
    from sglang_kvcmas.attention.deviation_factors import LeafReads

    torch.manual_seed(3)
    hkv, d, layers = 2, 32, 2
    shifts = [KeyShifts.of_spans((SharedSpan(2, 30, 5), SharedSpan(32, 20, -3))),
              KeyShifts.of_spans((SharedSpan(0, 10, 1),)), None]
    picks = [([3, 4, 40], [31, 50]), ([2, 9],), ([0, 5, 6],)]
    leaves, runs, r = [], [], iter(ranks)
    for s, row in zip(shifts, picks):
        parts = [(torch.tensor(p), torch.tensor(p), _factors(len(p), layers, hkv, d, next(r)))
                 for p in row]
        leaves.append(LeafReads(parts))
        runs.append(row_runs(s, 60, leaves[-1].rows))
    placed = place_leaves(runs, leaves)
    assert [len(s) for *_, s in placed.parts] == [2, 2, 1, 1]  # spans holding each part
    for layer in range(layers):
        got = placed.pack(layer, hkv, d, torch.float32, DEV)
        want = placed.pack_reference(layer, hkv, d, torch.float32, DEV)
        for name in ("k_u", "k_c", "v_u", "v_c"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
