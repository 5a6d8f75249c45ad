"""Fair shares across edges: a quiet tenant on one edge never waits behind a flooder's backlog on another."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from iop.edge.fairshare import DEFER_S, FairShare
from iop.edge.keys import EdgeKeys, Key
from iop.edge.scheduler import Scheduler
from iop.edge.slots import Grant
from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, eventually, running_edge, running_node, until

YAML = """
edge:
  queue: {timeout_s: 60, max_waiting: 500}
models: [{alias: m, pool: [p]}]
nodes:
  - id: n
    adapters: [{id: up, type: openai, base_url: "URL", api: both}]
    providers: [{id: p, adapter: up, capacity: 2}]
"""
KEYS = EdgeKeys(clients=[Key("flood", b"kf"), Key("quiet", b"kq")], admins=[])


def ask(text: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def said(body: dict[str, object]) -> str:
    messages = body["messages"]
    assert isinstance(messages, list)
    return str(messages[-1]["content"])


async def test_a_quiet_tenant_on_one_edge_takes_the_next_slot_a_flooders_edge_frees(nats_server: EmbeddedNats) -> None:
    """40 requests of a flooder wait on edge A for 2 slots; a quiet tenant sends one request at a time
    to edge B. Each of its requests gets one of the next slots that free (A leaves it for B), not one
    after A's backlog: at most one flooder's request per slot (those that started while the quiet
    request's word was on its way to A) starts between its arrival in B's queue and its start,
    so it waits at most one service time; without fair shares across edges it waits for the backlog."""
    async with fake_upstream(latency_s=0.15) as up, AsyncExitStack() as stack:
        dep = deployment(YAML.replace("URL", up.url))
        a = await stack.enter_async_context(running_edge(dep, nats_server.url, KEYS))
        b = await stack.enter_async_context(running_edge(dep, nats_server.url, KEYS))
        await stack.enter_async_context(running_node(dep, "n", nats_server.url))
        http_a = await stack.enter_async_context(a.http())
        http_b = await stack.enter_async_context(b.http())
        for e in (a, b):
            await e.edge.registry.wait_connected(["n"], timeout_s=10)
        flood = [
            asyncio.create_task(
                http_a.post("/v1/chat/completions", json=ask(f"flood{i}"), headers={"authorization": "Bearer kf"})
            )
            for i in range(40)
        ]
        sa = a.edge.scheduler
        await until(lambda: len(sa.pools["m"].waiters) >= 25, sa.changed)
        sb = b.edge.scheduler
        passed = []
        for j in range(5):
            quiet = asyncio.create_task(
                http_b.post("/v1/chat/completions", json=ask(f"quiet{j}"), headers={"authorization": "Bearer kq"})
            )
            # Counted from its arrival in B's queue (or its start, if a slot was free at once).
            # (A grant at once sets no event: polled.)
            await eventually(lambda: _true(len(sb.pools["m"].waiters) == 1 or sb.providers["p"].in_flight > 0))
            before = len(up.bodies)
            assert (await quiet).status_code == 200
            started = [said(body) for body in up.bodies]
            mine = started.index(f"quiet{j}")
            passed.append(sum(1 for s in started[before:mine] if s.startswith("flood")))
        waiting_on_a = len(sa.pools["m"].waiters)
        assert all(r.status_code == 200 for r in await asyncio.gather(*flood))
        print(f"\nflooder requests started before each quiet one: {passed}; still waiting on A then: {waiting_on_a}")
        assert waiting_on_a > 0, "the backlog drained first: nothing was shown"
        assert all(n <= 2 for n in passed), passed
        # Not asserted: that A deferred. A quiet request may also reach the broker before A's next
        # grant (B published while its view of the slots was a moment old; max_ack_pending keeps the
        # capacity), and then it starts next without a deferral: seen in CI as [0, 0, 0, 0, 0] with none.
        assert up.peak == 2


async def _true(value: bool) -> bool:
    return value


async def test_a_freed_slot_waits_for_another_edges_tenant_only_while_it_is_ahead_and_not_for_long() -> None:
    """The scheduler alone: another edge's waiting tenant (as its announcement says) against this edge's."""
    s = Scheduler(100)
    s.add_provider("p", "node-p", 2)
    s.set_connected("p", True)
    s.add_pool("m", ["p"])
    share = FairShare(s.serve)
    s.owed = share.owed
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5

    async def queued() -> asyncio.Task[Grant]:
        task = asyncio.create_task(s.acquire_grant("m", deadline, tenant="flood"))
        await until(lambda: s.waiting("m") == 1, s.changed)
        return task

    g1, g2 = [await s.acquire_grant("m", deadline, tenant="flood") for _ in range(2)]
    w1 = await queued()
    # Elsewhere a tenant waits with nothing running: ahead of `flood`, which runs 2 here.
    share.heard("b", True, {"m": [("quiet", 1, 1.0, 1, 0)]})
    s.release(g1.slot, g1)
    assert not w1.done() and s.providers["p"].free == 1 and share.deferred == 1
    # The other edge takes it (its counts and its tenants say so): this edge's waiter has the next slot.
    s.set_elsewhere("p", 1)
    share.heard("b", False, {"m": [("quiet", 1, 1.0, 0, 1)]})
    s.release(g2.slot, g2)
    g3 = await w1
    # A tenant of a lower class waiting elsewhere is not ahead, even with nothing running.
    share.heard("b", False, {"m": [("batch", 2, 1.0, 3, 0)]})
    w2 = await queued()
    s.set_elsewhere("p", 0)  # the other edge's request ended
    g4 = await w2
    # Left free for another edge that does not take it: after DEFER_S the slot is this edge's again.
    share.heard("b", False, {"m": [("quiet", 1, 1.0, 1, 0)]})
    w3 = await queued()
    t0 = loop.time()
    s.release(g3.slot, g3)
    assert not w3.done() and share.deferred == 2
    g5 = await w3
    assert loop.time() - t0 >= DEFER_S * 0.9
    for g in (g4, g5):
        s.release(g.slot, g)


async def test_another_edges_tenants_with_junk_weights_or_counts_are_ignored() -> None:
    """An announcement no edge of this version sends (a weight of 0, below 0, NaN; counts below 0):
    those rows count for nothing, and a freed slot still reaches this edge's waiter."""
    s = Scheduler(100)
    s.add_provider("p", "node-p", 1)
    s.set_connected("p", True)
    s.add_pool("m", ["p"])
    share = FairShare(s.serve)
    s.owed = share.owed
    deadline = asyncio.get_running_loop().time() + 5
    g = await s.acquire_grant("m", deadline, tenant="flood")
    task = asyncio.create_task(s.acquire_grant("m", deadline, tenant="flood"))
    await until(lambda: s.waiting("m") == 1, s.changed)
    junk = [("z", 1, 0.0, 1, 0), ("n", 1, -1.0, 1, 0), ("nan", 1, float("nan"), 1, 0), ("c", 1, 1.0, 1, -9)]
    share.heard("b", True, {"m": junk})
    s.release(g.slot, g)
    g2 = await task
    assert share.deferred == 0 and share.elsewhere == {"b": {}}
    s.release(g2.slot, g2)
