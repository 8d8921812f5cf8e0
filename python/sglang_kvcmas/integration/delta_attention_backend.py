"""``kvcmas_delta`` attention backend: torch_native attention that reads shared spans re-positioned
(and corrected, when a delta is present) — registered with SGLang's attention registry.

SGLang's torch_native backend gathers, per request and layer, ``k_cache[req_to_token[row, :n]]``
(a transient copy) and runs SDPA on it. This backend does the same and, for a row that
``span_registry.SPANS`` lists, transforms the gathered keys and values of each shared span before
SDPA, following ``attention/reference.py``::

    key read   = R(δ)·k_base + R(p_reader)·(U_k·C_kᵀ)      (pool holds post-RoPE owner keys)
    value read = v_base + U_v·C_vᵀ

Nothing is written back to the pool: the owner's KV stays exact and shared. Rows without spans
(every exact request, every request when sharing is off) take the parent's code path unchanged.

Recomputed tokens (``span_registry.RecomputedTokens``): a reader recomputes some borrowed tokens
(span boundaries, the owner's largest head-mass tokens; ``policy/recompute.py``) in its own
context. The tree cache leaves them out of the row's prefix, so
SGLang extends the row from a prefix that is that many tokens shorter; before the model runs,
:meth:`DeltaAttnBackend.init_forward_metadata` writes their ids and true positions into the
first extend slots of ``forward_batch.input_ids`` / ``positions`` (the model applies RoPE at the
true positions, and the pool keeps their keys so rotated), and extend attention masks by true
position instead of row order. Decode needs no mask: every cached token precedes the query.

Head-mass probe (``span_registry.HeadMassProbe``): for a row that will register new shared
tokens, extend attention at the probe layers (``layer_id % PROBE_EVERY == PROBE_PHASE``, 7 of 30
layers on the embedded model) also records each token's softmax mass on the row's agent head,
``exp(logsumexp(head scores) - logsumexp(all scores))`` averaged over query heads, computed in
query blocks of ``PROBE_BLOCK`` rows. Probing a layer costs about one more attention pass over
the row at that layer; nothing else changes.

GPU: the same span metadata drives the Triton kernels in ``attention/triton_delta.py``; wiring
them into a FlashInfer/Triton wrapper is not done here (CPU serving only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from torch.nn.functional import scaled_dot_product_attention

from sglang_kvcmas.attention.rope import apply_rope, rope_cos_sin, rope_inv_freq
from sglang_kvcmas.attention.shifted_query import shift_runs, shifted_query_decode
from sglang_kvcmas.integration.span_registry import PROBES, SPANS, HeadMassProbe, RowSpans

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

BACKEND_NAME = "kvcmas_delta"
PROBE_EVERY, PROBE_PHASE = 4, 2
"""Probe layers: 2, 6, 10, ... (benchmark/lab/owner_mass_study.py compares them with all layers)."""
PROBE_BLOCK = 256


def head_mass(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
    head_from: int, head_to: int,
) -> torch.Tensor:
    """Softmax mass each query puts on key rows ``[head_from, head_to)``, mean over heads.

    Args:
        q: [H, n_q, d] queries (RoPE applied).
        k: [H_kv, n_kv, d] keys as attention reads them.
        q_pos: [n_q] true positions of the queries; k_pos: [n_kv] of the keys (causal by
            position: a query sees keys at positions <= its own).
        scale: softmax scale.
    Returns:
        [n_q] float32.
    """
    kk = k.float().repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    out = []
    for lo in range(0, q.shape[1], PROBE_BLOCK):
        qb = q[:, lo : lo + PROBE_BLOCK].float()
        scores = (qb @ kk.transpose(1, 2)) * scale  # [H, b, n_kv]
        hidden = k_pos[None, None, :] > q_pos[None, lo : lo + PROBE_BLOCK, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        total = torch.logsumexp(scores, dim=-1)
        head = torch.logsumexp(scores[..., head_from:head_to], dim=-1)
        out.append(torch.exp(head - total).mean(0))
    return torch.cat(out) if out else q.new_zeros(0, dtype=torch.float32)


def transform_spans(
    k: torch.Tensor,
    v: torch.Tensor,
    row: RowSpans,
    layer_id: int,
    inv_freq: torch.Tensor,
    cos_sin_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply one row's span reads to its gathered keys and values, in place.

    Args:
        k: [seq_len, H_kv, d] keys gathered from the pool in row order (a copy, not the pool)
        v: [seq_len, H_kv, d] values
        row: the row's shared spans; positions are row indices
        layer_id: layer whose delta factors to apply
        inv_freq: [d // 2] float32 RoPE frequencies
        cos_sin_cache: optional memo ``shift -> (cos, sin)`` each [d // 2]
    Returns:
        (k, v), the same tensors.
    """
    half = k.shape[-1] // 2
    for read in row.reads:
        span = read.span
        if span.start >= k.shape[0]:
            continue
        sl = slice(span.start, min(span.end, k.shape[0]))
        if span.shift:
            cs = None if cos_sin_cache is None else cos_sin_cache.get(span.shift)
            if cs is None:
                cos, sin = rope_cos_sin(torch.tensor([span.shift]), inv_freq)
                cs = (cos[0].to(k.device), sin[0].to(k.device))
                if cos_sin_cache is not None:
                    cos_sin_cache[span.shift] = cs
            cos, sin = cs
            ks = k[sl].to(torch.float32)
            lo, hi = ks[..., :half], ks[..., half:]
            k[sl] = torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1).to(k.dtype)
        if read.factors is not None:
            f = read.factors(layer_id)
            n = sl.stop - sl.start
            if f.k is not None:
                pos = row.positions_upto(sl.stop)[sl]
                k[sl] += apply_rope(f.k.dense()[:n].to(k.device), pos, inv_freq).to(k.dtype)
            if f.v is not None:
                v[sl] += f.v.dense()[:n].to(v.device, v.dtype)
    return k, v


