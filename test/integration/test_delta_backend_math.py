"""The serving read path: span re-positioning equals the lab's torch reference; the backend's
extend with recomputed tokens, their placement, and the head-mass probe."""

from __future__ import annotations

import pytest
import torch
from sglang_kvcmas.attention.delta_batch import DeltaRequest
from sglang_kvcmas.attention.rope import ShiftRope, apply_rope, rope_inv_freq
from sglang_kvcmas.attention.span_reads import transform_spans
from sglang_kvcmas.attention.spans import BatchRow, RecomputedTokens, RowSpans, SharedSpan
from sglang_kvcmas_lab.attention.reference import reader_kv


def test_shift_equals_reference_and_recomputation():
    torch.manual_seed(0)
    inv = rope_inv_freq(64, 1e5)
    pool_k, pool_v = torch.randn(50, 3, 64), torch.randn(50, 3, 64)
    idx = torch.randperm(50)[:30]
    spans = (SharedSpan(4, 9, shift=-7), SharedSpan(13, 5, shift=11))
    k = transform_spans(pool_k[idx].clone(), RowSpans.of_reads("r", spans), inv, {})
    ref_k, ref_v = reader_kv(pool_k, pool_v, DeltaRequest(idx, 3, spans), None, inv)
    torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_v[idx], ref_v)  # values are read as stored
    # a key rotated at owner position p, shifted by d, equals the key rotated at p + d
    raw = torch.randn(9, 3, 64)
    owner = apply_rope(raw, torch.arange(20, 29), inv)
    row = RowSpans.of_reads("r", (SharedSpan(0, 9, shift=-15),))
    shifted = transform_spans(owner.clone(), row, inv)
    torch.testing.assert_close(shifted, apply_rope(raw, torch.arange(5, 14), inv), atol=1e-4,
                               rtol=1e-4)


def _backend():
    from sglang_kvcmas.integration.delta_attention_backend import DeltaAttnBackend

    be = DeltaAttnBackend.__new__(DeltaAttnBackend)  # the math only; no model runner
    be.shift_rope, be._layer_id, be._cos_sin = ShiftRope.full(rope_inv_freq(64, 1e5)), 0, {}
    be._batch_rows = None
    return be


def test_recomputed_tokens_extend_equals_attention_in_position_order():
    """A row whose recomputed shared tokens sit after its borrowed ones (row order != position
    order) attends exactly as the same tokens in position order with causal attention."""
    from torch.nn.functional import scaled_dot_product_attention

    torch.manual_seed(2)
    inv, H, Hkv, d = rope_inv_freq(64, 1e5), 6, 2, 64
    n, own, moved = 23, 5, (5, 6, 7, 12)  # positions 5-7 and 12 recomputed, the rest borrowed
    shift = -9  # the owner computed the borrowed tokens 9 positions later
    q_raw, k_raw, v = torch.randn(n, H, d), torch.randn(n, Hkv, d), torch.randn(n, Hkv, d)
    pos = torch.arange(n)
    ref = scaled_dot_product_attention(
        apply_rope(q_raw, pos, inv).movedim(0, 1), apply_rope(k_raw, pos, inv).movedim(0, 1),
        v.movedim(0, 1), is_causal=True, enable_gqa=True).movedim(0, 1)

    borrowed = [p for p in range(own, 15) if p not in moved]  # shared context ends at 15
    order = list(range(own)) + borrowed + list(moved) + list(range(15, n))  # row -> position
    prefix_len = own + len(borrowed)
    k_cache, v_cache = torch.zeros(64, Hkv, d), torch.zeros(64, Hkv, d)
    slots = torch.randperm(64)[:n]
    for row, p in enumerate(order):
        stored_at = p - shift if own <= row < prefix_len else p  # borrowed: owner's position
        k_cache[slots[row]] = apply_rope(k_raw[p : p + 1], torch.tensor([stored_at]), inv)[0]
        v_cache[slots[row]] = v[p]
    req_to_token = torch.zeros(2, 64, dtype=torch.int64)
    req_to_token[1, :n] = slots
    be = _backend()
    be._batch_rows = (BatchRow(RowSpans.of_reads("r", (SharedSpan(own, len(borrowed), shift),),
                                        RecomputedTokens(prefix_len, tuple(moved), moved),
                                        torch.tensor(order[: prefix_len + len(moved)]))),)
    ext = order[prefix_len:]
    query = apply_rope(q_raw[ext], torch.tensor(ext), inv)
    out = torch.empty_like(query)
    be._run_sdpa_forward_extend(
        query, out, k_cache, v_cache, req_to_token, torch.tensor([1]), torch.tensor([n]),
        torch.tensor([prefix_len]), torch.tensor([len(ext)]), scaling=d**-0.5,
        enable_gqa=True, causal=True)
    torch.testing.assert_close(out, ref[ext], atol=1e-5, rtol=1e-5)


