"""bench/serve_common.median_interval: the distribution-free interval of a median that
bench/engine_load.py puts on its paired ratios."""
import importlib.util
import math
import random
import statistics
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("serve_common", Path(__file__).parents[1] / "bench" / "serve_common.py")
serve_common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_common)


def _coverage(n: int, j: int) -> float:
    """P(the j-th smallest <= median <= the j-th largest) of n samples of a continuous distribution."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2 ** n


@pytest.mark.parametrize("n", range(1, 21))
def test_the_interval_is_the_widest_order_statistics_that_cover(n):
    values = random.Random(n).sample(range(1000), n)
    bounds = serve_common.median_interval(values, 0.9)
    ordered = sorted(values)
    j = max((j for j in range(1, n // 2 + 1) if _coverage(n, j) >= 0.9), default=None)
    if j is None:
        assert bounds is None
        return
    median, low, high = bounds
    assert median == statistics.median(values)
    assert (low, high) == (ordered[j - 1], ordered[n - j])
    assert _coverage(n, j) >= 0.9 and (j + 1 > n // 2 or _coverage(n, j + 1) < 0.9)


def test_the_interval_covers_the_median_as_often_as_it_says():
    rng, trials, inside = random.Random(0), 4000, 0
    for _ in range(trials):  # a skewed distribution whose median is 1 (lognormal, mu 0)
        bounds = serve_common.median_interval([rng.lognormvariate(0, 0.5) for _ in range(9)], 0.9)
        inside += bounds[1] <= 1.0 <= bounds[2]
    assert abs(inside / trials - _coverage(9, 2)) < 0.015  # 0.961


def test_no_values_no_interval():
    assert serve_common.median_interval([], 0.9) is None


def test_the_text_says_median_and_interval_or_too_few():
    assert serve_common.median_text([1.0, 2.0, 3.0, 4.0, 5.0]) == "3.00 [1.00, 5.00]"
    assert serve_common.median_text([0.9, 1.1]) == "1.00 [n < 5]"
    assert serve_common.median_text([]) == "-"
