"""The one percentile iop reports: nearest rank, the smallest sample with at least q of them at or below it.

/usage, /status, `iop smoke` and `iop qualify`'s sweep all read their p50 and p95 through it, so a
"p95" means the same thing everywhere: on the samples 1..20 it is 19, never the maximum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The sample at rank ceil(q·n) of the sorted `values` (q in (0, 1]); None when there are none."""
    if not 0.0 < q <= 1.0:
        raise ValueError(f"percentile fraction {q!r} is not in (0, 1]")
    ordered = sorted(values)
    if not ordered:
        return None
    # Rounded first: 0.95 * 100 is not exactly 95 in binary, and its ceiling would be rank 96.
    rank = math.ceil(round(q * len(ordered), 9))
    return ordered[max(1, rank) - 1]