def test_recomputed_tokens_are_placed_at_their_true_positions():
    from types import SimpleNamespace

    import pytest

    be = _backend()
    be._batch_rows = (None, BatchRow(RowSpans.of_reads(
        "r", (SharedSpan(2, 4, 1),), RecomputedTokens(6, (71, 72), (2, 3)),
        torch.tensor([0, 1, 4, 5, 6, 7, 2, 3]))))
    batch = SimpleNamespace(
        extend_prefix_lens_cpu=[0, 6], extend_seq_lens_cpu=[3, 4],
        req_pool_indices=torch.tensor([0, 3]), input_ids=torch.arange(7) + 100,
        positions=torch.tensor([0, 1, 2, 6, 7, 8, 9]))
    be._place_recomputed(batch)
    assert batch.input_ids.tolist() == [100, 101, 102, 71, 72, 105, 106]
    assert batch.positions.tolist() == [0, 1, 2, 2, 3, 8, 9]
    batch.extend_prefix_lens_cpu = [0, 5]  # a row that does not extend where planned
    with pytest.raises(RuntimeError, match="recomputed tokens start at row 6"):
        be._place_recomputed(batch)
    # A batch SGLang built from device tensors alone has no host lists: read the tensors.
    batch = SimpleNamespace(
        extend_prefix_lens_cpu=None, extend_seq_lens_cpu=None,
        extend_prefix_lens=torch.tensor([0, 6]), extend_seq_lens=torch.tensor([3, 4]),
        req_pool_indices=torch.tensor([0, 3]), input_ids=torch.arange(7) + 100,
        positions=torch.tensor([0, 1, 2, 6, 7, 8, 9]))
    be._place_recomputed(batch)
    assert batch.positions.tolist() == [0, 1, 2, 2, 3, 8, 9]


