"""Figures as the benchmarks report them: a percentile of a sample, a number or ``n/a``."""

from __future__ import annotations


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``xs``, the nearest sample (NaN for none)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def fmt(x: float | None, digits: int) -> str:
    """``x`` with ``digits`` decimals, or ``n/a`` for None."""
    return "n/a" if x is None else f"{x:.{digits}f}"
