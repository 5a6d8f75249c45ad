"""Routing among a pool's free providers (iop/edge/routing.py) and request deadlines, on the scheduler alone.

The scheduler needs no NATS: these run on the event loop; what the router knows of a provider is
taught the way the dispatch teaches it (`Scheduler.ended` with the node's `Done`).
"""

from __future__ import annotations

import asyncio
from time import monotonic

import pytest

from iop import wire
from iop.edge.routing import Ask, Curve, PoolRules
from iop.edge.scheduler import Scheduler
from iop.errors import Unavailable


def scheduler(providers: dict[str, int], routing: str = "expected_finish") -> Scheduler:
    s = Scheduler(100)
    for pid, capacity in providers.items():
        s.add_provider(pid, f"node-{pid}", capacity)
        s.set_connected(pid, True)
    s.add_pool("m", list(providers))
    s.pools["m"].rules = PoolRules(routing)  # type: ignore[arg-type]
    return s


def soon() -> float:
    return asyncio.get_running_loop().time() + 5.0


async def in_time(s: Scheduler, ask: Ask) -> str:
    """A slot for a request with a deadline, bounded the way the dispatch bounds it (`Router.bound`)."""
    loop = asyncio.get_running_loop()
    deadline = s.router.bound("m", s.pools["m"].in_rotation(), ask, soon(), loop.time())
    try:
        return (await s.acquire_grant("m", deadline, ask=ask)).slot.id
    except Unavailable as exc:
        if exc.code == "queue_timeout" and ask.late is not None and monotonic() >= ask.late - 0.01:
            return "late"
        raise


def teach(
    s: Scheduler,
    provider: str,
    ttfb_ms: float,
    tok_s: float,
    tokens: int = 100,
    times: int = 3,
    held_s: float | None = None,
) -> None:
    """`times` streamed answers of `tokens` tokens: TTFT `ttfb_ms`, then `tok_s` tokens per second;
    each held its slot at the edge for `held_s`."""
    run_ms = ttfb_ms + (tokens - 1) / tok_s * 1000
    done = wire.Done("x", tokens, wire.Usage(10, tokens), 200, None, run_ms, ttfb_ms)
    for _ in range(times):
        s.router.ended(provider, "m", True, done, 10, 1, held_s)


async def test_routing_prefers_the_provider_expected_to_finish_first() -> None:
    s = scheduler({"fast": 4, "slow": 8})  # the slow one has more free slots: free-slot ranking takes it
    teach(s, "fast", 50, 200)
    teach(s, "slow", 400, 20)
    ask = Ask(input_tokens=10)
    grant = await s.acquire_grant("m", soon(), ask=ask)
    assert grant.slot.id == "fast"
    assert ask.reason.startswith("expected_finish ") and " vs " in ask.reason


async def test_routing_free_slots_opt_out_ranks_by_free_slots() -> None:
    s = scheduler({"fast": 4, "slow": 8}, routing="free_slots")
    teach(s, "fast", 50, 200)
    teach(s, "slow", 400, 20)
    ask = Ask(input_tokens=10)
    assert (await s.acquire_grant("m", soon(), ask=ask)).slot.id == "slow"
    assert ask.reason == "free_slots"


def arrivals_every(s: Scheduler, gap_s: float) -> None:
    """The pool's requests have come `gap_s` apart so far (what the router learns from their arrivals)."""
    s.router.gaps["m"] = (monotonic(), gap_s)


async def waiting(s: Scheduler, n: int) -> None:
    async with asyncio.timeout(5):
        while s.waiting("m") != n:
            s.changed.clear()
            await s.changed.wait()


async def test_routing_holds_out_for_a_busy_faster_provider_rather_than_take_a_slow_free_one() -> None:
    s = scheduler({"fast": 1, "slow": 1})
    teach(s, "fast", 50, 200)  # 100 tokens: 0.55 s; its one slot frees within that
    teach(s, "slow", 400, 20)  # 5.4 s
    arrivals_every(s, 30.0)  # a quiet pool: a request waiting for "fast" delays hardly anyone after it
    assert (await s.acquire_grant("m", soon(), ask=Ask())).slot.id == "fast"
    second = Ask()
    got = asyncio.ensure_future(s.acquire_grant("m", soon(), ask=second))
    await waiting(s, 1)
    assert s.providers["slow"].in_flight == 0  # free, and passed over
    s.release(s.providers["fast"])
    assert (await asyncio.wait_for(got, 5)).slot.id == "fast"
    assert second.reason.startswith("expected_finish ") and "after holding" in second.reason


