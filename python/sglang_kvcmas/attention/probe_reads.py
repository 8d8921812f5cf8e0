"""Head mass of a forward batch's probed rows, recorded beside whatever computed its attention.

An exact owner computing a new shared segment records, at the probe layers
(``spans.is_probe_layer``), each new token's softmax mass on its agent head
(``spans.HeadMassProbe``). The attention itself may come from the user's backend (Triton,
FlashInfer), from our delta kernels or from our torch path: the mass is the same function of the
layer's queries and of the row's keys as attention reads them, so every path records it through
:func:`add_row_mass`, and the paths that do not gather keys themselves read them from the KV pool
after the layer saved them (:func:`record_head_mass` over :func:`pool_keys`). The mass is
``triton_head_mass.head_mass_triton`` on CUDA tensors, ``span_reads.head_mass`` elsewhere.

No SGLang import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sglang_kvcmas.attention.span_reads import head_mass
from sglang_kvcmas.attention.spans import HeadMassProbe

RowKeys = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""``keys(i, n_kv)`` -> (k [H_kv, n_kv, d] batch row ``i``'s keys as attention reads them,
pos [n_kv] int64 their true positions, on the keys' device)."""


def add_row_mass(probe: HeadMassProbe, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor,
                 n_prefix: int, scale: float) -> None:
    """Add one row's head mass at one layer to its probe.

    Args:
        q: [H, n_q, d] the row's new queries (RoPE applied).
        k: [H_kv, n_kv, d] the row's keys as attention reads them, n_kv = n_prefix + n_q.
        pos: [n_kv] int64 true positions of the keys (the queries are ``pos[n_prefix:]``).
        n_prefix: row index of the first new token.
    """
    mass = head_mass
    if q.is_cuda:
        from sglang_kvcmas.attention.triton_head_mass import head_mass_triton  # imports triton

        mass = head_mass_triton
    probe.add(n_prefix, mass(q, k, pos[n_prefix:], pos, scale, probe.head_from, probe.head_to))


def record_head_mass(query: torch.Tensor, probes: Sequence[HeadMassProbe | None],
                     prefix_lens: Sequence[int], extend_lens: Sequence[int], keys: RowKeys,
                     scale: float) -> None:
    """Add every probed row's head mass at one layer.

    Args:
        query: [tokens, H, d] the batch's new queries, rows in batch order (RoPE applied).
        probes: per batch row, its probe or None.
        prefix_lens: per row, its cached prefix (row index of its first new token).
        extend_lens: per row, its new tokens (``sum(extend_lens) == tokens``).
        keys: the row's keys and their positions (:data:`RowKeys`).
    """
    q_all = query.movedim(0, 1)  # [H, tokens, d]
    start = 0
    for i, probe in enumerate(probes):
        n_q, n_prefix = int(extend_lens[i]), int(prefix_lens[i])
        if probe is not None:
            k, pos = keys(i, n_prefix + n_q)
            add_row_mass(probe, q_all[:, start : start + n_q], k, pos, n_prefix, scale)
        start += n_q


def pool_keys(k_cache: torch.Tensor, req_to_token: torch.Tensor,
              req_pool_indices: torch.Tensor) -> RowKeys:
    """Keys of rows that read nothing borrowed: the pool's, at their row indices.

    Args:
        k_cache: [slots, H_kv, d] one layer's key buffer.
        req_to_token: [rows, context] pool slot of each row index.
        req_pool_indices: [batch] each batch row's index into ``req_to_token``.
    """

    def keys(i: int, n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = k_cache[req_to_token[req_pool_indices[i], :n_kv]]  # a copy, never the pool
        return k.movedim(0, 1), torch.arange(n_kv).to(k.device)

    return keys
