"""The nearest-rank percentile every report uses, pinned on small samples."""

from __future__ import annotations

import pytest

from iop.percentile import nearest_rank


def test_percentile_p95_of_one_to_twenty_is_nineteen_not_the_maximum() -> None:
    assert nearest_rank(range(1, 21), 0.95) == 19


def test_percentile_p50_is_the_lower_middle_of_an_even_sample() -> None:
    assert nearest_rank([4.0, 1.0, 3.0, 2.0], 0.50) == 2.0
    assert nearest_rank([3.0, 1.0, 2.0], 0.50) == 2.0


@pytest.mark.parametrize(
    ("n", "q", "rank"),
    [(1, 0.95, 1), (2, 0.95, 2), (19, 0.95, 19), (20, 0.95, 19), (21, 0.95, 20), (100, 0.95, 95), (100, 0.99, 99)],
)
def test_percentile_is_the_sample_at_rank_ceil_q_n(n: int, q: float, rank: int) -> None:
    assert nearest_rank([float(i) for i in range(n, 0, -1)], q) == float(rank)


def test_percentile_of_no_samples_is_none() -> None:
    assert nearest_rank([], 0.5) is None


def test_percentile_q_is_refused_outside_zero_to_one() -> None:
    with pytest.raises(ValueError, match="not in"):
        nearest_rank([1.0], 95)
    with pytest.raises(ValueError, match="not in"):
        nearest_rank([1.0], 0)
