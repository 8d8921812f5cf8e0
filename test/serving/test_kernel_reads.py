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
    pool = sum(n_kv) + 3
    k_cache, v_cache = torch.randn(pool, hkv, d, device=DEV), torch.randn(pool, hkv, d, device=DEV)
    req_to_token = torch.zeros(4, 128, dtype=torch.int64, device=DEV)
    slots, at = torch.randperm(pool, device=DEV), 0
    for i, n in enumerate(n_kv):
        req_to_token[i + 1, :n] = slots[at : at + n]
        at += n
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
