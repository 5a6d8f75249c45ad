"""Fair queueing between tenants in a pool, their priorities and max_concurrent, on the scheduler alone.

The scheduler needs no NATS: these run on the event loop. A grant's hold time is what its
release measures; a test that needs a request to have held its slot for a while moves the
grant's start back instead of sleeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from iop.edge import fairqueue
from iop.edge.scheduler import Scheduler
from iop.edge.slots import Grant
from iop.errors import QueueFull


def scheduler(capacity: int, fair: bool = True, max_waiting: int = 100) -> Scheduler:
    s = Scheduler(max_waiting, fair=fair)
    s.add_provider("p", "node-p", capacity)
    s.set_connected("p", True)
    s.add_pool("m", ["p"])
    return s


def soon() -> float:
    return asyncio.get_running_loop().time() + 5.0


class Served:
    """Requests sent from the test; `order` lists who got a slot, in the order they got it."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.order: list[str] = []
        self.grants: dict[str, Grant] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.got = asyncio.Event()

    async def ask(self, name: str, tenant: str, **policy: object) -> None:
        """Send one request (named `name`) and return once it waits or holds a slot."""
        before = self.s.waiting("m")

        async def one() -> None:
            grant = await self.s.acquire_grant("m", soon(), tenant=tenant, **policy)  # type: ignore[arg-type]
            self.grants[name] = grant
            self.order.append(name)
            self.got.set()

        self.tasks.append(asyncio.create_task(one()))
        await until(lambda: self.s.waiting("m") > before or name in self.grants, self.s.changed, self.got)

    async def release(self, name: str, held_s: float = 1.0) -> str:
        """End request `name` as if it held its slot `held_s`; returns who got the slot next."""
        grant = self.grants.pop(name)
        grant.at -= held_s
        n = len(self.order)
        self.s.release(grant.slot, grant)
        await until(lambda: len(self.order) > n, self.got)
        return self.order[-1]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for g in list(self.grants.values()):
            self.s.release(g.slot, g)
        self.grants.clear()


async def until(ok: Callable[[], bool], *events: asyncio.Event) -> None:
    async with asyncio.timeout(5):
        while not ok():
            for e in events:
                e.clear()
            waits: list[Awaitable[object]] = [e.wait() for e in events]
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], return_when=asyncio.FIRST_COMPLETED)


async def test_fair_queue_serves_a_quiet_tenant_before_a_flooders_backlog() -> None:
    s = scheduler(1)
    r = Served(s)
    for i in range(6):
        await r.ask(f"f{i}", "flood")
    await r.ask("q", "quiet")
    # f0 runs, f1..f5 wait, then q: q starts where the pool's service stands (the flooder's before
    # its last grant), behind nobody: the slot that frees first is q's, then the flooder has its turn.
    assert await r.release("f0") == "q"
    assert await r.release("q") == "f1"
    await r.close()


async def test_fair_queue_is_arrival_order_when_off() -> None:
    s = scheduler(1, fair=False)
    r = Served(s)
    for i in range(4):
        await r.ask(f"f{i}", "flood")
    await r.ask("q", "quiet")
    assert [await r.release(n) for n in ("f0", "f1", "f2")] == ["f1", "f2", "f3"]
    assert await r.release("f3") == "q"
    await r.close()


async def test_fair_queue_shares_a_saturated_pool_by_weight() -> None:
    s = scheduler(1)
    r = Served(s)
    await r.ask("first", "other")
    for i in range(12):
        await r.ask(f"h{i}", "heavy", weight=3.0)
        await r.ask(f"l{i}", "light", weight=1.0)
    running, served = "first", []
    for _ in range(12):
        running = await r.release(running, held_s=1.0)
        served.append(running[0])
    # Each holds its slot 1 s: the tenant of weight 3 gets three slots to the other's one.
    assert served.count("h") == 9 and served.count("l") == 3, served
    await r.close()


