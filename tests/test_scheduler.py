"""The pool scheduler and the dispatch that owns a pool request's slot, without a deployment.

The scheduler needs no NATS, so its tests run on the event loop alone. The dispatch tests use a
real nats-server and the real relay; the test plays the node by reading the work items published
to the stream's subjects and answering on their reply subjects.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from iop import errors, wire
from iop.edge import admission as admission_module
from iop.edge import scheduler as scheduler_module
from iop.edge import slots as slots_module
from iop.edge.channel import Channel
from iop.edge.dispatch import DirectDispatch, PoolDispatch
from iop.edge.observe import Trace
from iop.edge.relay import Relay
from iop.edge.scheduler import Scheduler
from iop.edge.slots import Grant, ProviderSlots
from iop.edge.tenants import Tenant, TenantPolicy
from iop.errors import (
    BadRequest,
    NodeLost,
    QueueFull,
    RequestError,
    Unavailable,
    UpstreamError,
    error_of,
    failure_of,
)
from iop.nats import connection, streams
from iop.nats.server import EmbeddedNats
from tests.harness import eventually, stream_messages, until


def scheduler(
    providers: dict[str, int], pools: dict[str, list[str]], max_waiting: int = 100, standby: int = 0
) -> Scheduler:
    """A scheduler with every provider connected (on a node named after it)."""
    s = Scheduler(max_waiting, standby=standby)
    for pid, capacity in providers.items():
        s.add_provider(pid, f"node-{pid}", capacity)
        s.set_connected(pid, True)
    for alias, members in pools.items():
        s.add_pool(alias, members)
    return s


def soon() -> float:
    return asyncio.get_running_loop().time() + 5.0


async def granted(future: asyncio.Future[Grant] | asyncio.Task[Grant]) -> Grant:
    return await asyncio.wait_for(future, 5.0)


def free(s: Scheduler, grant: Grant) -> None:
    """The request holding `grant` ended: its slot and its tenant's share are given back."""
    s.release(grant.slot, grant)


async def waiting(s: Scheduler, alias: str, n: int) -> None:
    """Until `n` requests wait in the pool's queue."""
    async with asyncio.timeout(5):
        while s.waiting(alias) != n:
            s.changed.clear()
            await s.changed.wait()


# --- the scheduler ----------------------------------------------------------------------------------


async def test_scheduler_grants_a_free_slot_at_once_without_queueing() -> None:
    s = scheduler({"p": 2}, {"m": ["p"]})
    a = await s.acquire_grant("m", soon())
    b = await s.acquire_grant("m", soon())
    assert (a.slot.id, b.slot.id, s.providers["p"].in_flight, s.waiting("m")) == ("p", "p", 2, 0)


async def test_scheduler_binds_to_the_provider_with_most_free_slots() -> None:
    s = scheduler({"small": 2, "big": 4}, {"m": ["small", "big"]})
    picks = [(await s.acquire_grant("m", soon())).slot.id for _ in range(3)]
    # big has 4 free, then 3 (> 2), then 2 == 2: the tie rotates, and neither is ever over capacity.
    assert picks[:2] == ["big", "big"]
    assert s.providers["big"].in_flight + s.providers["small"].in_flight == 3
    for _ in range(3):
        await s.acquire_grant("m", soon())
    assert (s.providers["big"].in_flight, s.providers["small"].in_flight) == (4, 2)


async def test_scheduler_binds_a_waiter_late_to_whichever_provider_frees_first() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    held = [await s.acquire_grant("m", soon()), await s.acquire_grant("m", soon())]
    waiter = asyncio.create_task(s.acquire_grant("m", soon()))
    await waiting(s, "m", 1)
    held_b = next(g for g in held if g.slot.id == "b")
    free(s, held_b)
    assert (await granted(waiter)).slot.id == "b"
    assert s.waiting("m") == 0


async def test_scheduler_is_fifo_across_pools_sharing_a_provider() -> None:
    s = scheduler({"shared": 1}, {"alpha": ["shared"], "beta": ["shared"]})
    shared = await s.acquire_grant("alpha", soon())
    order: list[str] = []
    served = asyncio.Event()

    async def ask(name: str, alias: str) -> None:
        await s.acquire_grant(alias, soon())
        order.append(name)
        served.set()

    asking = [("a1", "alpha", 1), ("b1", "beta", 1), ("a2", "alpha", 2), ("b2", "beta", 2)]
    tasks = []
    for name, alias, queued in asking:
        tasks.append(asyncio.create_task(ask(name, alias)))
        await waiting(s, alias, queued)
    for _ in asking:
        served.clear()
        free(s, shared)  # one slot frees: the oldest waiter of either pool takes it
        await asyncio.wait_for(served.wait(), 5)
    assert order == ["a1", "b1", "a2", "b2"]
    await asyncio.gather(*tasks)


async def test_scheduler_waiters_cancelled_together_with_a_release_leave_cleanly() -> None:
    # Clients leaving en masse (a burst's connections closed at once): their waits are cancelled,
    # then the running request ends and its release clears the cancelled waiters off the queue's
    # head before their own handlers run. Before: each handler raised ValueError (not in deque).
    s = scheduler({"p": 1}, {"m": ["p"]})
    held = await s.acquire_grant("m", soon())
    waiters = [asyncio.create_task(s.acquire_grant("m", soon(), size=10)) for _ in range(3)]
    await waiting(s, "m", 3)
    for w in waiters:
        w.cancel()
    s.changed.clear()
    free(s, held)
    assert s.changed.is_set() and s.waiting("m") == 0  # observers hear that nobody waits any more
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    assert (s.waiting("m"), s.waiting_bytes, s.providers["p"].in_flight) == (0, 0, 0)


