"""Standby (edge.queue.standby): with every slot of a provider busy, the next request waits in the broker.

The scheduler's side needs no NATS (its tests run on the loop alone); the broker's side runs on a
real nats-server: a standby item is published while the provider is full, stays undelivered while
`max_ack_pending` is reached, and the node's next pull takes it the moment an ack frees a slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from nats.aio.msg import Msg

from iop import wire
from iop.edge.fairshare import loads
from iop.edge.routing import Figures
from iop.edge.scheduler import Scheduler
from iop.edge.share import SlotShare
from iop.nats import connection, streams
from iop.nats.server import EmbeddedNats
from tests.fakes import FakeUpstream, fake_upstream
from tests.harness import EdgeHandle, broker_counts, deployment, deployment_running, eventually, until
from tests.test_scheduler import scheduler as connected_scheduler


def scheduler(providers: dict[str, int], pools: dict[str, list[str]], standby: int = 1) -> Scheduler:
    return connected_scheduler(providers, pools, standby=standby)


def soon() -> float:
    return asyncio.get_running_loop().time() + 5.0


async def settled(task: asyncio.Task[Any]) -> bool:
    """Whether `task` has its grant once the loop has run everything ready."""
    for _ in range(5):
        await asyncio.sleep(0)  # yield to the loop, not a timed wait
    return task.done()


async def test_a_full_provider_takes_one_more_request_in_standby() -> None:
    s = scheduler({"p": 2}, {"m": ["p"]})
    running = [await s.acquire_grant("m", soon()) for _ in range(2)]
    assert not any(g.standby for g in running)
    third = asyncio.create_task(s.acquire_grant("m", soon()))
    fourth = asyncio.create_task(s.acquire_grant("m", soon()))
    assert await settled(third) and not await settled(fourth)
    g3 = third.result()
    assert g3.standby and g3.slot.id == "p"
    assert (s.providers["p"].in_flight, s.waiting("m"), len(s.pools["m"].waiters)) == (3, 2, 1)
    s.release(running[0].slot, running[0])  # a slot frees: the standby runs, the next one stands by
    g4 = await asyncio.wait_for(fourth, 5)
    assert g4.standby and s.providers["p"].in_flight == 3


async def test_without_standby_the_request_waits_for_a_free_slot() -> None:
    s = scheduler({"p": 2}, {"m": ["p"]}, standby=0)
    running = [await s.acquire_grant("m", soon()) for _ in range(2)]
    third = asyncio.create_task(s.acquire_grant("m", soon()))
    assert not await settled(third)
    s.release(running[0].slot, running[0])
    g3 = await asyncio.wait_for(third, 5)
    assert not g3.standby and s.providers["p"].in_flight == 2


async def test_standby_goes_to_the_provider_that_turns_over_first_never_a_much_slower_one() -> None:
    s = scheduler({"fast": 2, "slow": 2}, {"m": ["fast", "slow"]})
    s.router.figures["fast"] = Figures(held_s=0.2)  # a slot frees every 0.1 s
    s.router.figures["slow"] = Figures(held_s=2.0)  # every 1 s: 10x the fast one's turn
    running = [await s.acquire_grant("m", soon()) for _ in range(4)]
    assert sorted(g.slot.id for g in running) == ["fast", "fast", "slow", "slow"]
    standby = asyncio.create_task(s.acquire_grant("m", soon()))
    later = asyncio.create_task(s.acquire_grant("m", soon()))
    assert await settled(standby) and standby.result().slot.id == "fast"
    assert not await settled(later)  # the slow provider takes none: the request stays late-bound
    slow = next(g for g in running if g.slot.id == "slow")
    s.release(slow.slot, slow)  # the slow one frees first after all: the late-bound request takes it
    g = await asyncio.wait_for(later, 5)
    assert (g.slot.id, g.standby) == ("slow", False)


async def test_standby_waits_until_every_full_provider_can_have_its_own() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    running = [await s.acquire_grant("m", soon()) for _ in range(2)]
    one = asyncio.create_task(s.acquire_grant("m", soon()))
    # One waiting, two full providers: it stays late-bound, whichever frees first takes it.
    assert not await settled(one)
    two = asyncio.create_task(s.acquire_grant("m", soon()))
    assert await settled(one) and await settled(two)
    assert sorted(t.result().slot.id for t in (one, two)) == ["a", "b"]
    assert all(t.result().standby for t in (one, two))
    assert [s.providers[p].in_flight for p in ("a", "b")] == [2, 2] and running


async def test_beside_another_active_tenant_only_a_tenant_with_nothing_running_stands_by() -> None:
    s = scheduler({"p": 2}, {"m": ["p"]})
    g1, g2 = [await s.acquire_grant("m", soon(), tenant="flood") for _ in range(2)]
    g3 = await s.acquire_grant("m", soon(), tenant="flood")
    assert g3.standby  # the pool's only tenant: its backlog stands by
    quiet = asyncio.create_task(s.acquire_grant("m", soon(), tenant="quiet"))
    flood = asyncio.create_task(s.acquire_grant("m", soon(), tenant="flood"))
    assert not await settled(quiet)  # no room: the standby place is taken
    s.release(g1.slot, g1)
    s.started(g3)  # the standby took the freed slot; the place is free again, quiet's turn first
    assert await settled(quiet) and quiet.result().standby
    s.release(g2.slot, g2)
    # Room again, but flood has a request here and quiet is active: flood's next is bound late, so
    # it cannot sit in the broker ahead of a request quiet sends meanwhile.
    assert not await settled(flood)
    assert s.providers["p"].in_flight == 2 and s.pools["m"].standing == 1
    flood.cancel()


async def test_a_tenant_another_edge_announces_keeps_this_edges_busy_tenant_from_standing_by() -> None:
    s = scheduler({"p": 1}, {"m": ["p"]})
    share = SlotShare(s, "edge-a")
    held = await s.acquire_grant("m", soon(), tenant="flood")
    # Edge B says its tenant `quiet` has a request standing by there (running, none in B's queue).
    other = wire.EdgeSlots("edge-b", True, {}, {"m": [("quiet", 1, 1.0, 0, 1)]})
    await share._on_slots(Msg(None, subject=wire.EDGE_SLOTS_SUBJECT, data=wire.encode(other)))  # type: ignore[arg-type]
    flood = asyncio.create_task(s.acquire_grant("m", soon(), tenant="flood"))
    assert not await settled(flood)  # bound late: it must not sit in the broker ahead of quiet's next
    s.release(held.slot, held)
    assert (await asyncio.wait_for(flood, 5)).standby is False
    # A tenant with nothing running here still stands by; with none in this edge's queue, the edge
    # still announces its tenants while one stands by (the other edges keep clear of them).
    standing = asyncio.create_task(s.acquire_grant("m", soon(), tenant="quiet"))
    assert await settled(standing) and standing.result().standby and not s.pools["m"].waiters
    assert sorted(loads(s.pools["m"])) == [("flood", 1, 1.0, 0, 1), ("quiet", 1, 1.0, 0, 1)]


async def test_standby_counts_the_slots_other_edges_hold() -> None:
    s = scheduler({"p": 2}, {"m": ["p"]})
    s.set_elsewhere("p", 2)  # another edge holds both slots (and may hold the standby place too)
    first = asyncio.create_task(s.acquire_grant("m", soon()))
    assert await settled(first) and first.result().standby
    second = asyncio.create_task(s.acquire_grant("m", soon()))
    assert not await settled(second)
    s.set_elsewhere("p", 3)  # the other edge's standby too: more than capacity + standby is never asked
    assert not await settled(second)
    second.cancel()


async def test_a_pinned_request_never_stands_by() -> None:
    s = scheduler({"p": 1}, {"m": ["p"]})
    held = await s.acquire_grant("m", soon())
    pinned = asyncio.create_task(s.acquire_pinned("p", soon()))
    assert not await settled(pinned)
    s.release(held.slot, held)
    assert (await asyncio.wait_for(pinned, 5)).id == "p"


async def test_a_request_holding_out_for_its_session_stands_by_only_there() -> None:
    s = scheduler({"a": 1, "b": 1}, {"m": ["a", "b"]})
    ga = await s.acquire_grant("m", soon())
    gb = await s.acquire_grant("m", soon())
    assert {ga.slot.id, gb.slot.id} == {"a", "b"}
    s.set_elsewhere("b", 1)  # b's standby place is another edge's
    held_out = asyncio.create_task(s.acquire_grant("m", soon(), prefer="b", prefer_wait_s=5.0))
    assert not await settled(held_out)
    other = asyncio.create_task(s.acquire_grant("m", soon()))
    assert await settled(other) and other.result().slot.id == "a" and other.result().standby
    s.set_elsewhere("b", 0)
    g = await asyncio.wait_for(held_out, 5)
    assert (g.slot.id, g.standby) == ("b", True)


async def test_the_broker_holds_a_standby_item_until_an_ack_frees_a_slot(nats_server: EmbeddedNats) -> None:
    """What standby relies on: with max_ack_pending reached a published item is not delivered, and
    the pull waiting for it receives it when an earlier one is acked."""
    nc = await connection.connect(nats_server.url, "standby-test")
    try:
        js = nc.jetstream()
        await streams.ensure_work_stream(js)
        await streams.ensure_provider_consumer(js, "p", 1)
        psub = await js.pull_subscribe_bind(durable=wire.consumer_name("p"), stream=wire.WORK_STREAM)
        await js.publish(wire.work_subject("p"), b"first")
        await js.publish(wire.work_subject("p"), b"standby")
        (first,) = await psub.fetch(1, timeout=5)
        assert first.data == b"first"
        waiting_pull = asyncio.create_task(psub.fetch(1, timeout=5))
        done, _ = await asyncio.wait({waiting_pull}, timeout=0.5)  # a bound on a wait that must not end
        assert not done  # max_ack_pending 1 is reached: the standby item stays in the stream
        await first.ack()
        (standby,) = await asyncio.wait_for(waiting_pull, 5)
        assert standby.data == b"standby"
    finally:
        await nc.close()


ONE_SLOT = """
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: up, type: openai, base_url: "{url}", api: both}}]
    providers: [{{id: p, adapter: up, capacity: 1}}]
