"""Paired comparison of two arms that answered the same items: accuracy difference with a 95%
interval (paired bootstrap) and McNemar's exact test; the agreement rate of paired decisions
with an item bootstrap interval.

Every function takes per-item outcomes in the same item order: ``a[i]`` and ``b[i]`` are the two
arms' results on item ``i`` (1 correct, 0 wrong).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PairedDiff:
    """``b`` minus ``a`` over ``n`` paired items, in accuracy points (0–100).

    Attributes:
        n: paired items.
        acc_a, acc_b: accuracies in [0, 1].
        delta: (acc_b − acc_a) · 100.
        ci_low, ci_high: the paired bootstrap's 95% percentile interval of ``delta``.
        only_a, only_b: items only ``a`` (only ``b``) got right (McNemar's discordant pairs).
        mcnemar_p: McNemar's exact two-sided p-value (1.0 with no discordant pair).
    """

    n: int
    acc_a: float
    acc_b: float
    delta: float
    ci_low: float
    ci_high: float
    only_a: int
    only_b: int
    mcnemar_p: float


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: the binomial test of ``only_b`` among the discordant
    pairs at p = 1/2."""
    k, n = min(only_a, only_b), only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_diff(a: Sequence[int], b: Sequence[int], resamples: int = 10_000,
                seed: int = 0) -> PairedDiff:
    """Paired accuracy difference of ``b`` over ``a`` with its bootstrap interval."""
    if len(a) != len(b):
        raise ValueError(f"unpaired outcomes: {len(a)} vs {len(b)} items")
    n = len(a)
    if n == 0:
        return PairedDiff(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 1.0)
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    diff = xb - xa
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    boot = diff[idx].mean(axis=1) * 100
    only_a = int(((xa == 1) & (xb == 0)).sum())
    only_b = int(((xa == 0) & (xb == 1)).sum())
    return PairedDiff(n=n, acc_a=float(xa.mean()), acc_b=float(xb.mean()),
                      delta=float(diff.mean() * 100),
                      ci_low=float(np.percentile(boot, 2.5)),
                      ci_high=float(np.percentile(boot, 97.5)),
                      only_a=only_a, only_b=only_b, mcnemar_p=mcnemar_exact(only_a, only_b))


@dataclass(frozen=True)
class Agreement:
    """How many of paired decisions agree, over ``n`` items, with a 95% interval.

    Attributes:
        n: items.
        decisions: decisions compared (an item has one or more).
        rate: agreeing decisions / decisions.
        ci_low, ci_high: the bootstrap's 95% percentile interval of ``rate``, resampling items
            (an item's decisions stay together).
    """

    n: int
    decisions: int
    rate: float
    ci_low: float
    ci_high: float


def agreement(per_item: Sequence[tuple[int, int]], resamples: int = 10_000,
              seed: int = 0) -> Agreement:
    """The agreement rate of paired decisions, ``per_item[i] = (agreeing, compared)`` on item
    ``i``, with its item bootstrap interval."""
    if not per_item:
        return Agreement(0, 0, 1.0, 1.0, 1.0)
    agree = np.asarray([a for a, _ in per_item], dtype=np.float64)
    total = np.asarray([t for _, t in per_item], dtype=np.float64)
    if (agree > total).any() or (total < 1).any():
        raise ValueError("each item needs 1 or more decisions and at most that many agreeing")
    idx = np.random.default_rng(seed).integers(0, len(per_item), size=(resamples, len(per_item)))
    boot = agree[idx].sum(axis=1) / total[idx].sum(axis=1)
    return Agreement(n=len(per_item), decisions=int(total.sum()),
                     rate=float(agree.sum() / total.sum()),
                     ci_low=float(np.percentile(boot, 2.5)),
                     ci_high=float(np.percentile(boot, 97.5)))

