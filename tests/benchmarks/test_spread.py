"""Repeated timings: medians, ranges, and ties where ranges overlap (hf_bdlm.benchmarks.spread)."""

import pytest

from hf_bdlm.benchmarks.spread import Spread, check_timed_steps, compare


def test_spread_reports_median_and_range():
    s = Spread([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high) == (2.5, 1.0, 10.0)
    assert s.describe(".1f") == "2.5 [1.0-10.0]"
    assert s.as_record()["values"] == [3.0, 1.0, 2.0, 10.0]


def test_separated_ranges_give_a_speed_up():
    c = compare(Spread([2.0, 2.1, 2.2]), Spread([1.0, 1.05, 1.1]))
    assert not c.tie and c.ratio == pytest.approx(2.1 / 1.05)
    assert c.ratio_low == pytest.approx(2.0 / 1.1) and c.ratio_high == pytest.approx(2.2 / 1.0)
    assert c.describe() == "2.00x"


def test_overlapping_ranges_are_a_tie():
    c = compare(Spread([2.0, 3.0, 2.4]), Spread([2.5, 2.6, 2.55]))
    assert c.tie and c.describe() == "tie (0.94x)"


def test_a_spread_needs_a_measurement_and_a_study_three_steps():
    with pytest.raises(ValueError, match="at least one"):
        Spread([])
    with pytest.raises(ValueError, match="--steps=2.*at least 3"):
        check_timed_steps(2)
    assert check_timed_steps(3) == 3