async def test_scheduler_refuses_past_max_waiting_with_retry_after() -> None:
    s = scheduler({"p": 1}, {"m": ["p"]}, max_waiting=1)
    await s.acquire_grant("m", soon())
    queued = asyncio.create_task(s.acquire_grant("m", soon()))
    await waiting(s, "m", 1)
    with pytest.raises(QueueFull) as refused:
        await s.acquire_grant("m", soon())
    assert refused.value.headers == {"Retry-After": "1"}
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    assert s.waiting("m") == 0


async def test_scheduler_gives_up_at_the_deadline_and_leaves_the_queue() -> None:
    s = scheduler({"p": 1}, {"m": ["p"]})
    grant = await s.acquire_grant("m", soon())
    with pytest.raises(Unavailable) as late:
        await s.acquire_grant("m", asyncio.get_running_loop().time() + 0.05)
    assert late.value.code == "queue_timeout" and s.waiting("m") == 0
    free(s, grant)
    assert s.providers["p"].in_flight == 0


async def test_scheduler_waiters_time_out_in_deadline_order_whatever_their_arrival() -> None:
    # One timer serves every waiter: a later arrival with a sooner deadline re-arms it, a waiter
    # granted before its deadline is not failed by it, and each expires at its own deadline.
    s = scheduler({"p": 1}, {"m": ["p"]})
    loop = asyncio.get_running_loop()
    held = await s.acquire_grant("m", soon())
    ended: list[str] = []

    async def wait(name: str, after_s: float) -> Grant | None:
        try:
            return await s.acquire_grant("m", loop.time() + after_s)
        except Unavailable as exc:
            assert exc.code == "queue_timeout"
            return None
        finally:
            ended.append(name)

    late = asyncio.create_task(wait("late", 3.0))
    await waiting(s, "m", 1)
    first = asyncio.create_task(wait("first", 30))  # granted below, long before its deadline
    await waiting(s, "m", 2)
    soonest = asyncio.create_task(wait("soonest", 0.1))
    await waiting(s, "m", 3)
    assert await asyncio.wait_for(soonest, 5) is None and ended == ["soonest"]
    free(s, held)  # "late" is older than "first": it takes the slot ...
    got = await asyncio.wait_for(late, 5)
    assert got is not None and ended == ["soonest", "late"]
    free(s, got)  # ... and "first" the next one, its deadline far off
    got = await asyncio.wait_for(first, 5)
    assert got is not None and ended == ["soonest", "late", "first"]
    free(s, got)
    assert (s.waiting("m"), s.providers["p"].in_flight) == (0, 0)
    # Nobody waits: no deadline is kept (a drained burst's futures are not held until they expire).
    assert not len(s._deadlines) and not s._deadlines.armed


async def test_scheduler_bounds_the_bytes_waiting_requests_hold() -> None:
    s = scheduler({"p": 1}, {"m": ["p"], "n": ["p"]})
    s.max_waiting_bytes = 1000
    held = await s.acquire_grant("m", soon(), size=5000)  # a request granted at once holds nothing here
    first = asyncio.create_task(s.acquire_grant("m", soon(), size=600))
    await waiting(s, "m", 1)
    assert s.waiting_bytes == 600
    with pytest.raises(QueueFull) as refused:
        await s.acquire_grant("n", soon(), size=600)  # the bound is the edge's, over every pool
    assert refused.value.headers == {"Retry-After": "1"} and "max_waiting_mb" in refused.value.message
    small = asyncio.create_task(s.acquire_grant("n", soon(), size=400))
    await waiting(s, "n", 1)
    assert s.waiting_bytes == 1000
    small.cancel()  # a waiter that leaves gives its bytes back
    await asyncio.gather(small, return_exceptions=True)
    assert s.waiting_bytes == 600
    free(s, held)
    free(s, await granted(first))  # and so does one that is granted
    assert s.waiting_bytes == 0


async def test_scheduler_waits_for_a_provider_to_connect() -> None:
    s = Scheduler(100)  # as at the edge's start: the node has not connected yet
    s.add_provider("p", "node-p", 1)
    s.add_pool("m", ["p"])
    waiter = asyncio.create_task(s.acquire_grant("m", soon()))
    await asyncio.sleep(0)  # let it find nobody connected
    assert not waiter.done()
    s.set_connected("p", True)
    assert (await granted(waiter)).slot.id == "p"


async def test_scheduler_never_hands_out_an_excluded_provider() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    held_a = await s.acquire_grant("m", soon(), frozenset({"b"}))
    assert held_a.slot.id == "a"
    held_b = await s.acquire_grant("m", soon())
    waiter = asyncio.create_task(s.acquire_grant("m", soon(), frozenset({"b"})))
    await waiting(s, "m", 1)
    free(s, held_b)  # b frees, but the waiter excludes it
    assert s.waiting("m") == 1 and s.providers["b"].in_flight == 0
    free(s, held_a)
    assert (await granted(waiter)).slot.id == "a"


async def test_scheduler_breaker_opens_half_opens_and_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_module, "BREAKER_COOLDOWN_S", 0.2)
    s = scheduler({"p": 4, "busy": 1}, {"m": ["p", "busy"]})
    p = s.providers["p"]
    await s.acquire_grant("m", soon(), frozenset({"p"}))  # the other provider is busy throughout
    for _ in range(scheduler_module.BREAKER_FAILURES):
        free(s, await s.acquire_grant("m", soon(), frozenset({"busy"})))
        s.failed(p)
    assert p.breaker(time.monotonic()) == "open" and not p.usable(time.monotonic())

    # Open: requests wait although p has free slots; when the cooldown ends one trial goes out.
    trial = asyncio.create_task(s.acquire_grant("m", soon()))
    second = asyncio.create_task(s.acquire_grant("m", soon()))
    await waiting(s, "m", 2)
    assert (await granted(trial)).slot is p
    assert p.trial and p.breaker(time.monotonic()) == "half_open"
    assert s.waiting("m") == 1 and p.in_flight == 1  # half-open: one request at a time

    # The trial succeeds: closed, and the next waiter gets its slot at once.
    s.succeeded(p)
    assert (await granted(second)).slot is p
    assert (p.breaker(time.monotonic()), p.failures, p.trips, p.trial) == ("closed", 0, 0, False)


