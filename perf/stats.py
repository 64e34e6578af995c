"""Latency statistics: the one definition of a percentile that every report, table and
verdict uses (`baton bench`'s summary, the simulator's, the benchmarks' tables).

A percentile is linear interpolation between the two nearest ranks, numpy's default method
("linear"; Hyndman and Fan's type 7). For n values sorted as x[0] <= ... <= x[n-1] and
0 <= q <= 100, the rank is r = (n - 1) * q / 100, and

    percentile(x, q) = x[floor(r)] + (x[floor(r) + 1] - x[floor(r)]) * (r - floor(r))

(just x[floor(r)] when r is a whole number). So p0 is the smallest value, p100 the largest,
p50 the median (the mean of the middle two of an even count), and p99 of fewer than 101
values lies between the two largest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

SUMMARY_KEYS = ("mean", "median", "p90", "p99")


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of values, by the module's definition; ValueError
    for no values or q out of range."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within 0..100, got {q!r}")
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    rank = (len(xs) - 1) * q / 100.0
    low = math.floor(rank)
    if low == rank:
        return float(xs[low])
    return xs[low] + (xs[low + 1] - xs[low]) * (rank - low)


def summary(values: Iterable[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean / median / p90 / p99 of values times `scale`, every entry None when there are
    none (a report's "no such requests")."""
    xs = [v * scale for v in values]
    if not xs:
        return dict.fromkeys(SUMMARY_KEYS)
    return dict(
        mean=math.fsum(xs) / len(xs),
        median=percentile(xs, 50),
        p90=percentile(xs, 90),
        p99=percentile(xs, 99),
    )


def summary_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """summary() of seconds, in milliseconds."""
    return summary(values_s, scale=1000.0)
