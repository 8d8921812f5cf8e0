"""Decode attention over re-positioned shared spans by rotating the query, not the keys.

A reader's row holds borrowed keys rotated at the owner's positions; the span's read key is
``R(δ)·k`` (``attention/rope.py``). Rotations are orthogonal, so the score against it is

    q · R(δ)·k = (R(−δ)·q) · k

For one decode query that turns a rotation of every borrowed key, at every layer and step, into
one rotation of the query per distinct shift (a few per row). Every key is scored against every
rotated query in one product, and each key keeps the score of its own shift (a gather by the
key's shift index): S times the query-key products, no Python loop over the row's runs. A row
whose exact leaves are scattered through its borrowed spans has hundreds of runs, and a loop over
them cost more than the attention itself.

The reference is :func:`sglang_kvcmas.attention.span_reads.transform_spans`
followed by SDPA; ``test/serving/test_shifted_query.py`` compares the two.
"""

from __future__ import annotations

import torch

from sglang_kvcmas.attention.rope import rope_cos_sin, rotate_halves


def shift_runs(
    n_kv: int, spans: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, tuple[tuple[int, int, int], ...]]:
    """A row's keys as contiguous runs of one shift each.

    Args:
        n_kv: number of keys in the row.
        spans: ``(start, end, shift)`` row ranges, sorted and disjoint; keys outside every span
            have shift 0.
    Returns:
        (shifts, runs): shifts [S] int64 distinct shifts with ``shifts[0] == 0``; runs
        ``(start, end, i)`` covering ``[0, n_kv)`` in order, adjacent runs of one shift merged,
        ``i`` indexing ``shifts``.
    """
    distinct = [0] + sorted({s for _, _, s in spans if s != 0})
    runs: list[list[int]] = []
    at = 0
    for start, end, shift in [*spans, (n_kv, n_kv, 0)]:
        start, end = min(start, n_kv), min(end, n_kv)
        for lo, hi, i in ((at, start, 0), (start, end, distinct.index(shift))):
            if hi <= lo:
                continue
            if runs and runs[-1][2] == i:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, i])
        at = max(at, end)
    return torch.tensor(distinct, dtype=torch.int64), tuple(tuple(r) for r in runs)


def key_shift_index(n_kv: int, runs: tuple[tuple[int, int, int], ...],
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """[n_kv] int64: for each key, the index into ``shifts`` it is read at (``shift_runs``)."""
    idx = torch.zeros(n_kv, dtype=torch.int64)
    for start, end, i in runs:
        if i:
            idx[start:end] = i
    return idx.to(device)


def shifted_query_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shifts: torch.Tensor,
    key_shift: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query per head over keys read at per-key shifts.

    Args:
        q: [H, 1, d] query (RoPE applied at the reader's position).
        k: [H_kv, n_kv, d] keys as the pool stores them (owner positions); H % H_kv == 0.
        v: [H_kv, n_kv, d] values.
        shifts: [S] int64 distinct shifts (``shift_runs``).
        key_shift: [n_kv] int64 index into ``shifts`` per key (``key_shift_index``).
        inv_freq: [d // 2] float32 RoPE frequencies.
        scale: softmax scale.
    Returns:
        [H, 1, d] in ``q.dtype``; equals SDPA over keys rotated by their shift (every key
        precedes the query, so no mask).
    """
    h, hkv, d = q.shape[0], k.shape[0], q.shape[-1]
    g, n_kv = h // hkv, k.shape[1]
    cos, sin = rope_cos_sin(-shifts.to(q.device), inv_freq.to(q.device))  # [S, d/2] each
    qf = q.reshape(hkv, g, d).to(torch.float32)
    q_s = rotate_halves(qf, cos[:, None, None, :], sin[:, None, None, :]) * scale  # [S, H_kv, g, d]
    scores_all = q_s @ k.to(torch.float32).transpose(1, 2).unsqueeze(0)  # [S, H_kv, g, n_kv]
    index = key_shift[:n_kv].view(1, 1, 1, n_kv).expand(1, hkv, g, n_kv)
    scores = scores_all.gather(0, index)[0]  # [H_kv, g, n_kv]
    out = torch.softmax(scores, dim=-1) @ v.to(torch.float32)  # [H_kv, g, d]
    return out.reshape(h, 1, d).to(q.dtype)
