"""The sweep's choice of levels and the knee, on a modelled server whose rate at each concurrency is
known exactly, so the recommendation is pinned without timing anything (tests/test_qualify.py runs
the same sweep through a real edge and node, where a loaded machine moves rates a little)."""

from __future__ import annotations

import pytest

from iop.qualify.schema import Level
from iop.qualify.sweep import SweepSettings, recommend, sweep_levels


class Modelled:
    """K streams at `rate` tokens/s each, no gain past K; `stalls` lowers the first measurement of a
    level by a factor (a host that stopped the server for a moment), `failing` levels error out."""

    def __init__(self, k: int, stalls: dict[int, float] | None = None, failing_from: int = 0) -> None:
        self.k = k
        self.stalls = stalls or {}
        self.failing_from = failing_from
        self.measured: list[int] = []

    async def __call__(self, c: int) -> Level:
        self.measured.append(c)
        rate = 100.0 * min(c, self.k)
        if self.measured.count(c) == 1:
            rate *= self.stalls.get(c, 1.0)
        ok = 0 if self.failing_from and c >= self.failing_from else 2 * c
        return Level(
            concurrency=c,
            requests=2 * c,
            ok=ok,
            errors=2 * c - ok,
            output_tokens=int(rate),
            wall_s=1.0,
            throughput_tok_s=rate if ok else 0.0,
        )


async def _recommended(server: Modelled, cap: int) -> tuple[int | None, list[Level]]:
    levels = await sweep_levels(server, SweepSettings(ceiling=2 * cap, configured=cap))
    rec = recommend(levels, cap, max(lv.concurrency for lv in levels))
    return rec.recommended_capacity, levels


@pytest.mark.parametrize(("k", "cap"), [(1, 4), (2, 2), (3, 4), (5, 3), (8, 8), (6, 16)])
async def test_the_recommendation_is_the_servers_parallel_slots(k: int, cap: int) -> None:
    server = Modelled(k)
    rec, levels = await _recommended(server, cap)
    assert rec == k, levels
    # The configured capacity is always among the levels the verdict compares against.
    assert cap in {lv.concurrency for lv in levels}


async def test_widening_stops_once_the_curve_is_flat() -> None:
    server = Modelled(2)
    await _recommended(server, 16)
    # 1, 2, then 4 is flat (measured twice to be sure): never 8 or 32. Then the level below the
    # knee again, and the configured 16 for the verdict.
    assert server.measured == [1, 2, 4, 4, 1, 16], server.measured


async def test_a_flat_looking_level_is_measured_again_before_widening_stops() -> None:
    # K=5: 4 at once must be about twice 2 at once, but its first measurement stalled to look no
    # better than 2; taken as flat, the sweep would stop at 4 and recommend 4 or less.
    server = Modelled(5, stalls={4: 0.5})
    rec, levels = await _recommended(server, 3)
    assert server.measured[:5] == [1, 2, 4, 4, 6], server.measured
    assert rec == 5, levels


async def test_the_level_below_the_knee_is_measured_again_before_the_recommendation() -> None:
    # K=2: its level stalled once and looks well below 3 and 4; measured once, the knee would be 3.
    server = Modelled(2, stalls={2: 0.6})
    rec, levels = await _recommended(server, 2)
    assert server.measured.count(2) == 2
    assert rec == 2, levels


async def test_a_level_that_fails_under_load_ends_the_sweep() -> None:
    server = Modelled(8, failing_from=4)
    rec, levels = await _recommended(server, 8)
    assert 8 not in server.measured[: server.measured.index(4) + 1]
    assert max(c for c in server.measured if c != 8) <= 4
    assert rec == 2, levels  # of the levels that counted (1 and 2), the knee
