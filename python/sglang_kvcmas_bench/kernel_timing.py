"""Timing of one kernel call on CPU, and the reader rows the decode benchmarks read: a row's
per-key shifts (its own head, then borrowed segments of several owners cut by leaf tokens)."""

from __future__ import annotations

import time

import torch


def timed(fn, reps: int) -> float:
    """Microseconds per call of ``fn`` over ``reps`` calls, after 5 warm-up calls."""
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def row_shifts(n: int, owners: int, run: int) -> torch.Tensor:
    """[n] int64 per-key shift: own head first, then borrowed segments of ``owners`` owners with
    a leaf token (shift 0) every ``run`` tokens."""
    shift = torch.zeros(n, dtype=torch.int64)
    head = n // 6
    seg = max(1, (n - head) // owners)
    for i in range(head, n):
        o = min((i - head) // seg, owners - 1)
        shift[i] = 0 if (i - head) % run == run - 1 else 17 * o - 40
    return shift