async def test_routing_sends_the_queue_the_busy_provider_cannot_clear_in_time_to_the_free_one() -> None:
    s = scheduler({"fast": 1, "slow": 1})
    teach(s, "fast", 50, 200)  # 0.55 s
    teach(s, "slow", 400, 100)  # 1.4 s: worth it for the second in line for "fast" (1.65 s), not the first (1.1 s)
    arrivals_every(s, 30.0)  # a quiet pool: a request waiting for "fast" delays hardly anyone after it
    assert (await s.acquire_grant("m", soon(), ask=Ask())).slot.id == "fast"
    first = asyncio.ensure_future(s.acquire_grant("m", soon(), ask=Ask()))
    await waiting(s, 1)
    second = Ask()
    assert (await asyncio.wait_for(s.acquire_grant("m", soon(), ask=second), 5)).slot.id == "slow"
    assert second.reason.startswith("expected_finish ") and s.waiting("m") == 1
    s.release(s.providers["fast"])
    assert (await asyncio.wait_for(first, 5)).slot.id == "fast"


async def test_routing_stops_holding_out_once_waiting_longer_cannot_pay() -> None:
    s = scheduler({"fast": 1, "slow": 1})
    teach(s, "fast", 50, 200)  # 0.55 s
    teach(s, "slow", 400, 100)  # 1.4 s: waiting more than 0.85 s for "fast" is worse than this
    arrivals_every(s, 30.0)  # a quiet pool: a request waiting for "fast" delays hardly anyone after it
    await s.acquire_grant("m", soon(), ask=Ask())  # and it never ends
    ask = Ask()
    t0 = monotonic()
    assert (await asyncio.wait_for(s.acquire_grant("m", soon(), ask=ask), 5)).slot.id == "slow"
    assert monotonic() - t0 >= 0.85 - 0.01 and "after holding" in ask.reason


async def test_routing_reads_the_wait_for_a_busy_provider_from_how_long_its_slots_are_held_here() -> None:
    s = scheduler({"fast": 1, "slow": 1})
    teach(s, "fast", 50, 200, held_s=3.0)  # 0.55 s at the node, but its slot turns over every 3 s here
    teach(s, "slow", 400, 20)  # 5.4 s
    arrivals_every(s, 30.0)
    assert (await s.acquire_grant("m", soon(), ask=Ask())).slot.id == "fast"
    first = asyncio.ensure_future(s.acquire_grant("m", soon(), ask=Ask()))
    await waiting(s, 1)  # 3.55 s: worth waiting for
    assert (await asyncio.wait_for(s.acquire_grant("m", soon(), ask=Ask()), 5)).slot.id == "slow"  # 6.55 s: not
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_routing_holds_out_for_none_when_the_busy_provider_alone_cannot_take_the_pools_load() -> None:
    s = scheduler({"fast": 1, "slow": 1})
    teach(s, "fast", 50, 200)  # 0.55 s a request, one at a time: under 2 a second
    teach(s, "slow", 400, 20)
    arrivals_every(s, 0.25)  # 4 a second
    assert (await s.acquire_grant("m", soon(), ask=Ask())).slot.id == "fast"
    assert (await asyncio.wait_for(s.acquire_grant("m", soon(), ask=Ask()), 5)).slot.id == "slow"


async def test_routing_never_holds_out_in_a_free_slots_pool() -> None:
    s = scheduler({"fast": 1, "slow": 1}, routing="free_slots")
    teach(s, "fast", 50, 200)
    teach(s, "slow", 400, 20)
    assert (await s.acquire_grant("m", soon(), ask=Ask())).slot.id == "fast"
    assert (await asyncio.wait_for(s.acquire_grant("m", soon(), ask=Ask()), 5)).slot.id == "slow"


async def test_routing_tries_an_unmeasured_provider_first() -> None:
    s = scheduler({"known": 4, "new": 4})
    teach(s, "known", 50, 200)
    ask = Ask()
    assert (await s.acquire_grant("m", soon(), ask=ask)).slot.id == "new"
    assert ask.reason == "unmeasured"