def _rope_params(model_runner: ModelRunner) -> tuple[int, float]:
    cfg = model_runner.model_config.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return int(head_dim), float(theta)


class DeltaAttnBackend(TorchNativeAttnBackend):
    """torch_native + shared-span re-positioning and deltas (see module docstring)."""

    def __init__(self, model_runner: ModelRunner):
        super().__init__(model_runner)
        head_dim, theta = _rope_params(model_runner)
        self.inv_freq = rope_inv_freq(head_dim, theta)
        self._layer_id = 0
        self._cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._groups: dict[tuple[int, int], tuple[torch.Tensor, tuple]] = {}

    def init_forward_metadata(self, forward_batch):
        self._groups.clear()  # per forward: rows and lengths change between forwards
        if forward_batch.forward_mode.is_extend() and len(SPANS):
            self._place_recomputed(forward_batch)
        super().init_forward_metadata(forward_batch)

    def _place_recomputed(self, forward_batch) -> None:
        """Write recomputed tokens' ids and true positions into their rows' first extend slots."""
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        seq_lens = forward_batch.extend_seq_lens_cpu
        if prefix_lens is None or seq_lens is None:
            return
        start = 0
        for i, idx in enumerate(forward_batch.req_pool_indices.tolist()):
            row = SPANS.get(int(idx))
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
        self._layer_id = layer.layer_id
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._layer_id = layer.layer_id
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    def _probes(self, req_pool_indices: torch.Tensor) -> list[HeadMassProbe | None]:
        if self._layer_id % PROBE_EVERY != PROBE_PHASE or not len(PROBES):
            return [None] * req_pool_indices.shape[0]
        return [PROBES.get(int(i)) for i in req_pool_indices.tolist()]

    def _rows(self, req_pool_indices: torch.Tensor) -> list[RowSpans | None]:
        rows = [SPANS.get(int(i)) for i in req_pool_indices.tolist()]
        return [r if r is not None and r.needs_transform else None for r in rows]

    def _run_sdpa_forward_extend(
        self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
        causal=False, is_cross_attn=False, sliding_window_size: Optional[int] = None,
    ):
        rows = self._rows(req_pool_indices)
        probes = self._probes(req_pool_indices) if causal else [None] * len(rows)
        if encoder_lens is not None or sliding_window_size is not None or not (
            any(rows) or any(probes)
        ):
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                is_cross_attn, sliding_window_size,
            )
        q_all = query.movedim(0, query.dim() - 2)  # [H, tokens, d]
        start_q = 0
        for i in range(seq_lens.shape[0]):
            n_q, n_prefix, n_kv = (
                int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
            )
            q = q_all[:, start_q : start_q + n_q, :]
            k, v = self._gather(k_cache, v_cache, req_to_token, req_pool_indices[i], n_kv, rows[i])
            if probes[i] is not None:
                pos = rows[i].positions_upto(n_kv) if rows[i] is not None else torch.arange(n_kv)
                pos = pos.to(q.device)
                probes[i].add(n_prefix, head_mass(
                    q, k, pos[n_prefix:], pos, scaling if scaling is not None else
                    q.shape[-1] ** -0.5, probes[i].head_from, probes[i].head_to))
            if rows[i] is not None and rows[i].positions is not None and causal:
                pos = rows[i].positions_upto(n_kv).to(q.device)
                mask = pos[None, :] <= pos[n_prefix:, None]  # [n_q, n_kv] by true position
                out = scaled_dot_product_attention(
                    q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                    enable_gqa=enable_gqa, scale=scaling,
                ).squeeze(0).movedim(query.dim() - 2, 0)
                output[start_q : start_q + n_q] = out
            else:
                q_full = torch.empty((q.shape[0], n_kv, q.shape[2]), dtype=q.dtype,
                                     device=q.device)
                q_full[:, n_prefix:, :] = q
                out = scaled_dot_product_attention(
                    q_full.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                    enable_gqa=enable_gqa, scale=scaling, is_causal=causal,
                ).squeeze(0).movedim(query.dim() - 2, 0)
                output[start_q : start_q + n_q] = out[n_prefix:]
            start_q += n_q
        return output

    def _run_sdpa_forward_decode(
        self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
        sliding_window_size: Optional[int] = None,
    ):
        # Decode needs no position mask (every cached token precedes the query): only rows
        # with a shift or a delta differ from the parent.
        rows = [r if r is not None and r.reads_transformed else None
                for r in self._rows(req_pool_indices)]
        if encoder_lens is not None or sliding_window_size is not None or not any(rows):
            return super()._run_sdpa_forward_decode(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size,
            )
        q_all = query.movedim(0, query.dim() - 2)
        for i in range(seq_lens.shape[0]):
            n_kv = int(seq_lens[i])
            q = q_all[:, i : i + 1, :]
            row = rows[i]
            if row is not None and all(r.factors is None for r in row.reads):
                # Re-positioning only: rotate the query per shift instead of every key.
                k, v = self._gather(k_cache, v_cache, req_to_token, req_pool_indices[i], n_kv, None)
                shifts, runs = self._shift_runs(int(req_pool_indices[i]), n_kv, row)
                out = shifted_query_decode(
                    q, k, v, shifts, runs, self.inv_freq,
                    scaling if scaling is not None else q.shape[-1] ** -0.5,
                )
            else:
                k, v = self._gather(k_cache, v_cache, req_to_token, req_pool_indices[i], n_kv, row)
                out = scaled_dot_product_attention(
                    q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                    enable_gqa=enable_gqa, scale=scaling, is_causal=causal,
                ).squeeze(0)
            output[i : i + 1] = out.movedim(query.dim() - 2, 0)
        return output

    def _shift_runs(self, req_pool_idx: int, n_kv: int, row: RowSpans):
        key = (req_pool_idx, n_kv)
        if key not in self._groups:
            self._groups[key] = shift_runs(
                n_kv, [(r.span.start, r.span.end, r.span.shift) for r in row.reads]
            )
        return self._groups[key]

    def _gather(self, k_cache, v_cache, req_to_token, req_pool_idx, n_kv, row):
        """[H_kv, n_kv, d] keys and values of one row, spans transformed (transient copies)."""
        tokens = req_to_token[req_pool_idx, :n_kv]
        k, v = k_cache[tokens], v_cache[tokens]  # advanced indexing: copies, never the pool
        if row is not None:
            k, v = transform_spans(k, v, row, self._layer_id, self.inv_freq, self._cos_sin)
        return k.movedim(0, 1), v.movedim(0, 1)


def create_delta_backend(runner: ModelRunner) -> DeltaAttnBackend:
    """Factory registered as attention backend ``kvcmas_delta``."""
    return DeltaAttnBackend(runner)
