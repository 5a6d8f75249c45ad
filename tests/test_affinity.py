"""Prefix-cache affinity: a session's next request prefers the provider that served it last.

The scheduler's part runs on the event loop alone (as in test_scheduler.py); the end-to-end part
runs an edge and two nodes with mock providers over a real nats-server.
"""

from __future__ import annotations

import asyncio

from iop.edge.affinity import Sessions
from iop.edge.ledger import RequestRecord
from iop.edge.usage_query import follow
from iop.nats.server import EmbeddedNats
from tests.harness import deployment, deployment_running, until
from tests.test_scheduler import free, granted, scheduler, soon, waiting

# --- the scheduler: prefer when free, wait no longer than asked, FIFO kept --------------------------


async def test_affinity_takes_the_preferred_provider_when_it_has_a_free_slot() -> None:
    s = scheduler({"a": 4, "b": 4}, {"m": ["a", "b"]})
    first = await s.acquire_grant("m", soon(), prefer="a")
    # Without a preference b (4 free) beats a (3 free); the session's provider wins while it is free.
    picks = [(await s.acquire_grant("m", soon(), prefer="a")).slot.id for _ in range(3)]
    assert (first.slot.id, picks) == ("a", ["a", "a", "a"])
    assert (await s.acquire_grant("m", soon())).slot.id == "b"


async def test_affinity_without_a_wait_goes_elsewhere_at_once_when_the_preferred_is_busy() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    held = await s.acquire_grant("m", soon(), prefer="a")
    assert held.slot.id == "a"
    other = await s.acquire_grant("m", soon(), prefer="a")  # affinity_wait_ms 0: never waits for a
    assert (other.slot.id, s.waiting("m")) == ("b", 0)


async def test_affinity_waits_for_the_preferred_provider_within_its_wait() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    held = await s.acquire_grant("m", soon(), prefer="a")
    task = asyncio.create_task(s.acquire_grant("m", soon(), prefer="a", prefer_wait_s=30.0))
    await waiting(s, "m", 1)
    assert s.providers["b"].in_flight == 0  # b is free, yet the request holds out for a
    free(s, held)
    assert (await granted(task)).slot.id == "a"


async def test_affinity_never_waits_longer_than_its_wait() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    await s.acquire_grant("m", soon(), prefer="a")
    loop = asyncio.get_running_loop()
    began = loop.time()
    task = asyncio.create_task(s.acquire_grant("m", soon(), prefer="a", prefer_wait_s=0.05))
    await waiting(s, "m", 1)
    # a never frees: once the wait is over, the free provider takes it (well before the deadline).
    assert (await granted(task)).slot.id == "b"
    assert loop.time() - began < 4.0


async def test_affinity_a_waiter_holding_out_does_not_block_the_requests_behind_it() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    held = await s.acquire_grant("m", soon(), prefer="a")
    holder = asyncio.create_task(s.acquire_grant("m", soon(), prefer="a", prefer_wait_s=30.0))
    await waiting(s, "m", 1)
    behind = await asyncio.wait_for(s.acquire_grant("m", soon()), 5)  # b is free: taken now, not after the hold
    assert behind.slot.id == "b"
    free(s, held)
    assert (await granted(holder)).slot.id == "a"


async def test_affinity_keeps_fifo_a_preference_never_jumps_the_queue() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    held_a = await s.acquire_grant("m", soon())
    held_b = await s.acquire_grant("m", soon())
    older = asyncio.create_task(s.acquire_grant("m", soon()))
    await waiting(s, "m", 1)
    younger = asyncio.create_task(s.acquire_grant("m", soon(), prefer=held_a.slot.id))
    await waiting(s, "m", 2)
    free(s, held_a)  # the younger request's preferred provider frees: the older request takes it
    assert (await granted(older)).slot.id == held_a.slot.id
    assert not younger.done()
    free(s, held_b)
    assert (await granted(younger)).slot.id == held_b.slot.id


def test_affinity_sessions_are_a_bounded_lru_and_count_hits_per_pool() -> None:
    sessions = Sessions(max_sessions=2)
    assert sessions.preferred("m", "s1") is None
    assert sessions.served("m", "s1", "a", None) is False  # a new session: neither hit nor miss
    sessions.served("m", "s2", "b", None)
    assert sessions.preferred("m", "s1") == "a"  # s1 is now the most recently used
    sessions.served("m", "s3", "a", None)  # evicts s2, the least recently used
    assert (sessions.preferred("m", "s2"), sessions.preferred("m", "s1"), len(sessions)) == (None, "a", 2)
    assert sessions.served("m", "s1", "a", "a") is True
    assert sessions.served("m", "s1", "b", "a") is False
    assert sessions.preferred("other", "s1") is None  # sessions are per pool
    counts = sessions.counts["m"]
    assert (counts.hits, counts.misses) == (1, 1)


# --- end to end: edge + nodes --------------------------------------------------------------------

POOL_YAML = """
models:
  - alias: m
    pool: [p1, p2, p3]
nodes:
  - id: n1
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 2, token_interval_ms: 0}]
    providers: [{id: p1, adapter: sim, capacity: 2}]
  - id: n2
    adapters: [{id: sim, type: mock, latency_ms: 0, tokens: 2, token_interval_ms: 0}]
    providers: [{id: p2, adapter: sim, capacity: 4}, {id: p3, adapter: sim, capacity: 4}]
"""


async def test_affinity_end_to_end_a_session_stays_on_its_provider(nats_server: EmbeddedNats) -> None:
    async with deployment_running(deployment(POOL_YAML), nats_server.url) as h:
        # What each request became is read where operators read it: its ledger record.
        results: list[RequestRecord] = []
        written = asyncio.Event()

        def sink(records: list[RequestRecord]) -> None:
            results.extend(records)
            written.set()

        sub = await follow(h.edge.js, "m", sink)
        msg = [{"role": "user", "content": "x"}]
        async with h.http() as http:

            async def provider(body: dict[str, object], headers: dict[str, str] | None = None) -> str:
                r = await http.post("/v1/chat/completions", json={"model": "m", **body}, headers=headers)
                assert r.status_code == 200, r.text
                return r.headers["x-iop-provider"]

            # Without a session key, one request at a time spreads over the pool (ties rotate).
            anonymous = {await provider({"messages": msg}) for _ in range(6)}
            assert len(anonymous) > 1
            by_key = {await provider({"messages": msg, "prompt_cache_key": "k1"}) for _ in range(6)}
            by_header = {await provider({"messages": msg}, {"session-id": "k2"}) for _ in range(6)}
            by_x_header = {await provider({"messages": msg}, {"x-session-id": "k3"}) for _ in range(6)}
            by_user = {await provider({"messages": msg, "user": "k4"}) for _ in range(6)}
            assert [len(s) for s in (by_key, by_header, by_x_header, by_user)] == [1, 1, 1, 1]
            r = await http.post("/v1/responses", json={"model": "m", "input": "x", "prompt_cache_key": "k1"})
            assert r.status_code == 200 and r.headers["x-iop-provider"] in by_key
        await until(lambda: len(results) >= 31, written)  # 6 anonymous, 4 x 6 with a session, 1 responses
        await sub.unsubscribe()
        # 4 sessions x 5 turns after their first, plus the responses turn of k1.
        assert len(results) == 31 and sum(r.affinity for r in results) == 21
        pool = (await h.status()).pool("m")
        assert pool is not None and (pool.affinity_hits, pool.affinity_misses) == (21, 0)
