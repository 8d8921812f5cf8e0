"""Batched decode over re-positioned rows equals the per-row read, row by row."""

from __future__ import annotations

import pytest
import torch

from sglang_kvcmas.attention.batched_decode import batched_shift_decode, plan_batched_decode
from sglang_kvcmas.attention.rope import ShiftRope, rope_inv_freq
from sglang_kvcmas.attention.shifted_query import grouped_shift_decode
from sglang_kvcmas.attention.spans import KeyShifts

ROPES = {
    "neox": ShiftRope.full(rope_inv_freq(64, 1e5)),
    "gptj_partial": ShiftRope(rope_inv_freq(32, 1e4), head_dim=64, neox=False),
}


def per_row(query, k_cache, v_cache, slots, shifts, rope, scale):
    """The reference: each row read alone (``grouped_shift_decode``)."""
    outs = []
    for i, (sl, ks) in enumerate(zip(slots, shifts)):
        n = sl.numel()
        ks = ks or KeyShifts.none()
        order, groups = ks.grouped(n)
        tok = sl[order]
        outs.append(grouped_shift_decode(query[i][:, None], k_cache[tok].movedim(0, 1),
                                         v_cache[tok].movedim(0, 1), ks.shifts, groups, rope,
                                         scale)[:, 0])
    return torch.stack(outs)


def batch(lens, n_shifts, hkv, seed):
    """Rows of ``lens`` keys over one pool; row i with ``n_shifts[i]`` distinct shifts in
    scattered runs (0: no shifts), the row's last keys its own (shift 0)."""
    g = torch.Generator().manual_seed(seed)
    pool = 4 * sum(lens) + 8
    slots = [torch.randperm(pool, generator=g)[:n] for n in lens]
    shifts = []
    for n, s in zip(lens, n_shifts):
        if s == 0:
            shifts.append(None)
            continue
        values = torch.randint(-300, 300, (s,), generator=g)
        m = max(1, n - 3)  # the borrowed part; the rest is the row's own
        runs = torch.randint(0, s, (m,), generator=g)
        runs[torch.rand(m, generator=g) < 0.3] = -1  # exact leaves scattered through (shift 0)
        shift = torch.where(runs >= 0, values[runs.clamp(min=0)], torch.zeros(m, dtype=torch.int64))
        shifts.append(KeyShifts.of_row(0, shift))
    return pool, slots, shifts


CASES = [
    # lens, distinct shifts per row, heads, kv heads
    ([1], [1], 4, 4),
    ([17, 5, 130], [2, 3, 1], 9, 3),
    ([64, 65, 66, 200, 201, 7], [4, 4, 2, 3, 1, 2], 8, 2),  # three buckets
    ([300, 250, 310], [0, 2, 6], 6, 1),  # a plain row; a row with six shifts goes to rest
    ([33] * 5, [1, 2, 3, 4, 2], 4, 1),
]


@pytest.mark.parametrize("rope_name", sorted(ROPES))
@pytest.mark.parametrize("lens,n_shifts,h,hkv", CASES)
def test_batched_equals_per_row(lens, n_shifts, h, hkv, rope_name):
    rope = ROPES[rope_name]
    pool, slots, shifts = batch(lens, n_shifts, hkv, seed=len(lens) * 31 + h)
    torch.manual_seed(sum(lens))
    d = 64
    k_cache, v_cache = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
    query = torch.randn(len(lens), h, d)
    plan = plan_batched_decode(slots, shifts, rope)
    out = torch.full_like(query, float("nan"))
    batched_shift_decode(query, k_cache, v_cache, plan, rope, d**-0.5, out)
    ref = per_row(query, k_cache, v_cache, slots, shifts, rope, d**-0.5)
    rest = set(plan.rest)
    assert rest == {i for i, s in enumerate(shifts)
                    if s is not None and s.shifts.numel() > 4}
    bucketed = sorted(int(r) for b in plan.buckets for r in b.rows)
    assert bucketed == [i for i in range(len(lens)) if i not in rest]  # each row once
    for b in plan.buckets:  # padding bounded
        n = [slots[int(r)].numel() for r in b.rows]
        assert max(n) <= 1.3 * min(n)
    for i in range(len(lens)):
        if i in rest:
            assert torch.isnan(out[i]).all()  # left to the per-row path
        else:
            torch.testing.assert_close(out[i], ref[i], atol=3e-6, rtol=1e-5)