async def test_scheduler_breaker_failed_trial_reopens_for_twice_as_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_module, "BREAKER_COOLDOWN_S", 0.05)
    s = scheduler({"p": 1, "busy": 1}, {"m": ["p", "busy"]})
    p = s.providers["p"]
    await s.acquire_grant("m", soon(), frozenset({"p"}))  # busy throughout: requests wait for p
    for _ in range(scheduler_module.BREAKER_FAILURES):
        free(s, await s.acquire_grant("m", soon(), frozenset({"busy"})))
        s.failed(p)
    trial = await granted(asyncio.create_task(s.acquire_grant("m", soon())))
    assert p.trial
    free(s, trial)
    before = time.monotonic()
    s.failed(trial.slot)
    assert not p.trial and p.trips == 2
    assert p.open_until >= before + 0.1  # doubled: 0.1 s this time


async def test_scheduler_breaker_wakes_its_waiter_even_when_the_timer_fires_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # uvloop's timers run on a millisecond clock: the cooldown's timer may fire a hair before
    # `open_until` by time.monotonic(). Model it: the breaker reads a clock 5 ms ahead when it opens.
    monkeypatch.setattr(scheduler_module, "BREAKER_COOLDOWN_S", 0.05)
    skew = [0.0]
    monkeypatch.setattr(scheduler_module, "monotonic", lambda: time.monotonic() + skew[0])
    monkeypatch.setattr(admission_module, "monotonic", lambda: time.monotonic() + skew[0])
    monkeypatch.setattr(slots_module, "monotonic", lambda: time.monotonic() + skew[0])
    s = scheduler({"p": 1, "busy": 1}, {"m": ["p", "busy"]})
    p = s.providers["p"]
    await s.acquire_grant("m", soon(), frozenset({"p"}))  # busy throughout: the request waits for p
    for _ in range(scheduler_module.BREAKER_FAILURES - 1):
        free(s, await s.acquire_grant("m", soon(), frozenset({"busy"})))
        s.failed(p)
    free(s, await s.acquire_grant("m", soon(), frozenset({"busy"})))
    skew[0] = 0.005
    s.failed(p)  # opens until 5 ms past the moment its timer is due
    skew[0] = 0.0
    loop = asyncio.get_running_loop()
    waited = loop.time()
    assert (await s.acquire_grant("m", loop.time() + 1.0)).slot is p  # before: 503 queue_timeout after 1 s
    print(f"\nearly breaker timer: trial granted {1000 * (loop.time() - waited):.1f} ms after the wait began")


async def open_breaker(s: Scheduler, provider: str) -> None:
    p = s.providers[provider]
    others = frozenset(s.providers) - {provider}
    for _ in range(scheduler_module.BREAKER_FAILURES):
        free(s, await s.acquire_grant("m", soon(), others))
        s.failed(p)


async def test_scheduler_pool_with_every_breaker_open_refuses_at_once_with_retry_after() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    await open_breaker(s, "a")
    held = await s.acquire_grant("m", soon())  # b, the last usable one, is busy: a request waits for it
    waiter = asyncio.create_task(s.acquire_grant("m", soon()))
    await waiting(s, "m", 1)
    free(s, held)
    free(s, await granted(waiter))
    await open_breaker(s, "b")
    loop = asyncio.get_running_loop()
    asked = loop.time()
    with pytest.raises(Unavailable) as refused:
        await s.acquire_grant("m", asked + 30)  # before: waited the whole queue timeout
    print(f"\nevery breaker open: 503 after {1000 * (loop.time() - asked):.2f} ms")
    assert refused.value.code == "pool_unavailable" and refused.value.status == 503
    # a opened first: its half-open try comes first, within the 5 s cooldown.
    assert refused.value.headers == {"Retry-After": "5"}
    assert s.waiting("m") == 0


async def test_scheduler_waiters_are_told_when_the_last_usable_provider_opens_its_breaker() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    await open_breaker(s, "a")
    held = await s.acquire_grant("m", soon())
    assert held.slot.id == "b"
    waiters = [asyncio.create_task(s.acquire_grant("m", soon())) for _ in range(3)]
    await waiting(s, "m", 3)
    for _ in range(scheduler_module.BREAKER_FAILURES):
        s.failed(held.slot)  # b's breaker opens while it still runs one: its waiters cannot be served
    for w in waiters:
        with pytest.raises(Unavailable) as told:
            await asyncio.wait_for(w, 1)
        assert told.value.code == "pool_unavailable" and told.value.headers["Retry-After"] in {"4", "5"}
    free(s, held)
    assert s.waiting("m") == 0 and s.providers["b"].in_flight == 0


async def test_scheduler_pool_whose_nodes_are_gone_refuses_at_once_and_tells_its_waiters() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    held = [await s.acquire_grant("m", soon()), await s.acquire_grant("m", soon())]
    waiter = asyncio.create_task(s.acquire_grant("m", soon()))
    await waiting(s, "m", 1)
    s.set_connected("a", False)
    assert not waiter.done() or waiter.exception() is None  # b may still free a slot
    s.set_connected("b", False)
    with pytest.raises(Unavailable) as told:
        await asyncio.wait_for(waiter, 1)
    assert (told.value.code, told.value.headers) == ("pool_unavailable", {"Retry-After": "1"})
    loop = asyncio.get_running_loop()
    asked = loop.time()
    with pytest.raises(Unavailable) as refused:
        await s.acquire_grant("m", asked + 30)  # before: the 2.5 s connect grace, then 503 no_provider
    assert refused.value.code == "pool_unavailable" and loop.time() - asked < 0.1
    for slot in held:
        free(s, slot)
    s.set_connected("a", True)
    assert (await s.acquire_grant("m", soon())).slot.id == "a"