async def test_fair_queue_charges_the_slot_seconds_a_request_held() -> None:
    s = scheduler(1)
    r = Served(s)
    await r.ask("a0", "a")
    for i in range(1, 4):
        await r.ask(f"a{i}", "a")
        await r.ask(f"b{i}", "b")
    # a0 held its slot for 10 s: b gets the next slots until its service catches up with a's.
    assert await r.release("a0", held_s=10.0) == "b1"
    assert await r.release("b1", held_s=1.0) == "b2"
    assert await r.release("b2", held_s=1.0) == "b3"
    await r.close()


async def test_fair_queue_serves_higher_priority_first_but_never_starves_batch() -> None:
    s = scheduler(1)
    r = Served(s)
    await r.ask("i0", "ui", priority="interactive")
    await r.ask("b", "nightly", priority="batch")
    for i in range(1, 12):
        await r.ask(f"i{i}", "ui", priority="interactive")
    served = []
    running = "i0"
    for _ in range(fairqueue.STARVE_AFTER + 1):
        running = await r.release(running)
        served.append(running)
    # Interactive first, although the batch request is older; after STARVE_AFTER grants passed it, it goes.
    assert served == [f"i{i}" for i in range(1, fairqueue.STARVE_AFTER + 1)] + ["b"]
    await r.close()


async def test_fair_queue_holds_a_tenant_to_max_concurrent_while_others_take_free_slots() -> None:
    s = scheduler(4)
    r = Served(s)
    await r.ask("a1", "a", max_concurrent=2)
    await r.ask("a2", "a", max_concurrent=2)
    await r.ask("a3", "a", max_concurrent=2)  # waits with two slots free
    assert (r.order, s.waiting("m"), s.providers["p"].in_flight) == (["a1", "a2"], 1, 2)
    await r.ask("b1", "b")  # another tenant is not behind it
    assert r.order[-1] == "b1" and s.waiting("m") == 1
    # The tenant's request ends: its waiter takes its place.
    assert await r.release("a1") == "a3"
    assert s.pools["m"].waiters.tenants["a"].running == 2
    await r.close()
    assert s.pools["m"].waiters.tenants == {} and s.providers["p"].in_flight == 0


async def test_fair_queue_counts_a_tenant_held_back_against_max_waiting() -> None:
    s = scheduler(4, max_waiting=1)
    r = Served(s)
    await r.ask("a1", "a", max_concurrent=1)
    await r.ask("a2", "a", max_concurrent=1)
    with pytest.raises(QueueFull):
        await s.acquire_grant("m", soon(), tenant="a", max_concurrent=1)
    await r.close()


async def test_fair_queue_gives_a_cancelled_or_timed_out_waiter_share_back() -> None:
    s = scheduler(1)
    r = Served(s)
    await r.ask("a1", "a", max_concurrent=1)
    late = asyncio.create_task(s.acquire_grant("m", asyncio.get_running_loop().time() + 0.05, tenant="a"))
    await r.ask("a2", "a", max_concurrent=1)
    await asyncio.gather(late, return_exceptions=True)
    r.tasks[-1].cancel()
    await asyncio.gather(r.tasks[-1], return_exceptions=True)
    assert s.waiting("m") == 0 and s.waiting_bytes == 0
    await r.close()
    # Nothing held, nothing remembered: the tenant's next request is granted at once.
    grant = await s.acquire_grant("m", soon(), tenant="a", max_concurrent=1)
    assert s.pools["m"].waiters.tenants["a"].running == 1
    s.release(grant.slot, grant)
    assert s.pools["m"].waiters.tenants == {}


async def test_fair_queue_keeps_counting_a_tenant_whose_waiter_took_its_last_share() -> None:
    s = scheduler(4)
    r = Served(s)
    await r.ask("a1", "a", max_concurrent=1)
    await r.ask("a2", "a", max_concurrent=1)
    assert await r.release("a1") == "a2"  # its only waiter granted as its only running one ended
    await r.ask("a3", "a", max_concurrent=1)  # still one of hers running: this one waits
    assert "a3" not in r.order and s.waiting("m") == 1
    assert await r.release("a2") == "a3"
    await r.close()
