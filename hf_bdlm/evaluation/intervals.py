"""Confidence intervals of the proportions the evaluations and benchmarks report (pass@1, exact match).

    from hf_bdlm.evaluation.intervals import wilson_interval
    low, high = wilson_interval(12, 164)      # 95 %: (0.0423, 0.1235)
"""

from __future__ import annotations

import math


def wilson_interval(hits: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion ``hits / n`` (``z``: the normal quantile)."""
    if n <= 0:
        raise ValueError(f"an interval needs at least one trial, got n={n}")
    if not 0 <= hits <= n:
        raise ValueError(f"hits={hits} is not between 0 and n={n}")
    p, z2 = hits / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


__all__ = ["wilson_interval"]
