"""``kvcmas_delta`` attention backend: torch_native attention that reads borrowed spans
re-positioned, registered with SGLang's attention registry.

SGLang's torch_native backend gathers, per request and layer, ``k_cache[req_to_token[row, :n]]``
(a transient copy) and runs SDPA on it. This backend does the same and, for a row whose entry in
``forward_batch`` (``batch_rows.py``) lists borrowed spans, re-positions the gathered keys by
their per-key shifts before SDPA (``attention/span_reads.py``; values need nothing). Nothing is
written back to the pool: the owner's KV stays exact and shared. Rows without an entry (every
exact request, every request when sharing is off) take the parent's code path unchanged.

Recomputed tokens (``attention.spans.RecomputedTokens``): the tree cache leaves them out of the
row's prefix, so SGLang extends the row from a prefix that many tokens shorter;
:meth:`DeltaAttnBackend.init_forward_metadata` writes their ids and true positions into the
first extend slots of ``forward_batch.input_ids`` / ``positions`` (the model applies RoPE at the
true positions), and extend masks by true position instead of row order.

Decode needs no mask (every cached token precedes the query): it rotates each row's query once
per shift instead of every borrowed key, the batch's re-positioned rows together
(``attention/batched_decode.py``), rows of many owners one at a time
(``attention/shifted_query.py``); rows that read nothing borrowed take SDPA as the parent does.
On GPU, for a model whose rotary the kernels tile, the delta kernels read the whole batch in
one launch per layer (``attention/kernel_reads.py``): every decode, and every extend's new tokens
after its recomputed ones (those stay in PyTorch, masked by true position). Whether a batch takes
the kernels is decided once per batch (``dispatch_route``).

Head-mass probe (``attention.spans.HeadMassProbe``): for a row that will register new shared
tokens, extend attention at the probe layers also records each token's mass on the row's agent
head (``attention/probe_reads.py``); a plain row on CPU takes it from the attention's own
log-sum-exp (``span_reads.tail_attention_and_mass``). A batch whose probed rows read nothing
borrowed comes here only over torch_native (``shared_backends``).

Factored leaves (leaf mode ``factored``, ``attention.deviation_factors.RowLeaves``): a row's
extend factors, at each layer, the deviation of the recomputed tokens it keeps
(``span_reads.gather_pairs``); a later row reads those tokens as the owner's slots,
re-positioned, plus their deviation, in extend and in decode. A row or layer without deviations
(none, or all zero) takes the paths above unchanged, bit for bit.

RoPE: the shift rotates with the model's rotary embedding as SGLang built it
(``rope_shift.py``); a model it cannot serve exactly is refused when this backend starts.
Over SGLang's ``triton`` and ``flashinfer`` backends, the batches that read borrowed KV are sent
here (``shared_backends.py``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from torch.nn.functional import scaled_dot_product_attention

from sglang_kvcmas.attention.batched_decode import (
    BatchedDecodePlan,
    batched_shift_decode,
    plan_batched_decode,
)
from sglang_kvcmas.attention.deviation_factors import TokenDeltas
from sglang_kvcmas.attention.kernel_reads import (
    ShiftedPlan,
    kernel_serves,
    plan_shifted,
    shifted_attention,
)
from sglang_kvcmas.attention.probe_reads import add_row_mass, record_head_mass
from sglang_kvcmas.attention.shifted_query import grouped_shift_decode
from sglang_kvcmas.attention.span_reads import (
    fused_mass_serves,
    gather_pairs,
    rotate_keys,
    tail_attention,
    tail_attention_and_mass,
)
from sglang_kvcmas.attention.spans import BatchRow, HeadMassProbe, RowSpans, is_probe_layer
from sglang_kvcmas.integration import inflight_fence
from sglang_kvcmas.integration.batch_rows import cache_of_forward, rows_of_forward
from sglang_kvcmas.integration.dispatch_route import KERNEL, Route, decide, route_of
from sglang_kvcmas.integration.rope_shift import shift_rope_for_runner

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

BACKEND_NAME = "kvcmas_delta"


class DeltaAttnBackend(TorchNativeAttnBackend):
    """torch_native + shared-span re-positioning and deltas (see module docstring)."""

    delta_kernel = False
    """Read re-positioned rows with the delta kernels (set per model and device at start)."""

    def __init__(self, model_runner: ModelRunner):
        super().__init__(model_runner)
        # The model's rotary as SGLang built it, or a refusal (UnsupportedRope) before serving.
        self.shift_rope = shift_rope_for_runner(model_runner)
        # Re-positioned keys through the delta kernels on GPU where they read the model's keys
        # exactly, and on CPU in Triton's interpreter (a server started with TRITON_INTERPRET=1,
        # as the dispatch check runs SGLang's triton backend); else (CPU, or a layout they do
        # not tile) the torch paths.
        on_device = (str(getattr(model_runner, "device", "cpu")).startswith("cuda")
                     or os.environ.get("TRITON_INTERPRET") == "1")
        self.delta_kernel = on_device and kernel_serves(self.shift_rope)
        inflight_fence.register(model_runner)  # for the tree cache's row writes
        self._layer_id = 0
        self._groups: dict = {}  # the current batch's cache (batch_rows.cache_of_forward)
        self._batch_rows: tuple[BatchRow | None, ...] | None = None

    def init_forward_metadata(self, forward_batch):
        self._groups = cache_of_forward(forward_batch)  # per batch, kept on the batch itself
        self._batch_rows = rows_of_forward(forward_batch)
        if self._batch_rows is not None and len(self._batch_rows) != len(forward_batch.rids):
            raise RuntimeError("sglang-kvcmas: a forward batch's rows do not match its requests")
        if forward_batch.forward_mode.is_extend() and self._batch_rows is not None:
            self._place_recomputed(forward_batch)
        super().init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Refused: every batch here runs eagerly (SGLang captures decode graphs for every
        backend but its torch ones; ``sglang-kvcmas-server`` turns them off for this one)."""
        raise RuntimeError("sglang-kvcmas: the kvcmas_delta attention backend runs without CUDA "
                           "graphs; start the server with --disable-cuda-graph")

    def kvcmas_route(self, forward_batch) -> Route:
        """The batch's route (``dispatch_route``) when this backend is the user's
        (``--attention-backend kvcmas_delta``): probe batches stay here, as over torch_native."""
        return route_of(forward_batch, False, self)

    def _on_kernel(self, decode: bool) -> bool:
        """Whether the current batch reads through the delta kernels: its route, decided once
        per batch (by the dispatcher that sent it here, else now)."""
        if not self.delta_kernel:
            return False
        route = self._groups.get("route")
        if route is None:
            route = self._groups["route"] = decide(self._batch_rows, decode, False, True)
        return route.path == KERNEL

    def _entry(self, i: int) -> BatchRow | None:
        rows = self._batch_rows
        return rows[i] if rows is not None and i < len(rows) else None

    def _spans(self, i: int) -> RowSpans | None:
        entry = self._entry(i)
        return entry.spans if entry is not None else None

    def _place_recomputed(self, forward_batch) -> None:
        """Write recomputed tokens' ids and true positions into their rows' first extend slots."""
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        seq_lens = forward_batch.extend_seq_lens_cpu
        if prefix_lens is None or seq_lens is None:  # SGLang's device-only batch: no host lists
            if forward_batch.extend_seq_lens is None or not any(
                    r is not None and r.recomputed is not None
                    for r in map(self._spans, range(len(self._batch_rows)))):
                return
            prefix_lens = forward_batch.extend_prefix_lens.tolist()
            seq_lens = forward_batch.extend_seq_lens.tolist()
        start = 0
        for i in range(len(seq_lens)):
            row = self._spans(i)
            moved = row.recomputed if row is not None else None
            if moved is not None:
                n = len(moved.token_ids)
                if int(prefix_lens[i]) != moved.row_start or int(seq_lens[i]) <= n:
                    raise RuntimeError(
                        f"sglang-kvcmas: request {row.rid} extends from {prefix_lens[i]} "
                        f"({seq_lens[i]} tokens), but its recomputed tokens start at row "
                        f"{moved.row_start} ({n} tokens)"
                    )
                dev = forward_batch.input_ids.device
                forward_batch.input_ids[start : start + n] = torch.tensor(
                    moved.token_ids, dtype=forward_batch.input_ids.dtype, device=dev
                )
                forward_batch.positions[start : start + n] = torch.tensor(
                    moved.positions, dtype=forward_batch.positions.dtype, device=dev
                )
            start += int(seq_lens[i])

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._at_layer(layer, forward_batch)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._at_layer(layer, forward_batch)
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    def _at_layer(self, layer, forward_batch) -> None:
        self._layer_id = layer.layer_id
        self._batch_rows = rows_of_forward(forward_batch)
        self._groups = cache_of_forward(forward_batch)

    def _probes(self, req_pool_indices: torch.Tensor) -> list[HeadMassProbe | None]:
        n = req_pool_indices.shape[0]
        if not is_probe_layer(self._layer_id) or self._batch_rows is None:
            return [None] * n
        return [e.probe if (e := self._entry(i)) is not None else None for i in range(n)]

    def _rows(self, req_pool_indices: torch.Tensor, decode: bool = False
              ) -> list[RowSpans | None]:
        """Rows that differ from plain attention at this layer (decode: only a shift or
        factored tokens; extend: also a position mask)."""
        rows = [self._spans(i) for i in range(req_pool_indices.shape[0])]
        return [r if r is not None and ((r.reads_transformed if decode else r.needs_transform)
                                        or self._leaf_deltas(r) is not None) else None
                for r in rows]

    def _leaf_deltas(self, row: RowSpans | None) -> TokenDeltas | None:
        """The deviations of the row's factored tokens at the current layer, or None (none, or
        zero factors)."""
        if row is None or row.leaves is None:
            return None
        return row.leaves.layer(self._layer_id)

    def _fit_leaves(self, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens) -> None:
        """Factor this layer's deviations for every row whose extend keeps recomputed tokens as
        factored leaves."""
        for i in range(req_pool_indices.shape[0]):
            row = self._spans(i)
            fit = row.leaves.factor if row is not None and row.leaves is not None else None
            if fit is None or not fit.fits or self._layer_id in fit.layers:
                continue
            slots = req_to_token[req_pool_indices[i], : int(seq_lens[i])]
            fit.fit_layer(self._layer_id,
                          *gather_pairs(k_cache, v_cache, slots, fit, self.shift_rope),
                          self.shift_rope)

    def _run_sdpa_forward_extend(
        self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
        causal=False, is_cross_attn=False, sliding_window_size: int | None = None,
    ):
        if encoder_lens is None and sliding_window_size is None and self._batch_rows is not None:
            self._fit_leaves(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
        rows = self._rows(req_pool_indices)
        _no_window(rows, sliding_window_size)
        probes = self._probes(req_pool_indices) if causal else [None] * len(rows)
        if encoder_lens is not None or sliding_window_size is not None or not (
            any(rows) or any(probes)
        ):
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                is_cross_attn, sliding_window_size,
            )
        if causal and any(rows) and self._on_kernel(decode=False):
            self._kernel_extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                seq_lens, extend_prefix_lens, extend_seq_lens, scaling,
                                enable_gqa, rows)
            if any(probes):  # beside the kernel: the keys as the torch path reads them
                record_head_mass(
                    query, probes, extend_prefix_lens.tolist(), extend_seq_lens.tolist(),
                    lambda i, n: self._probe_keys(k_cache, v_cache, req_to_token,
                                                  req_pool_indices[i], n, rows[i]),
                    _scale(scaling, query))
            return output
        q_all = query.movedim(0, query.dim() - 2)  # [H, tokens, d]
        start_q = 0
        for i in range(seq_lens.shape[0]):
            n_q, n_prefix, n_kv = (
                int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
            )
            q = q_all[:, start_q : start_q + n_q, :]
            k, v = self._gather(k_cache, v_cache, req_to_token, req_pool_indices[i], n_kv, rows[i])
            fused = probes[i] is not None and rows[i] is None and fused_mass_serves(q, causal)
            if probes[i] is not None and not fused:
                pos = rows[i].positions_upto(n_kv) if rows[i] is not None else torch.arange(n_kv)
                add_row_mass(probes[i], q, k, pos.to(q.device), n_prefix, _scale(scaling, q))
            if fused:
                # A plain probed row on CPU: the mass from the attention's own normalizer.
                out, mass = tail_attention_and_mass(q, k, v, n_prefix, scaling,
                                                    probes[i].head_from, probes[i].head_to)
                probes[i].add(n_prefix, mass)
            elif rows[i] is not None and rows[i].positions is not None and causal:
                pos = rows[i].positions_upto(n_kv).to(q.device)
                mask = pos[None, :] <= pos[n_prefix:, None]  # [n_q, n_kv] by true position
                out = scaled_dot_product_attention(
                    q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                    enable_gqa=enable_gqa, scale=scaling,
                ).squeeze(0)
            else:
                # No position mask (a plain row, or keys only re-positioned): the row's new
                # queries alone, each over its causal prefix (SGLang's torch backend pads the
                # query to the whole sequence: n_kv² work for n_q new tokens).
                out = tail_attention(q, k, v, n_prefix, causal, scaling, enable_gqa)
            output[start_q : start_q + n_q] = out.movedim(query.dim() - 2, 0)
            start_q += n_q
        return output

    def _run_sdpa_forward_decode(
        self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
        sliding_window_size: int | None = None,
    ):
        # Decode needs no position mask (every cached token precedes the query): only rows
        # with a shift differ from the parent.
        rows = self._rows(req_pool_indices, decode=True)
        _no_window(rows, sliding_window_size)
        if encoder_lens is not None or sliding_window_size is not None or not any(rows):
            return super()._run_sdpa_forward_decode(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size,
            )
        if self._on_kernel(decode=True):
            # One launch for the whole batch: tiles rotated by their run's shift in registers,
            # factored tokens corrected there.
            planned, _ = self._kernel_plan(req_to_token, req_pool_indices, seq_lens,
                                           k_cache.shape[1])
            output[:] = shifted_attention(query, k_cache, v_cache, planned,
                                          _scale(scaling, query), self._layer_id)
            return output
        # Re-positioned rows (factored tokens' deviations added to their gathered keys and
        # values): a few batched ops per layer for all of them.
        plan = self._decode_plan(req_to_token, req_pool_indices, seq_lens, rows)
        batched_shift_decode(query, k_cache, v_cache, plan, self.shift_rope,
                             _scale(scaling, query), output, self._layer_id)
        q_all = query.movedim(0, query.dim() - 2)
        for i in plan.rest:
            n_kv = int(seq_lens[i])
            q = q_all[:, i : i + 1, :]
            row = rows[i]
            if self._leaf_deltas(row) is not None:
                # Factored leaves: keys gathered, re-positioned and corrected as extend reads.
                k, v = self._gather(k_cache, v_cache, req_to_token, req_pool_indices[i], n_kv, row)
                out = scaled_dot_product_attention(
                    q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                    enable_gqa=enable_gqa, scale=scaling,
                ).squeeze(0)
            elif row is not None:
                # Keys gathered grouped by shift; the query rotated once per shift.
                tokens, groups = self._grouped_tokens(i, n_kv, row, req_to_token,
                                                      req_pool_indices[i])
                k, v = k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1)
                out = grouped_shift_decode(q, k, v, row.key_shifts.shifts, groups, self.shift_rope,
                                           _scale(scaling, q))
            else:
                k, v = self._gather(k_cache, v_cache, req_to_token, req_pool_indices[i], n_kv, None)
                out = scaled_dot_product_attention(
                    q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                    enable_gqa=enable_gqa, scale=scaling, is_causal=causal,
                ).squeeze(0)
            output[i : i + 1] = out.movedim(query.dim() - 2, 0)
        return output

    def _decode_plan(self, req_to_token, req_pool_indices, seq_lens, rows) -> BatchedDecodePlan:
        """The batch's re-positioned rows (their factored tokens read through their deviations),
        bucketed once per forward and pattern (``attention/batched_decode.py``); every other row
        (plain rows read exactly by SDPA, rows of many owners) is the plan's ``rest``. A row
        whose factors are zero here reads as one without factored leaves."""
        take = [r is not None and (r.reads_transformed or _factored(r)) for r in rows]
        key = ("decode", tuple(take))
        if key not in self._groups:
            slots = [req_to_token[req_pool_indices[i], : int(seq_lens[i])] if t else None
                     for i, t in enumerate(take)]
            shifts = [r.key_shifts if t else None for r, t in zip(rows, take)]
            leaves = [r.leaves.reads if t and r.leaves is not None else None
                      for r, t in zip(rows, take)]
            self._groups[key] = plan_batched_decode(slots, shifts, self.shift_rope,
                                                    leaves=leaves)
        return self._groups[key]

    def _kernel_plan(self, req_to_token, req_pool_indices, seq_lens, num_kv_heads: int,
                     extend_seq_lens=None) -> tuple[ShiftedPlan, torch.Tensor | None]:
        """The kernels' plan of this batch, once per forward (every layer reads it); for an
        extend (``extend_seq_lens``), also the query rows the kernel reads: each row's new
        tokens after its recomputed ones.

        NOTE: built from every row's spans, not from the rows that differ at the layer that
        first asks (:meth:`_rows`): a row's factored leaves may be zero at one layer (at layer 0
        a token at its owner's position has its owner's K/V) and not at the next."""
        key = ("kernel", num_kv_heads, extend_seq_lens is None)
        if key not in self._groups:
            n = req_pool_indices.shape[0]
            rows = [self._spans(i) for i in range(n)]
            kv = [req_to_token[req_pool_indices[i], : int(seq_lens[i])] for i in range(n)]
            shifts = [r.key_shifts if r is not None else None for r in rows]
            leaves = [r.leaves.reads if r is not None and r.leaves is not None else None
                      for r in rows]
            counts, q_rows = None, None
            if extend_seq_lens is not None:
                n_q = [int(x) for x in extend_seq_lens]
                n_rec = [_recomputed(r) for r in rows]
                starts = [sum(n_q[:i]) for i in range(n)]
                counts = [q - m for q, m in zip(n_q, n_rec)]
                q_rows = torch.cat([torch.arange(s + m, s + q) for s, q, m in
                                    zip(starts, n_q, n_rec)]).to(req_to_token.device)
            self._groups[key] = (plan_shifted(kv, shifts, num_kv_heads, self.shift_rope,
                                              req_to_token.device, counts, leaves), q_rows)
        return self._groups[key]

    def _kernel_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                       seq_lens, extend_prefix_lens, extend_seq_lens, scaling, enable_gqa,
                       rows):
        """Extend through the delta kernel: every row's new tokens after its recomputed ones in
        one launch (row-causal: every borrowed and recomputed token precedes them); a row's
        recomputed tokens (before some of its borrowed keys in position, after them in row
        order) in PyTorch, masked by true position."""
        scale = _scale(scaling, query)
        planned, q_rows = self._kernel_plan(req_to_token, req_pool_indices, seq_lens,
                                            k_cache.shape[1], extend_seq_lens)
        output[q_rows] = shifted_attention(query[q_rows], k_cache, v_cache, planned, scale,
                                           self._layer_id)
        start_q = 0
        for i in range(seq_lens.shape[0]):
            n_rec, n_prefix = _recomputed(rows[i]), int(extend_prefix_lens[i])
            if n_rec:
                n_keys = n_prefix + n_rec  # the row's later tokens all come after these
                k, v = self._gather(k_cache, v_cache, req_to_token, req_pool_indices[i], n_keys,
                                    rows[i])
                pos = rows[i].positions_upto(n_keys).to(query.device)
                q = query[start_q : start_q + n_rec].movedim(0, 1)  # [H, n_rec, d]
                out = scaled_dot_product_attention(
                    q[None], k[None], v[None], attn_mask=pos[None, :] <= pos[n_prefix:, None],
                    enable_gqa=enable_gqa, scale=scale)[0]
                output[start_q : start_q + n_rec] = out.movedim(1, 0)
            start_q += int(extend_seq_lens[i])
        return output

    def _grouped_tokens(self, i: int, n_kv: int, row: RowSpans, req_to_token,
                        req_pool_idx) -> tuple[torch.Tensor, tuple]:
        """Pool slots of batch row ``i`` in shift-group order and the groups, once per forward
        (every layer reads the same slots)."""
        key = (i, n_kv)
        if key not in self._groups:
            order, groups = row.key_shifts.grouped(n_kv)
            tokens = req_to_token[req_pool_idx, :n_kv][order.to(req_to_token.device)]
            self._groups[key] = (tokens, groups)
        return self._groups[key]

    def _probe_keys(self, k_cache, v_cache, req_to_token, req_pool_idx, n_kv, row
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([H_kv, n_kv, d] keys of one row as the torch path reads them, [n_kv] their true
        positions): what its head mass is measured on."""
        k, _ = self._gather(k_cache, v_cache, req_to_token, req_pool_idx, n_kv, row)
        pos = row.positions_upto(n_kv) if row is not None else torch.arange(n_kv)
        return k, pos.to(k.device)

    def _gather(self, k_cache, v_cache, req_to_token, req_pool_idx, n_kv, row):
        """[H_kv, n_kv, d] keys and values of one row, spans transformed (transient copies)."""
        tokens = req_to_token[req_pool_idx, :n_kv]
        k, v = k_cache[tokens], v_cache[tokens]  # advanced indexing: copies, never the pool
        if row is not None:
            k = rotate_keys(k, row.key_shifts, self.shift_rope)
            deltas = self._leaf_deltas(row)
            if deltas is not None:
                k, v = deltas.apply(k, v, self.shift_rope)
        return k.movedim(0, 1), v.movedim(0, 1)


def _scale(scaling: float | None, q: torch.Tensor) -> float:
    """The layer's attention scale, else SDPA's default (``1/sqrt(head_dim)``)."""
    return scaling if scaling is not None else q.shape[-1] ** -0.5


def _factored(row: RowSpans) -> bool:
    """Whether the row reads some tokens through factored leaves."""
    return row.leaves is not None and row.leaves.reads is not None and bool(
        len(row.leaves.reads))


def _recomputed(row: RowSpans | None) -> int:
    """How many recomputed tokens lead the row's extend."""
    return len(row.recomputed.token_ids) if row is not None and row.recomputed else 0


def _no_window(rows: list, sliding_window_size: int | None) -> None:
    """Shifted rows never take the parent's sliding-window path (refused at start; a backstop)."""
    if sliding_window_size is not None and any(rows):
        raise RuntimeError("sglang-kvcmas: a sliding-window layer reads re-positioned spans "
                           "(sliding-window models are refused at start)")


def create_delta_backend(runner: ModelRunner) -> DeltaAttnBackend:
    """Factory registered as attention backend ``kvcmas_delta``."""
    return DeltaAttnBackend(runner)