async def test_scheduler_refresh_drains_a_removed_provider() -> None:
    s = scheduler({"old": 1, "keep": 1}, {"m": ["old", "keep"]})
    running = await s.acquire_grant("m", soon(), frozenset({"keep"}))
    assert running.slot.id == "old"
    draining = s.apply({"keep": ("node-keep", 1), "new": ("node-new", 2)}, {"m": ["keep", "new"]})
    assert draining == ["old"]
    assert running.slot.removed and s.providers["old"] is running.slot  # still counted while it runs
    assert not running.slot.usable(time.monotonic())
    s.set_connected("new", True)
    assert (await s.acquire_grant("m", soon())).slot.id == "new"
    s.changed.clear()
    free(s, running)
    assert "old" not in s.providers and s.changed.is_set()


async def test_scheduler_refresh_fails_the_waiters_of_a_removed_pool() -> None:
    s = scheduler({"p": 1}, {"m": ["p"], "gone": ["p"]})
    held = await s.acquire_grant("m", soon())
    waiter = asyncio.create_task(s.acquire_grant("gone", soon()))
    await waiting(s, "gone", 1)
    s.apply({"p": ("node-p", 1)}, {"m": ["p"]})
    with pytest.raises(Unavailable) as removed:
        await waiter
    assert removed.value.code == "model_removed"
    free(s, held)
    assert s.providers["p"].in_flight == 0


async def test_scheduler_refresh_to_providers_not_yet_connected_lets_waiters_wait() -> None:
    s = scheduler({"old": 1}, {"m": ["old"]})
    held = await s.acquire_grant("m", soon())
    waiter = asyncio.create_task(s.acquire_grant("m", soon()))
    await waiting(s, "m", 1)
    s.apply({"new": ("node-new", 1)}, {"m": ["new"]})  # its node has not connected yet
    assert s.waiting("m") == 1 and not waiter.done()
    s.set_connected("new", True)
    assert (await granted(waiter)).slot.id == "new"
    free(s, held)


async def test_scheduler_refresh_hands_new_capacity_to_waiters() -> None:
    s = scheduler({"p": 1}, {"m": ["p"]})
    await s.acquire_grant("m", soon())
    waiter = asyncio.create_task(s.acquire_grant("m", soon()))
    await waiting(s, "m", 1)
    s.apply({"p": ("node-p", 2)}, {"m": ["p"]})
    assert (await granted(waiter)).slot.id == "p" and s.providers["p"].in_flight == 2


# --- the pool's index of free slots (best() never scans the pool) -------------------------------