"""


def ask(content: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


@asynccontextmanager
async def one_slot_held(
    url: str,
) -> AsyncIterator[tuple[EdgeHandle, httpx.AsyncClient, FakeUpstream, asyncio.Task[Any]]]:
    """A provider of capacity 1 on a gated upstream, its slot held by a first request."""
    async with (
        fake_upstream(gate=asyncio.Event()) as up,
        deployment_running(deployment(ONE_SLOT.format(url=up.url)), url) as h,
        h.http() as http,
    ):
        first = asyncio.create_task(http.post("/v1/chat/completions", json=ask("first")))
        await up.wait_for(lambda u: u.in_flight == 1)
        yield h, http, up, first


async def test_a_standby_request_waits_in_the_broker_and_runs_when_the_slot_frees(nats_server: EmbeddedNats) -> None:
    async with one_slot_held(nats_server.url) as (h, http, up, first):
        sched = h.edge.scheduler
        second = asyncio.create_task(http.post("/v1/chat/completions", json=ask("second")))
        third = asyncio.create_task(http.post("/v1/chat/completions", json=ask("third")))
        await until(lambda: sched.waiting("m") == 2, sched.changed)
        # One stands by in the broker (published, undelivered: the consumer's one slot is taken),
        # one waits in the edge's queue; the provider never runs more than its capacity.
        assert len(sched.pools["m"].waiters) == 1 and sched.providers["p"].in_flight == 2
        await eventually(lambda: _is(broker_counts(h.edge.js, "p"), (1, 1)))
        (pool,) = (await h.status()).pools
        assert (pool.waiting, pool.running) == (2, 1)
        assert up.gate is not None
        up.gate.set()
        answers = await asyncio.gather(first, second, third)
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert up.peak == 1
        assert [b["messages"][0]["content"] for b in up.bodies] == ["first", "second", "third"]
        assert sched.waiting("m") == 0 and sched.pools["m"].standing == 0


async def test_a_client_that_leaves_while_its_request_stands_by_takes_it_out_of_the_broker(
    nats_server: EmbeddedNats,
) -> None:
    async with one_slot_held(nats_server.url) as (h, http, up, first):
        sched = h.edge.scheduler
        gone = asyncio.create_task(http.post("/v1/chat/completions", json=ask("gone")))
        await eventually(lambda: _is(broker_counts(h.edge.js, "p"), (1, 1)))
        gone.cancel()  # the client leaves: its request is deleted from the stream, unrun
        await eventually(lambda: _is(broker_counts(h.edge.js, "p"), (1, 0)))
        await until(lambda: sched.providers["p"].in_flight == 1 and sched.waiting("m") == 0, sched.changed)
        assert up.gate is not None
        up.gate.set()
        assert (await first).status_code == 200
        after = await http.post("/v1/chat/completions", json=ask("after"))
        assert after.status_code == 200
        assert [b["messages"][0]["content"] for b in up.bodies] == ["first", "after"]


async def _is(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


async def test_a_request_standing_by_past_the_queue_timeout_fails_unrun(nats_server: EmbeddedNats) -> None:
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up:
        dep = deployment("edge: {queue: {timeout_s: 0.5}}\n" + ONE_SLOT.format(url=up.url))
        async with deployment_running(dep, nats_server.url) as h, h.http() as http:
            first = asyncio.create_task(http.post("/v1/chat/completions", json=ask("first")))
            await up.wait_for(lambda u: u.in_flight == 1)
            # Published to the broker, never delivered: the node never starts it within the timeout.
            late = await http.post("/v1/chat/completions", json=ask("late"))
            assert late.status_code == 503 and late.json()["error"]["code"] == "queue_timeout"
            assert h.edge.scheduler.pools["m"].standing == 0
            gate.set()
            assert (await first).status_code == 200
            after = await http.post("/v1/chat/completions", json=ask("after"))
            assert after.status_code == 200
            assert [b["messages"][0]["content"] for b in up.bodies] == ["first", "after"]