def test_head_mass_equals_softmax_mass_on_the_head():
    from sglang_kvcmas.attention import span_reads as dab

    torch.manual_seed(3)
    for n_q, n_kv, h_kv, gqa in ((1, 17, 1, 3), (81, 300, 3, 3), (5, 5, 2, 1)):
        q, k = torch.randn(h_kv * gqa, n_q, 16), torch.randn(h_kv, n_kv, 16)
        k_pos = torch.randperm(n_kv)
        q_pos = torch.arange(n_kv - n_q, n_kv)
        old, dab.PROBE_BLOCK = dab.PROBE_BLOCK, 7  # several query blocks
        try:
            got = dab.head_mass(q, k, q_pos, k_pos, 0.25, 2, 9)
        finally:
            dab.PROBE_BLOCK = old
        kk = k.repeat_interleave(gqa, 0)
        p = ((q @ kk.transpose(1, 2)) * 0.25).masked_fill(
            k_pos[None, None] > q_pos[None, :, None], float("-inf")).softmax(-1)
        want = p[:, :, 2:9].sum(-1).mean(0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert dab.head_mass(torch.randn(2, 0, 4), torch.randn(1, 3, 4), torch.arange(0),
                         torch.arange(3), 1.0, 0, 1).shape == (0,)


def test_head_mass_probe_keeps_only_rows_of_the_shared_context():
    from sglang_kvcmas.attention.spans import HeadMassProbe

    probe = HeadMassProbe.for_row(3, 10, 20)
    probe.add(15, torch.full((8,), 0.5))  # rows 15..22: only 15..19 exist
    probe.add(25, torch.full((48,), 0.9))  # an extend that starts past the shared context
    assert probe.mean(14, 21).tolist() == [0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.0]


def test_tail_attention_equals_the_padded_square_over_awkward_sizes():
    """A plain row's extend: its new queries only equal the rows of the padded square."""
    from sglang_kvcmas.attention.span_reads import padded_tail_attention, tail_attention

    torch.manual_seed(5)
    for H, Hkv, n_prefix, n_q, causal in [(6, 2, 0, 1, True), (6, 2, 0, 13, True),
                                          (9, 3, 37, 1, True), (9, 3, 37, 5, True),
                                          (4, 4, 255, 130, True), (6, 2, 11, 7, False)]:
        q = torch.randn(H, n_q, 64)
        k, v = torch.randn(Hkv, n_prefix + n_q, 64), torch.randn(Hkv, n_prefix + n_q, 64)
        got = tail_attention(q, k, v, n_prefix, causal, 0.125, True)
        ref = padded_tail_attention(q, k, v, n_prefix, causal, 0.125, True)
        assert got.shape == (H, n_q, 64)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_plain_rows_in_a_batch_with_spans_attend_as_sglang_does(monkeypatch):
    """A batch goes through the backend's own loop when any row reads spans; its plain rows
    (nothing borrowed) read as SGLang's torch backend reads them."""
    from sglang_kvcmas.attention.span_reads import tail_attention

    torch.manual_seed(6)
    H, Hkv, d = 6, 2, 64
    lens, prefixes = [40, 9, 23], [31, 0, 20]
    k_cache, v_cache = torch.randn(128, Hkv, d), torch.randn(128, Hkv, d)
    req_to_token = torch.zeros(4, 64, dtype=torch.int64)
    slots = torch.randperm(128)
    at = 0
    for r, n in enumerate(lens):
        req_to_token[r + 1, :n] = slots[at : at + n]
        at += n
    n_q = [n - p for n, p in zip(lens, prefixes)]
    query = torch.randn(sum(n_q), H, d)
    args = (k_cache, v_cache, req_to_token, torch.tensor([1, 2, 3]), torch.tensor(lens),
            torch.tensor(prefixes), torch.tensor(n_q))
    be = _backend()
    ref = torch.empty_like(query)
    super(type(be), be)._run_sdpa_forward_extend(query, ref, *args, scaling=d**-0.5,
                                                 enable_gqa=True, causal=True)
    span_row = RowSpans.of_reads("r", (SharedSpan(2, 6, shift=-3),))
    be._batch_rows = (None, BatchRow(span_row), None)  # row 2 reads a span: the loop runs
    from sglang_kvcmas.integration import delta_attention_backend as backend

    calls = []
    monkeypatch.setattr(backend, "tail_attention",
                        lambda *a: calls.append(a[3]) or tail_attention(*a))
    out = torch.empty_like(query)
    be._run_sdpa_forward_extend(query, out, *args, scaling=d**-0.5, enable_gqa=True,
                                causal=True)
    assert calls == [31, 0, 20]  # every row without a position mask (its keys re-positioned)
    plain = torch.cat([torch.arange(0, n_q[0]), torch.arange(n_q[0] + n_q[1], sum(n_q))])
    torch.testing.assert_close(out[plain], ref[plain], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mass_equals_tail_attention_and_head_mass_over_awkward_sizes(dtype):
    """A probed plain row on CPU: the attention is tail_attention's, bit for bit, and the mass
    from the kernel's log-sum-exp is head_mass's, to float rounding; queries inside the head
    (a first turn) see only the head keys before them."""
    from sglang_kvcmas.attention.span_reads import (
        fused_mass_serves,
        head_mass,
        tail_attention,
        tail_attention_and_mass,
    )

    torch.manual_seed(7)
    for H, Hkv, n_prefix, n_q, head in [(6, 2, 0, 1, (0, 1)), (6, 2, 0, 40, (3, 25)),
                                        (9, 3, 37, 1, (2, 30)), (9, 3, 37, 150, (5, 37)),
                                        (4, 4, 255, 130, (0, 200)), (9, 3, 10, 20, (4, 21)),
                                        (9, 3, 0, 12, (3, 40))]:  # a chunk inside the head
        q = torch.randn(H, n_q, 64, dtype=dtype)
        k = torch.randn(Hkv, n_prefix + n_q, 64, dtype=dtype)
        v = torch.randn(Hkv, n_prefix + n_q, 64, dtype=dtype)
        assert fused_mass_serves(q, True) and not fused_mass_serves(q, False)
        out, mass = tail_attention_and_mass(q, k, v, n_prefix, 0.125, *head)
        assert torch.equal(out, tail_attention(q, k, v, n_prefix, True, 0.125, True))
        pos = torch.arange(n_prefix + n_q)
        want = head_mass(q, k, pos[n_prefix:], pos, 0.125, *head)
        assert mass.dtype == torch.float32 and mass.shape == (n_q,)
        torch.testing.assert_close(mass, want, atol=1e-6, rtol=1e-4)


def test_a_probed_plain_row_records_the_mass_of_the_reference_path(monkeypatch):
    """The backend's loop over a batch with a probed plain row (an owner on CPU) and a plain
    row: outputs as tail_attention, and the probe records what add_row_mass would."""
    from sglang_kvcmas.attention.spans import HeadMassProbe
    from sglang_kvcmas.integration import delta_attention_backend as backend

    torch.manual_seed(8)
    H, Hkv, d = 6, 2, 64
    lens, prefixes = [40, 23], [12, 20]
    k_cache, v_cache = torch.randn(128, Hkv, d), torch.randn(128, Hkv, d)
    req_to_token = torch.zeros(3, 64, dtype=torch.int64)
    req_to_token[1, :40], req_to_token[2, :23] = torch.arange(40), torch.arange(50, 73)
    n_q = [n - p for n, p in zip(lens, prefixes)]
    query = torch.randn(sum(n_q), H, d)
    args = (k_cache, v_cache, req_to_token, torch.tensor([1, 2]), torch.tensor(lens),
            torch.tensor(prefixes), torch.tensor(n_q))

    def run(fused):
        be = _backend()
        be._layer_id = 2  # a probe layer
        probe = HeadMassProbe.for_row(2, 9, 40)
        be._batch_rows = (BatchRow(probe=probe), None)
        monkeypatch.setattr(backend, "fused_mass_serves", lambda q, causal: fused)
        out = torch.empty_like(query)
        be._run_sdpa_forward_extend(query, out, *args, scaling=d**-0.5, enable_gqa=True,
                                    causal=True)
        return out, probe.mean(12, 40)

    (out, mass), (ref_out, ref_mass) = run(True), run(False)
    assert torch.equal(out, ref_out)
    assert mass.abs().sum() > 0
    torch.testing.assert_close(mass, ref_mass, atol=1e-6, rtol=1e-4)


def test_the_kernel_plan_keeps_a_row_whose_leaves_are_zero_at_the_first_layer():
    """The kernels' plan is made once per batch, at the first layer that reads it. A row read at
    its owner's positions through factored leaves differs from plain attention only where its
    deviations do: not at layer 0 (a token at its owner's position has its owner's K/V), at
    layer 1. Decoding layer 0 then layer 1 through the kernels (Triton's interpreter on CPU)
    reads layer 1 as the torch path does, deviations included."""
    from sglang_kvcmas.attention.deviation_factors import (
        FactorBasis,
        LeafReads,
        RowLeaves,
        TokenFactors,
    )
    from sglang_kvcmas.attention.spans import KeyShifts

    torch.manual_seed(9)
    n_layers, H, Hkv, d, r, n = 2, 4, 2, 64, 4, 20
    k_f, v_f = torch.randn(n_layers, 3, Hkv, r), torch.randn(n_layers, 3, Hkv, r)
    k_f[0], v_f[0] = 0, 0  # layer 0: no deviation
    basis = FactorBasis(torch.randn(n_layers, Hkv, d, r), torch.randn(n_layers, Hkv, d, r), 3)
    at = torch.tensor([4, 5, 6])
    shifted = RowSpans("a", KeyShifts.of_row(2, torch.full((8,), 5)))
    factored = RowSpans("b", KeyShifts.none(), leaves=RowLeaves(
        reads=LeafReads([(at, at.clone(), TokenFactors(k_f, v_f, basis))])))
    k_cache, v_cache = torch.randn(2 * n, Hkv, d), torch.randn(2 * n, Hkv, d)
    query = torch.randn(2, H, d)
    args = (k_cache, v_cache, torch.arange(2 * n).view(2, n), torch.tensor([0, 1]),
            torch.tensor([n, n]))

    def decode(kernel: bool, layers: tuple[int, ...]) -> torch.Tensor:
        be = _backend()
        be.shift_rope = ShiftRope.full(rope_inv_freq(d))
        be.delta_kernel, be._groups = kernel, {}
        be._batch_rows = (BatchRow(shifted), BatchRow(factored))
        out = torch.empty_like(query)
        for layer in layers:
            be._layer_id = layer
            be._run_sdpa_forward_decode(query, out, *args, scaling=d**-0.5, enable_gqa=True)
        return out

    torch.testing.assert_close(decode(True, (0, 1)), decode(False, (1,)), atol=2e-5, rtol=2e-5)


def test_cuda_graphs_are_refused_naming_the_flag_that_turns_them_off():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    assert callable(AttentionBackend.init_cuda_graph_state)  # what SGLang's graph runner calls
    with pytest.raises(RuntimeError, match="--disable-cuda-graph"):
        _backend().init_cuda_graph_state(8, 64)