async def test_scheduler_providers_with_equal_free_slots_take_turns() -> None:
    s = scheduler({f"p{i}": 1 for i in range(5)}, {"m": [f"p{i}" for i in range(5)]})
    picks = []
    for _ in range(10):
        grant = await s.acquire_grant("m", soon())
        picks.append(grant.slot.id)
        free(s, grant)
    assert picks == [f"p{i}" for i in range(5)] * 2  # c=1: every provider in turn, none twice running
    s = scheduler({"a": 2, "b": 2, "c": 2}, {"m": ["a", "b", "c"]})
    assert [(await s.acquire_grant("m", soon())).slot.id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert [s.providers[x].in_flight for x in "abc"] == [2, 2, 2]


async def test_scheduler_best_follows_a_provider_whose_state_changes_while_ranked() -> None:
    s = scheduler({"a": 3, "b": 2}, {"m": ["a", "b"]})
    pool = s.pools["m"]
    assert pool.best() is s.providers["a"]
    s.set_elsewhere("a", 3)  # other edges hold all of a: b is the only one with a free slot
    assert pool.best() is s.providers["b"]
    s.set_elsewhere("a", 0)
    assert pool.best() is s.providers["a"]
    s.set_connected("a", False)
    assert pool.best() is s.providers["b"]
    s.set_connected("a", True)
    s.set_drained("a", True)
    assert pool.best() is s.providers["b"]
    s.set_drained("a", False)
    s.apply({"a": ("node-a", 1), "b": ("node-b", 2)}, {"m": ["a", "b"]})  # a shrinks below b
    assert pool.best() is s.providers["b"]
    s.apply({"a": ("node-a", 1), "b": ("node-b", 2)}, {"m": ["a"]})  # b leaves the pool
    assert pool.best() is s.providers["a"]
    held = await s.acquire_grant("m", soon())
    assert pool.best() is None and held.slot.id == "a"
    free(s, held)
    assert pool.best() is s.providers["a"]


async def test_scheduler_best_matches_a_scan_of_the_pool_through_random_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The index against the linear scan it replaced, after every kind of change a provider goes
    # through: dispatch, release, other edges' counts, disconnect, drain, breakers opening,
    # half-opening with the clock and closing, capacities and members changed by a refresh.
    clock = [0.0]
    monkeypatch.setattr(scheduler_module, "monotonic", lambda: time.monotonic() + clock[0])
    monkeypatch.setattr(admission_module, "monotonic", lambda: time.monotonic() + clock[0])
    monkeypatch.setattr(slots_module, "monotonic", lambda: time.monotonic() + clock[0])
    rng = random.Random(19)
    ids = [f"p{i}" for i in range(12)]
    caps = {pid: rng.randint(1, 4) for pid in ids}
    s = scheduler(caps, {"m": ids}, max_waiting=1000)
    members = list(ids)
    held: list[Grant] = []
    checked = 0
    for step in range(3000):
        op = rng.randrange(9)
        p = s.providers[rng.choice(ids)]
        if op == 0 and held:
            grant = held.pop(rng.randrange(len(held)))
            free(s, grant)
            s.trial_over(grant.slot)
        elif op == 1:
            s.set_elsewhere(p.id, rng.randint(0, p.capacity))
        elif op == 2:
            s.set_connected(p.id, not p.connected)
        elif op == 3:
            s.set_drained(p.id, not p.drained)
        elif op == 4:
            s.failed(p)
        elif op == 5:
            s.succeeded(p)
        elif op == 6:
            clock[0] += rng.choice([0.0, 1.0, 6.0])
        elif op == 7 and step % 50 == 0:
            caps = {pid: rng.randint(1, 4) for pid in ids}
            members = rng.sample(ids, rng.randint(1, len(ids)))
            s.apply({pid: (f"node-{pid}", c) for pid, c in caps.items()}, {"m": members})
        exclude = frozenset(rng.sample(ids, rng.choice([0, 0, 1, 3])))
        now = time.monotonic() + clock[0]
        pool = s.pools["m"]
        scan = [q for q in pool.providers if q.usable(now) and q.id not in exclude]
        got = pool.best(exclude)
        if not scan:
            assert got is None, f"step {step}: {got} while no provider is usable"
            continue
        checked += 1
        assert got is not None and got in scan, f"step {step}: {got} is not usable"
        assert got.free == max(q.free for q in scan), f"step {step}: {got.id} has fewer free slots than the best"
        if op == 8 and not pool.waiters:
            grant = await s.acquire_grant("m", soon(), exclude)
            assert grant.slot.free >= 0 and grant.slot.id not in exclude
            held.append(grant)
    assert checked > 500  # the walk spent most of its time with something to choose


# --- the dispatch: a pool request's slot, released exactly once ---------------------------------


@dataclass
class Node:
    """The test's stand-in for nodes: what it receives, and how it answers each provider's work."""

    nc: NATS
    script: dict[str, Callable[[wire.WorkItem], list[object]]]
    items: list[tuple[str, wire.WorkItem]] = field(default_factory=list)
    """(provider, item) of every work item published, in order."""
    cancels: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_work(self, msg: Msg) -> None:
        provider = msg.subject.rsplit(".", 1)[1]
        item = wire.decode_work(msg.data)
        self.items.append((provider, item))
        self.changed.set()
        for reply in self.script[provider](item):
            await self.nc.publish(item.reply_to, wire.encode(reply))

    async def on_cancel(self, msg: Msg) -> None:
        self.cancels.append(wire.decode_cancel(msg.data).id)
        self.changed.set()


def answers(*chunks: bytes) -> Callable[[wire.WorkItem], list[object]]:
    def script(item: wire.WorkItem) -> list[object]:
        out: list[object] = [wire.Started(item.id, "n", "i")]
        out += [wire.Chunk(item.id, i, c) for i, c in enumerate(chunks)]
        return [*out, wire.Done(item.id, len(chunks))]

    return script


def fails(exc: RequestError, *, started: bool = True) -> Callable[[wire.WorkItem], list[object]]:
    def script(item: wire.WorkItem) -> list[object]:
        head: list[object] = [wire.Started(item.id, "n", "i")] if started else []
        return [*head, failure_of(exc, item.id, 0)]

    return script


def silent(item: wire.WorkItem) -> list[object]:
    # Starts and sends a first part, then never finishes (until cancelled or lost).
    return [wire.Started(item.id, "n", "i"), wire.Chunk(item.id, 0, b"part")]


@dataclass
class Rig:
    scheduler: Scheduler
    relay: Relay
    node: Node
    receiving: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when an answer's bytes reach the HTTP side (the node has started the item)."""

    def dispatch(self, alias: str = "m") -> PoolDispatch:
        loop = asyncio.get_running_loop()
        return PoolDispatch(self.scheduler, self.relay, alias, loop.time() + 5, Trace("req_test", "chat"))

    async def serve(self, dispatch: PoolDispatch, *, responded: bool = False) -> bytes:
        """Drive the dispatch's tries as the endpoint does; `responded`: the client has its answer's start."""
        if responded:
            dispatch.record.status = 200
        got: list[bytes] = []
        async for attempt in dispatch:
            async with attempt:
                await attempt.send(_item(self.relay, attempt.channel))
                parts = []
                async for data in attempt.replies():
                    parts.append(data)
                    self.receiving.set()
                got.extend(parts)  # only a whole answer counts (as the edge answers a non-streamed request)
        return b"".join(got)

    def in_flight(self) -> dict[str, int]:
        return {pid: p.in_flight for pid, p in self.scheduler.providers.items()}


def _item(relay: Relay, ch: Channel) -> wire.WorkItem:
    return wire.WorkItem(
        id=ch.id, api="chat", stream=False, alias="m", body=b"{}", reply_to=relay.reply_to(ch), deadline=time.time() + 5
    )


@asynccontextmanager
async def rig(
    nats_server: EmbeddedNats, providers: dict[str, int], script: dict[str, Callable[[wire.WorkItem], list[object]]]
) -> AsyncIterator[Rig]:
    nc = await connection.connect(nats_server.url, "test-dispatch", wait_s=5)
    try:
        js = nc.jetstream()
        await streams.ensure_work_stream(js, memory=True)
        relay = Relay(nc, js, "edge1")
        await relay.start()
        node = Node(nc, script)
        await nc.subscribe(wire.WORK_SUBJECTS, cb=node.on_work)
        await nc.subscribe("iop.node.*.cancel", cb=node.on_cancel)
        await connection.flush(nc)
        yield Rig(scheduler(providers, {"m": list(providers)}), relay, node)
    finally:
        await nc.close()


async def test_dispatch_success_releases_once_and_notes_the_try_in_the_record(nats_server: EmbeddedNats) -> None:
    async with rig(nats_server, {"p": 1}, {"p": answers(b"hel", b"lo")}) as r:
        dispatch = r.dispatch()
        assert await r.serve(dispatch) == b"hello"
        pool = r.scheduler.pools["m"]
        assert r.in_flight() == {"p": 0} and (pool.running, pool.peak_running) == (0, 1)
        rec = dispatch.record
        assert (rec.route, rec.provider, rec.node, rec.attempts) == ("pool", "p", "node-p", 1)
        assert isinstance(rec.report, wire.Done) and rec.queue_ms is not None and rec.queue_ms >= 0
        assert r.scheduler.providers["p"].failures == 0


async def test_dispatch_frees_the_slot_when_the_nodes_end_arrives_before_the_client_read_it(
    nats_server: EmbeddedNats,
) -> None:
    async with rig(nats_server, {"p": 1}, {"p": answers(b"hel", b"lo")}) as r:
        dispatch = r.dispatch()
        async for attempt in dispatch:
            async with attempt:
                await attempt.send(_item(r.relay, attempt.channel))
                ch = attempt.channel

                async def node_done(ch: Channel = ch) -> bool:
                    return ch.ended

                await eventually(node_done, timeout_s=5)
                # Nothing of the answer read yet: the node is done, so its slot is free already.
                assert r.in_flight() == {"p": 0} and r.scheduler.pools["m"].running == 0
                assert [data async for data in attempt.replies()] == [b"hel", b"lo"]
        assert r.in_flight() == {"p": 0} and dispatch.record.attempts == 1


async def test_dispatch_failure_of_the_request_releases_once_without_failover(nats_server: EmbeddedNats) -> None:
    script = {"a": fails(BadRequest("no", code="upstream_bad_request")), "b": answers(b"x")}
    async with rig(nats_server, {"a": 1, "b": 1}, script) as r:
        dispatch = r.dispatch()
        with pytest.raises(BadRequest):
            await r.serve(dispatch)
        assert r.in_flight() == {"a": 0, "b": 0} and len(r.node.items) == 1
        assert r.scheduler.providers["a"].failures == 0  # the request's fault, not the provider's
        assert (dispatch.record.attempts, dispatch.record.provider) == (1, "a")


async def test_dispatch_a_4xx_from_a_node_neither_fails_over_nor_counts_against_the_provider(
    nats_server: EmbeddedNats,
) -> None:
    # An upstream's 422 comes back as an UpstreamError (retryable as a class) carrying status 422.
    refused = UpstreamError("upstream: unprocessable", code="upstream_error", status=422)
    script = {"a": fails(refused), "b": answers(b"x")}
    async with rig(nats_server, {"a": 2, "b": 1}, script) as r:
        for _ in range(scheduler_module.BREAKER_FAILURES):
            with pytest.raises(UpstreamError) as got:
                await r.serve(r.dispatch())
            assert got.value.status == 422
        assert [p for p, _ in r.node.items] == ["a"] * scheduler_module.BREAKER_FAILURES  # no failover
        a = r.scheduler.providers["a"]
        assert (a.failures, a.breaker(time.monotonic())) == (0, "closed")


async def test_dispatch_fails_over_and_releases_every_slot_once(nats_server: EmbeddedNats) -> None:
    script = {"a": fails(UpstreamError("down", code="upstream_unavailable")), "b": answers(b"ok")}
    async with rig(nats_server, {"a": 2, "b": 1}, script) as r:
        # a has the most free slots, so it is tried first; it fails, and b answers.
        dispatch = r.dispatch()
        assert await r.serve(dispatch) == b"ok"
        assert [p for p, _ in r.node.items] == ["a", "b"]
        assert r.in_flight() == {"a": 0, "b": 0} and r.scheduler.pools["m"].running == 0
        assert r.scheduler.providers["a"].failures == 1
        assert (dispatch.record.attempts, dispatch.record.provider) == (2, "b")


async def test_dispatch_does_not_fail_over_once_the_client_saw_bytes(nats_server: EmbeddedNats) -> None:
    script = {"a": fails(UpstreamError("down")), "b": answers(b"ok")}
    async with rig(nats_server, {"a": 2, "b": 1}, script) as r:
        with pytest.raises(UpstreamError):
            await r.serve(r.dispatch(), responded=True)
        assert len(r.node.items) == 1 and r.in_flight() == {"a": 0, "b": 0}


async def test_dispatch_gives_up_after_every_provider_failed(nats_server: EmbeddedNats) -> None:
    script = {p: fails(UpstreamError(f"{p} down"), started=False) for p in ("a", "b", "c", "d")}
    async with rig(nats_server, dict.fromkeys(script, 1), script) as r:
        dispatch = r.dispatch()
        with pytest.raises(UpstreamError):
            await r.serve(dispatch)
        assert len(r.node.items) == 3  # the first try and two more
        assert r.in_flight() == dict.fromkeys(script, 0)
        assert dispatch.record.attempts == 3


async def test_dispatch_cancelled_by_the_client_releases_once_and_cancels_the_node(nats_server: EmbeddedNats) -> None:
    async with rig(nats_server, {"p": 1}, {"p": silent}) as r:
        pool = r.scheduler.pools["m"]
        dispatch = r.dispatch()
        task = asyncio.create_task(r.serve(dispatch))
        await asyncio.wait_for(r.receiving.wait(), 5)
        assert pool.running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert r.in_flight() == {"p": 0} and pool.running == 0
        [(_, item)] = r.node.items
        async with asyncio.timeout(5):
            while item.id not in r.node.cancels:
                r.node.changed.clear()
                await r.node.changed.wait()
        assert dispatch.record.attempts == 1 and r.scheduler.providers["p"].failures == 0


async def test_dispatch_cancelled_while_queued_takes_no_slot(nats_server: EmbeddedNats) -> None:
    async with rig(nats_server, {"p": 1}, {"p": silent}) as r:
        held = await r.scheduler.acquire_grant("m", soon())
        dispatch = r.dispatch()
        task = asyncio.create_task(r.serve(dispatch))
        await waiting(r.scheduler, "m", 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert r.in_flight() == {"p": 1} and r.scheduler.waiting("m") == 0 and not r.node.items
        free(r.scheduler, held)
        assert r.in_flight() == {"p": 0}
        assert dispatch.record.attempts == 0


async def test_dispatch_client_leaving_during_the_publish_leaves_no_work_behind(nats_server: EmbeddedNats) -> None:
    # The stream has stored the work but the edge has not read the publish's ack (so it does not
    # know the message's sequence) when the client leaves, and no node has fetched it yet. Before:
    # the message stayed in the stream, and the node that fetched it later ran it for nobody until
    # its next probe (2-3 s).
    async with rig(nats_server, {"p": 1}, {"p": lambda item: []}) as r:
        stored = asyncio.Event()
        late: list[tuple[asyncio.Future[Any], Any]] = []
        loop = asyncio.get_running_loop()

        class AckOnItsWay(dict[str, "asyncio.Future[Any]"]):
            """The relay's pending publish acks: the one that arrives is held back, still "on its way"."""

            def pop(self, key: str, default: Any = None) -> Any:
                waiting = super().pop(key, default)
                if waiting is None:
                    return None
                stored.set()  # JetStream acked: the work is in the stream
                decoy: asyncio.Future[Any] = loop.create_future()
                decoy.add_done_callback(lambda d: late.append((waiting, d.result())))
                return decoy

        r.relay.publish._acks = AckOnItsWay()
        task = asyncio.create_task(r.serve(r.dispatch()))
        await asyncio.wait_for(stored.wait(), 5)
        assert await stream_messages(r.relay.publish.js) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert r.in_flight() == {"p": 0}
        for waiting, msg in late:  # the ack arrives after all
            waiting.set_result(msg)

        async def withdrawn() -> bool:
            return await stream_messages(r.relay.publish.js) == 0

        waited_s = await eventually(withdrawn, timeout_s=5)
        print(f"\nclient left during the publish: work withdrawn from the stream {1000 * waited_s:.1f} ms later")
        [(_, item)] = r.node.items
        await until(lambda: item.id in r.node.cancels, r.node.changed, 5)  # the Cancel may still be on its way


async def test_relay_cancels_work_a_node_starts_for_a_request_it_no_longer_knows(nats_server: EmbeddedNats) -> None:
    # The last door: a node that fetched the work before the edge could withdraw it says Started
    # for a request the edge has forgotten. Before: the edge dropped that reply and the node ran
    # the work until its next probe.
    async with rig(nats_server, {"p": 1}, {"p": silent}) as r:
        ch = r.relay.open("node-p")
        r.relay.close(ch)
        await r.node.nc.publish(r.relay.reply_to(ch), wire.encode(wire.Started(ch.id, "node-p", "i")))
        await until(lambda: r.node.cancels.count(ch.id) >= 2, r.node.changed, timeout_s=5)


async def test_dispatch_node_lost_releases_once_then_fails_over(nats_server: EmbeddedNats) -> None:
    async with rig(nats_server, {"a": 2, "b": 1}, {"a": silent, "b": answers(b"ok")}) as r:
        dispatch = r.dispatch()
        task = asyncio.create_task(r.serve(dispatch))
        await asyncio.wait_for(r.receiving.wait(), 5)
        assert r.scheduler.pools["m"].running == 1
        r.relay.node_lost("node-a", "test")
        assert r.in_flight()["a"] == 0  # freed the moment the node is known lost
        assert await task == b"ok"
        assert r.in_flight() == {"a": 0, "b": 0} and dispatch.record.attempts == 2


async def test_direct_dispatch_tries_once_and_notes_the_route(nats_server: EmbeddedNats) -> None:
    async with rig(nats_server, {"p": 1}, {}) as r:

        async def cli(msg: Msg) -> None:
            item = wire.decode_work(msg.data)
            await r.node.nc.publish(msg.reply, wire.encode(wire.Accepted(item.id)))
            for reply in answers(b"hi")(item):
                await r.node.nc.publish(item.reply_to, wire.encode(reply))

        await r.node.nc.subscribe(wire.cli_subject("n1", "agent"), cb=cli)
        await connection.flush(r.node.nc)
        dispatch = DirectDispatch(r.relay, "agent", "n1", "agent", Trace("req_test", "chat"))
        got: list[bytes] = []
        async for attempt in dispatch:
            async with attempt:
                await attempt.send(_item(r.relay, attempt.channel))
                got.extend([data async for data in attempt.replies()])
        assert got == [b"hi"] and not r.relay.channels
        rec = dispatch.record
        assert (rec.route, rec.node, rec.provider, rec.attempts) == ("direct", "n1", "agent", 1)


# --- errors across the wire -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        NodeLost("gone"),
        UpstreamError("down", code="upstream_timeout"),
        BadRequest("upstream: bad", code="upstream_bad_request", status=413),
        Unavailable("late", code="queue_timeout"),
    ],
)
def test_errors_keep_their_class_across_the_wire(exc: RequestError) -> None:
    reply = wire.decode_reply(wire.encode(failure_of(exc, "r1", 3)))
    assert isinstance(reply, wire.Failure) and reply.kind == type(exc).__name__
    back = error_of(reply)
    assert type(back) is type(exc)
    assert (back.status, back.code, back.message, back.retryable) == (exc.status, exc.code, exc.message, exc.retryable)


