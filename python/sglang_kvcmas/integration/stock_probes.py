"""Head mass read beside the user's attention backend, for a probe batch.

A probe batch (``dispatch_route``: reason ``probe``) extends exact owners computing new shared
segments: no row reads borrowed KV, so the user's backend (Triton, FlashInfer) attends exactly as
without sharing, and at the probe layers (``spans.is_probe_layer``) each probed row's head mass
is then measured from the layer's queries and the row's keys, read from the KV pool after the
backend saved them (``probe_reads.record_head_mass`` over ``probe_reads.pool_keys``): the same
function of the same tensors as our torch path's, so the records are the same.

Cost: at a probe layer, per probed row, one gather of its keys and one scoring pass of its new
queries over them (``span_reads.head_mass``, blocks of ``PROBE_BLOCK`` queries); nothing at the
other layers.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.radix_attention import AttentionType

from sglang_kvcmas.attention.probe_reads import pool_keys, record_head_mass
from sglang_kvcmas.attention.spans import is_probe_layer
from sglang_kvcmas.integration.batch_rows import rows_of_forward


def probes_at(layer: Any, forward_batch: Any) -> bool:
    """Whether this layer of a probe batch records head mass: a probe layer of causal
    self-attention without a window (where our torch path records it)."""
    if not is_probe_layer(layer.layer_id):
        return False
    window = getattr(layer, "sliding_window_size", None)
    return (not getattr(layer, "is_cross_attention", False)
            and getattr(layer, "attn_type", AttentionType.DECODER) != AttentionType.ENCODER_ONLY
            and (window is None or window < 0)
            and getattr(forward_batch, "encoder_lens", None) is None)


def record_beside(q: torch.Tensor, layer: Any, forward_batch: Any, token_to_kv_pool: Any,
                  req_to_token: torch.Tensor) -> None:
    """Add each probed row's head mass at this layer, after the backend attended and saved the
    layer's keys.

    Args:
        q: the layer's queries as the backend received them, [tokens, H * d] or [tokens, H, d]
            (RoPE applied).
        layer: the ``RadixAttention`` layer (``layer_id``, ``tp_q_head_num``, ``qk_head_dim``,
            ``scaling``).
        forward_batch: the extend batch (its rows, ``req_pool_indices``, prefix and extend
            lengths).
        token_to_kv_pool: the KV pool (``get_key_buffer(layer_id)``: [slots, H_kv, d]).
        req_to_token: [rows, context] pool slot of each row index.
    """
    rows = rows_of_forward(forward_batch) or ()
    probes = [e.probe if e is not None else None for e in rows]
    if not any(probes):
        return
    query = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    scale = layer.scaling if layer.scaling is not None else layer.qk_head_dim ** -0.5
    record_head_mass(query, probes, _cpu(forward_batch, "extend_prefix_lens"),
                     _cpu(forward_batch, "extend_seq_lens"),
                     pool_keys(token_to_kv_pool.get_key_buffer(layer.layer_id), req_to_token,
                               forward_batch.req_pool_indices), scale)


def _cpu(forward_batch: Any, name: str) -> list[int]:
    """``forward_batch.<name>_cpu``, or the device tensor read once."""
    values = getattr(forward_batch, f"{name}_cpu", None)
    return list(values) if values is not None else getattr(forward_batch, name).tolist()