def test_rows_not_taken_are_left_to_the_caller():
    rope = ROPES["neox"]
    _, slots, shifts = batch([10, 20, 30], [1, 2, 3], 1, seed=3)
    plan = plan_batched_decode([slots[0], None, slots[2]], shifts, rope)
    assert plan.rest == (1,)
    assert sorted(int(r) for b in plan.buckets for r in b.rows) == [0, 2]


def test_buckets_bound_the_keys_they_gather():
    rope = ROPES["neox"]
    _, slots, shifts = batch([40] * 7 + [300], [2] * 8, 1, seed=5)
    plan = plan_batched_decode(slots, shifts, rope, max_keys=100)
    sizes = sorted(len(b.rows) for b in plan.buckets)
    assert sizes == [1, 1, 2, 2, 2]  # 2 x 40 <= 100 < 3 x 40; the 300-key row alone
    assert all(b.slots.numel() <= 100 or len(b.rows) == 1 for b in plan.buckets)


@pytest.mark.parametrize("rope_name", sorted(ROPES))
def test_factored_tokens_add_their_deviations_as_the_gathered_rows_do(rope_name):
    """Rows reading some tokens through factored leaves (two parts of different ranks in one
    row, one row's factors all zero at a layer, rows without leaves beside them): batched
    decode with the deviations as additive score and value terms equals the reference that
    adds them to the gathered, re-positioned keys and values, then attends."""
    from sglang_kvcmas.attention.deviation_factors import FactorBasis, LeafReads, TokenFactors
    from sglang_kvcmas.attention.span_reads import rotate_keys
    from torch.nn.functional import scaled_dot_product_attention

    rope = ROPES[rope_name]
    lens, n_shifts, h, hkv, d, layers = [40, 45, 50, 130], [2, 1, 0, 3], 6, 2, 64, 2
    pool, slots, first = batch(lens, n_shifts, hkv, seed=17)
    g = torch.Generator().manual_seed(4)

    def factors(m, r, zero_layer=None):
        coef = [torch.randn(layers, m, hkv, r, generator=g) for _ in range(2)]
        if zero_layer is not None:
            for c in coef:
                c[zero_layer] = 0
        basis = [torch.linalg.qr(torch.randn(layers, hkv, d, r, generator=g))[0]
                 for _ in range(2)]
        return TokenFactors(coef[0], coef[1], FactorBasis(basis[0], basis[1], m))

    def part(rows, r, moved=0, zero_layer=None):
        rows = torch.tensor(rows)
        return rows, rows + moved, factors(len(rows), r, zero_layer)

    leaves = [LeafReads([part([1, 5, 30], 4), part([7, 31], 8)]),
              LeafReads([part([0, 2, 3], 4, zero_layer=1)]),
              None,
              LeafReads([part([100, 101], 4, moved=3)])]  # positions not the row indices
    k_cache, v_cache = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
    query = torch.randn(len(lens), h, d)
    # The same leaves read under other shifts (a plan of other rows' shifts): the deviations
    # kept rotated for the first shifts must not be read under the second.
    other = batch(lens, n_shifts, hkv, seed=18)[2]
    for layer, shifts in [(0, first), (1, first), (0, other), (1, other), (0, first)]:
        plan = plan_batched_decode(slots, shifts, rope, leaves=leaves)
        assert not plan.rest
        out = torch.full_like(query, float("nan"))
        batched_shift_decode(query, k_cache, v_cache, plan, rope, d**-0.5, out, layer)
        for i, (sl, ks, lr) in enumerate(zip(slots, shifts, leaves)):
            k = rotate_keys(k_cache[sl], ks or KeyShifts.none(), rope)
            v = v_cache[sl]
            if lr is not None and lr.layer(layer) is not None:
                k, v = lr.layer(layer).apply(k, v, rope)
            want = scaled_dot_product_attention(
                query[i][:, None][None], k.movedim(0, 1)[None], v.movedim(0, 1)[None],
                enable_gqa=True)[0, :, 0]
            torch.testing.assert_close(out[i], want, atol=3e-6, rtol=1e-5)