def test_errors_from_an_older_node_fall_back_to_the_status() -> None:
    old = wire.Failure("r1", 0, 429, "upstream_rate_limited", "slow down")  # no `kind`
    reply = wire.decode_reply(wire.encode(old))
    assert isinstance(reply, wire.Failure)
    back = error_of(reply)
    assert type(back) is QueueFull and not back.retryable


def test_errors_every_class_a_failure_may_name_is_rebuilt_as_itself() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, RequestError)]
    for cls in classes:
        if cls is errors.InvalidConfig:
            continue  # the edge's own answer to /admin/refresh; no node raises it
        failure = failure_of(cls("m"), "r1", 0)
        assert failure.kind == cls.__name__
        assert type(error_of(failure)) is cls


def cooled(monkeypatch: pytest.MonkeyPatch, p: ProviderSlots) -> None:
    """Move the scheduler's clock past `p`'s breaker cooldown: its trial may go now."""
    ahead = p.open_until - time.monotonic() + 0.001
    monkeypatch.setattr(scheduler_module, "monotonic", lambda: time.monotonic() + ahead)
    monkeypatch.setattr(admission_module, "monotonic", lambda: time.monotonic() + ahead)
    monkeypatch.setattr(slots_module, "monotonic", lambda: time.monotonic() + ahead)


