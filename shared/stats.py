"""Percentiles and ``{"mean", "p50", "p99"}`` summaries, for the simulator and the bench.

Percentiles are linearly interpolated between order statistics (numpy's default
``method="linear"``); an empty list summarises to ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, like numpy's default:
    rank ``q / 100 * (n - 1)`` in the sorted values, interpolated between its neighbours."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Iterable[float]) -> dict[str, float] | None:
    """``{"mean", "p50", "p99"}`` of ``values``; ``None`` when there are none."""
    data = list(values)
    if not data:
        return None
    return {
        "mean": math.fsum(data) / len(data),
        "p50": percentile(data, 50),
        "p99": percentile(data, 99),
    }
