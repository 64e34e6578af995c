"""perf/stats.py: the one percentile definition (linear between the nearest ranks), exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from perf.stats import percentile, summary, summary_ms


def test_linear_interpolation_between_the_nearest_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4; rank = 3 q / 100
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5  # rank 1.5: the mean of the middle two
    assert percentile(xs, 25) == 1.75  # rank 0.75
    assert percentile(xs, 200 / 3) == 3.0  # rank 2 (within float rounding of a whole rank)
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0  # rank 1: the middle value itself
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0], 90) == 46.0  # rank 3.6
    assert percentile([7.0], 99) == 7.0


def test_p99_of_few_values_lies_between_the_two_largest():
    xs = [float(v) for v in range(1, 11)]  # rank 9 * 0.99 = 8.91: 9 + 0.91 * (10 - 9)
    assert percentile(xs, 99) == pytest.approx(9.91, abs=1e-12)
    assert 9.0 < percentile(xs, 99) < 10.0


def test_it_is_numpys_default_method():
    rng = random.Random(3)
    for n in (1, 2, 5, 17, 100, 101, 1000):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 10, 25, 50, 75, 90, 95, 99, 99.9, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_no_values_or_a_bad_q_is_an_error():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="within 0..100"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="within 0..100"):
        percentile([1.0], -1)


def test_summary_and_summary_ms():
    assert summary([0.4, 0.1, 0.2, 0.3]) == pytest.approx(
        dict(mean=0.25, median=0.25, p90=0.37, p99=0.397), abs=1e-15
    )
    assert summary_ms([0.1, 0.3, 0.2, 0.1]) == pytest.approx(
        dict(mean=175.0, median=150.0, p90=270.0, p99=297.0)
    )
    assert summary([]) == dict(mean=None, median=None, p90=None, p99=None)
    assert summary_ms(iter(())) == dict(mean=None, median=None, p90=None, p99=None)