async def test_dispatch_a_half_open_trial_refused_as_a_4xx_lets_the_next_trial_go(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler_module, "BREAKER_COOLDOWN_S", 0.05)
    refused = UpstreamError("upstream: prompt too long", code="upstream_error", status=400)
    async with rig(nats_server, {"p": 1}, {"p": fails(refused)}) as r:
        p = r.scheduler.providers["p"]
        for _ in range(scheduler_module.BREAKER_FAILURES):
            free(r.scheduler, await r.scheduler.acquire_grant("m", soon()))
            r.scheduler.failed(p)
        cooled(monkeypatch, p)
        # The trial is refused as the request's own fault.
        with pytest.raises(UpstreamError):
            await r.serve(r.dispatch())
        assert not p.trial and p.in_flight == 0
        # The provider is not lost to the pool: the next request gets the next trial at once.
        with pytest.raises(UpstreamError):
            await r.serve(r.dispatch())
        assert len(r.node.items) == 2


async def test_scheduler_a_trial_whose_client_left_lets_the_next_trial_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_module, "BREAKER_COOLDOWN_S", 0.05)
    s = scheduler({"p": 1}, {"m": ["p"]})
    p = s.providers["p"]
    for _ in range(scheduler_module.BREAKER_FAILURES):
        free(s, await s.acquire_grant("m", soon()))
        s.failed(p)
    cooled(monkeypatch, p)
    trial = await granted(asyncio.create_task(s.acquire_grant("m", soon())))
    assert p.trial
    s.trial_over(trial.slot)  # what PoolDispatch does when the client leaves mid-trial
    free(s, trial)
    assert (await granted(asyncio.create_task(s.acquire_grant("m", soon())))).slot is p