async def test_routing_similar_providers_share_the_load_by_free_slots() -> None:
    s = scheduler({"a": 4, "b": 4})
    teach(s, "a", 50, 200)
    teach(s, "b", 52, 195)
    got = [(await s.acquire_grant("m", soon(), ask=Ask())).slot.id for _ in range(4)]
    assert sorted(got) == ["a", "a", "b", "b"]


async def test_routing_reads_the_qualification_curve_at_the_concurrency_it_would_run_at() -> None:
    # Unmeasured live, qualified: "gpu" keeps its decode rate under load, "mac" halves it at 2.
    s = scheduler({"gpu": 4, "mac": 4})
    s.router.of("gpu").curve = Curve(((1, 0.2, 60.0), (4, 0.25, 55.0)))
    s.router.of("mac").curve = Curve(((1, 0.1, 80.0), (2, 0.2, 30.0), (4, 0.4, 10.0)))
    first = await s.acquire_grant("m", soon(), ask=Ask())
    second = await s.acquire_grant("m", soon(), ask=Ask())
    assert (first.slot.id, second.slot.id) == ("mac", "gpu")  # idle the Mac is quicker; with one running it is not


async def test_routing_prefers_an_affinity_provider_whenever_it_is_free() -> None:
    s = scheduler({"fast": 4, "slow": 4})
    teach(s, "fast", 50, 200)
    teach(s, "slow", 400, 20)
    ask = Ask()
    assert (await s.acquire_grant("m", soon(), prefer="slow", ask=ask)).slot.id == "slow"
    assert ask.reason == "affinity"


async def test_deadline_nobody_can_meet_is_refused_at_once() -> None:
    s = scheduler({"slow": 4})
    teach(s, "slow", 400, 20)  # 100 tokens: about 5.4 s
    t0 = monotonic()
    with pytest.raises(Unavailable) as refused:
        await in_time(s, Ask(max_tokens=100, finish_by=monotonic() + 1.0))
    assert (refused.value.status, refused.value.code) == (504, "deadline_unmeetable")
    assert monotonic() - t0 < 0.5
    assert s.waiting("m") == 0 and s.providers["slow"].in_flight == 0


async def test_deadline_skips_a_free_provider_too_slow_for_it_while_a_quick_one_is_free() -> None:
    s = scheduler({"fast": 1, "slow": 8})
    teach(s, "fast", 50, 100)  # 100 tokens: 1.05 s
    teach(s, "slow", 400, 40)  # 2.9 s
    assert await in_time(s, Ask(max_tokens=100, finish_by=monotonic() + 2.0)) == "fast"
    # The quick one is busy now: the request waits for it rather than taking the free slow one ...
    waiter = asyncio.ensure_future(in_time(s, Ask(max_tokens=100, finish_by=monotonic() + 2.0)))
    await waiting(s, 1)
    # ... while a request without a deadline behind it takes the slow one at once (second in line
    # for the quick one, it would finish there in about 3.2 s).
    assert (await asyncio.wait_for(s.acquire_grant("m", soon(), ask=Ask()), 5)).slot.id == "slow"
    s.release(s.providers["fast"])
    assert await asyncio.wait_for(waiter, 5) == "fast"


async def test_deadline_waiting_past_it_leaves_the_queue_with_the_deadline_error() -> None:
    s = scheduler({"fast": 1})
    teach(s, "fast", 50, 200)
    await s.acquire_grant("m", soon(), ask=Ask())
    t0 = monotonic()
    assert await in_time(s, Ask(max_tokens=100, finish_by=monotonic() + 0.8)) == "late"
    assert monotonic() - t0 < 0.8  # it left once a free slot could no longer answer in time
    assert s.waiting("m") == 0 and s.waiting_bytes == 0


async def test_routing_counts_a_stopped_servers_cold_start_against_it() -> None:
    s = scheduler({"fast": 4, "slow": 4})
    teach(s, "fast", 50, 200)
    teach(s, "slow", 400, 20)  # about 13 s for 256 tokens: still quicker than a 30 s start
    stopped = wire.ServerLive(state="stopped", last_cold_start_ms=30_000)
    s.router.server_of = lambda pid: stopped if pid == "fast" else None
    assert (await s.acquire_grant("m", soon(), ask=Ask())).slot.id == "slow"
    s.router.server_of = lambda pid: wire.ServerLive(state="ready") if pid == "fast" else None
    assert (await s.acquire_grant("m", soon(), ask=Ask())).slot.id == "fast"
