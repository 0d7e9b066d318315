"""Repeated timings and the comparisons a reviewer can trust: median, range, and ties.

Every timed study records all its timed steps (after a warm-up) and reports them as a :class:`Spread`: the median
and the range ``[min, max]``. Two layouts are compared by the ratio of their medians, but only when their ranges do
not overlap; otherwise the machine's noise is as large as the difference and the comparison is a tie.

    python -c "from hf_bdlm.benchmarks.spread import Spread, compare; print(compare(Spread([2.0, 2.1, 2.2]), Spread([1.0, 1.1, 1.05])))"
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

MIN_TIMED_STEPS = 3


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one quantity (seconds per step, say).

    Parameters:
        values (`tuple[float, ...]`): every measurement, in the order taken; at least one.
    """

    values: tuple[float, ...]

    def __init__(self, values):
        values = tuple(float(v) for v in values)
        if not values:
            raise ValueError("a Spread needs at least one measurement, got none.")
        object.__setattr__(self, "values", values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def overlaps(self, other: "Spread") -> bool:
        """Whether the two ranges ``[low, high]`` share a point."""
        return self.low <= other.high and other.low <= self.high

    def describe(self, fmt: str = ".2f") -> str:
        """``median [low-high]``, or the one value when there is one."""
        if len(self.values) == 1:
            return format(self.values[0], fmt)
        return f"{self.median:{fmt}} [{self.low:{fmt}}-{self.high:{fmt}}]"

    def as_record(self) -> dict:
        return dict(median=self.median, low=self.low, high=self.high, values=list(self.values))


@dataclass(frozen=True)
class Comparison:
    """``baseline`` time over ``candidate`` time (> 1: the candidate is faster), or a tie when the ranges overlap."""

    ratio: float
    tie: bool
    ratio_low: float
    ratio_high: float

    def describe(self) -> str:
        """``1.32x`` for a speed-up the ranges support, ``tie (0.97x)`` where they overlap."""
        return f"tie ({self.ratio:.2f}x)" if self.tie else f"{self.ratio:.2f}x"

    def as_record(self) -> dict:
        return dict(ratio=self.ratio, tie=self.tie, ratio_low=self.ratio_low, ratio_high=self.ratio_high)


def compare(baseline: Spread, candidate: Spread) -> Comparison:
    """How much faster ``candidate`` is than ``baseline`` (both step times): the ratio of medians, the extreme ratios
    the two ranges allow, and whether the ranges overlap (a tie)."""
    return Comparison(baseline.median / candidate.median, baseline.overlaps(candidate),
                      baseline.low / candidate.high, baseline.high / candidate.low)


def check_timed_steps(steps: int, what: str = "--steps") -> int:
    """A timed study's step count: at least :data:`MIN_TIMED_STEPS`, so every record carries a range."""
    if steps < MIN_TIMED_STEPS:
        raise ValueError(f"{what}={steps}: a timed comparison needs at least {MIN_TIMED_STEPS} timed steps after "
                         f"the warm-up so that each figure carries its range; pass {what} {MIN_TIMED_STEPS} or more.")
    return steps


__all__ = ["Comparison", "MIN_TIMED_STEPS", "Spread", "check_timed_steps", "compare"]