async def test_dispatch_alias_removed_between_grant_and_dispatch_gives_the_slot_back(
    nats_server: EmbeddedNats,
) -> None:
    async with rig(nats_server, {"p": 1, "q": 1}, {"p": answers(b"x"), "q": answers(b"x")}) as r:
        held = await r.scheduler.acquire_grant("m", soon())  # one slot busy, so the request below waits
        other = "q" if held.slot.id == "p" else "p"
        held_too = await r.scheduler.acquire_grant("m", soon(), frozenset({held.slot.id}))
        assert held_too.slot.id == other
        task = asyncio.create_task(r.serve(r.dispatch()))
        await waiting(r.scheduler, "m", 1)
        free(r.scheduler, held)  # granted to the waiter ...
        r.scheduler.apply({"p": ("node-p", 1), "q": ("node-q", 1)}, {})  # ... and the alias goes before it runs
        with pytest.raises(Unavailable) as got:
            await task
        assert got.value.code == "model_removed"
        free(r.scheduler, held_too)
        assert r.in_flight() == {"p": 0, "q": 0}


async def test_dispatch_holds_a_tenant_to_max_concurrent_and_gives_its_share_back_on_cancel(
    nats_server: EmbeddedNats,
) -> None:
    alice = Tenant("alice", TenantPolicy(max_concurrent=1))
    async with rig(nats_server, {"p": 3}, {"p": silent}) as r:
        loop = asyncio.get_running_loop()

        def dispatch(tenant: Tenant) -> PoolDispatch:
            return PoolDispatch(r.scheduler, r.relay, "m", loop.time() + 5, Trace("req_t", "chat"), tenant=tenant)

        first = asyncio.create_task(r.serve(dispatch(alice)))
        await until(lambda: len(r.node.items) == 1, r.node.changed)
        second = asyncio.create_task(r.serve(dispatch(alice)))
        await waiting(r.scheduler, "m", 1)  # two slots free, but alice has her one
        other = asyncio.create_task(r.serve(dispatch(Tenant("bob", TenantPolicy()))))
        await until(lambda: len(r.node.items) == 2, r.node.changed)  # bob is not behind her
        assert r.in_flight() == {"p": 2} and r.scheduler.waiting("m") == 1
        first.cancel()  # alice's client leaves: her share goes to her waiting request
        await until(lambda: len(r.node.items) == 3, r.node.changed)
        loads = {t: (w, n) for t, _, w, n in r.scheduler.pools["m"].waiters.loads()}
        assert loads == {"alice": (0, 1), "bob": (0, 1)}
        for t in (second, other):
            t.cancel()
        await asyncio.gather(first, second, other, return_exceptions=True)
        assert r.in_flight() == {"p": 0} and r.scheduler.pools["m"].waiters.tenants == {}
