"""Anticipation (edge.queue.anticipate_ms): a slot freed by a tenant that asks again at once is kept for it.

The scheduler's side runs on the loop alone; what the other edges hear runs on a real nats-server.
The windows are long (seconds) wherever a test needs a request to count as "back in time", so
that no outcome depends on how fast this machine runs the few loop turns in between.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from nats.aio.msg import Msg

from iop import wire
from iop.edge import anticipate
from iop.edge.fairshare import loads
from iop.edge.keys import EdgeKeys, Key
from iop.edge.scheduler import Scheduler
from iop.edge.share import SlotShare
from iop.edgeconf import QueueSettings
from iop.nats import connection
from iop.nats.server import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, deployment_running, until
from tests.test_scheduler import scheduler as connected_scheduler
from tests.test_standby import settled, soon


def scheduler(providers: dict[str, int], window_s: float = 5.0) -> Scheduler:
    s = connected_scheduler(providers, {"m": list(providers)})
    s.anticipate_s = window_s
    return s


async def quiet_back_in_time(s: Scheduler) -> tuple[Any, asyncio.Task[Any]]:
    """`flood` holds a slot and asks for another, `quiet` holds one and came back at once after its
    previous one. Returns quiet's grant and flood's second request (waiting at capacity 2)."""
    await s.acquire_grant("m", soon(), tenant="flood")
    first = await s.acquire_grant("m", soon(), tenant="quiet")
    s.release(first.slot, first)  # nobody waits: nothing to keep; quiet has nothing here from now
    again = await s.acquire_grant("m", soon(), tenant="quiet")  # back at once
    backlog = asyncio.create_task(s.acquire_grant("m", soon(), tenant="flood"))
    assert await settled(backlog) == (s.providers["p"].capacity > 2) and not s.pools["m"].kept
    return again, backlog


async def test_the_slot_of_a_tenant_that_asks_again_at_once_is_kept_for_its_next_request() -> None:
    s = scheduler({"p": 2})
    quiet, backlog = await quiet_back_in_time(s)
    s.release(quiet.slot, quiet)
    # Flood waits, but the freed slot is kept for quiet: flood's request is not granted.
    assert not await settled(backlog)
    assert list(s.pools["m"].kept) == ["quiet"] and s.providers["p"].free == 0
    nxt = await s.acquire_grant("m", soon(), tenant="quiet")  # at once, ahead of flood's backlog
    assert nxt.slot.id == "p" and not await settled(backlog)
    assert s.providers["p"].in_flight == 2 and s.pools["m"].kept_outcomes == {"taken": 1}
    s.release(nxt.slot, nxt)
    backlog.cancel()


async def test_a_tenants_first_request_keeps_its_slot_for_the_second_but_a_late_one_loses_it() -> None:
    # Nothing says yet whether a new session's client asks again at once: its second turn is
    # kept a slot as its later ones will be. Once it came back late, it is kept none.
    s = scheduler({"p": 2})
    await s.acquire_grant("m", soon(), tenant="flood")
    first = await s.acquire_grant("m", soon(), tenant="quiet")
    backlog = asyncio.create_task(s.acquire_grant("m", soon(), tenant="flood"))
    assert not await settled(backlog)
    s.release(first.slot, first)  # quiet's first request ends while flood waits
    assert not await settled(backlog) and list(s.pools["m"].kept) == ["quiet"]
    s.anticipate_s = 1e-9  # from now on nobody is back in time
    second = await s.acquire_grant("m", soon(), tenant="quiet")  # takes the kept slot, but late
    assert s.pools["m"].kept_outcomes == {"taken": 1}
    s.release(second.slot, second)
    assert await settled(backlog) and not s.pools["m"].kept


async def test_once_the_pool_forgot_a_tenant_one_with_no_return_is_kept_none(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tenant forgotten (past TENANTS) that comes back has no return on record: it may be one that
    # never came back in time, so it is not given the benefit of the doubt a new one gets.
    monkeypatch.setattr(anticipate, "TENANTS", 2)
    s = scheduler({"p": 2})
    for name in ("a", "b", "c"):  # three tenants end a request each: the first is forgotten
        g = await s.acquire_grant("m", soon(), tenant=name)
        s.release(g.slot, g)
    assert s.pools["m"].returns_forgot and "a" not in s.pools["m"].returns
    await s.acquire_grant("m", soon(), tenant="flood")
    first = await s.acquire_grant("m", soon(), tenant="d")
    backlog = asyncio.create_task(s.acquire_grant("m", soon(), tenant="flood"))
    assert not await settled(backlog)
    s.release(first.slot, first)
    assert await settled(backlog) and not s.pools["m"].kept


async def test_a_kept_slot_goes_to_the_next_waiter_when_its_tenant_does_not_come_back() -> None:
    s = scheduler({"p": 2})
    quiet, backlog = await quiet_back_in_time(s)
    s.anticipate_s = 0.05
    s.release(quiet.slot, quiet)
    assert not await settled(backlog)
    granted = await asyncio.wait_for(backlog, 5)  # the window ran out: flood's request takes the slot
    assert granted.slot.id == "p" and not s.pools["m"].kept
    assert s.pools["m"].kept_outcomes == {"lapsed": 1}


async def test_a_tenant_that_does_not_come_back_in_time_is_kept_no_slot() -> None:
    s = scheduler({"p": 2})
    s.anticipate_s = 1e-9  # nobody asks again within a nanosecond
    quiet, backlog = await quiet_back_in_time(s)
    s.release(quiet.slot, quiet)
    assert await settled(backlog) and not s.pools["m"].kept


async def test_a_tenant_whose_fair_share_is_less_than_a_slot_is_kept_none() -> None:
    s = scheduler({"p": 2})
    quiet, backlog = await quiet_back_in_time(s)
    other = asyncio.create_task(s.acquire_grant("m", soon(), tenant="other", priority="batch"))
    assert not await settled(other)
    # Three tenants on two slots: quiet's share is 2/3 of a slot. Its freed slot goes to the next.
    s.release(quiet.slot, quiet)
    assert await settled(backlog) and not s.pools["m"].kept
    other.cancel()


async def test_a_kept_tenant_is_announced_active_so_no_other_edges_standby_takes_its_slot() -> None:
    s = scheduler({"p": 2})
    quiet, backlog = await quiet_back_in_time(s)
    s.release(quiet.slot, quiet)
    assert ("quiet", 1, 1.0, 0, 0) in loads(s.pools["m"])
    backlog.cancel()


async def test_a_slot_is_kept_against_another_edges_backlog_but_not_a_higher_class_there() -> None:
    s = scheduler({"p": 2})
    share = SlotShare(s, "edge-a")

    async def hear(waiting: list[tuple[str, int, float, int, int]]) -> None:
        news = wire.EdgeSlots("edge-b", True, {"p": 1}, {"m": waiting})
        await share._on_slots(Msg(None, subject=wire.EDGE_SLOTS_SUBJECT, data=wire.encode(news)))  # type: ignore[arg-type]

    first = await s.acquire_grant("m", soon(), tenant="quiet")
    s.release(first.slot, first)
    again = await s.acquire_grant("m", soon(), tenant="quiet")  # back at once
    await hear([("flood", 1, 1.0, 50, 1)])  # edge B's backlog, nothing of it waits here
    s.release(again.slot, again)
    assert list(s.pools["m"].kept) == ["quiet"]
    third = await s.acquire_grant("m", soon(), tenant="quiet")
    await hear([("urgent", 0, 1.0, 3, 1)])
    s.release(third.slot, third)  # an interactive tenant waits on edge B: its turn, not quiet's
    assert not s.pools["m"].kept


async def test_a_tenant_behind_a_higher_class_is_kept_none() -> None:
    s = scheduler({"p": 2})
    quiet, backlog = await quiet_back_in_time(s)
    urgent = asyncio.create_task(s.acquire_grant("m", soon(), tenant="urgent", priority="interactive"))
    assert not await settled(urgent)
    s.release(quiet.slot, quiet)  # a higher class waits: it takes the slot, none is kept for quiet
    assert await settled(urgent) and not s.pools["m"].kept
    backlog.cancel()


async def test_a_tenant_that_would_not_be_first_in_the_fair_order_is_kept_none() -> None:
    s = scheduler({"p": 3})
    quiet, _ = await quiet_back_in_time(s)  # the third slot was free: flood's backlog has it
    newcomer = asyncio.create_task(s.acquire_grant("m", soon(), tenant="new"))
    more = asyncio.create_task(s.acquire_grant("m", soon(), tenant="flood"))
    assert not await settled(newcomer)
    # The newcomer is placed where quiet would be when it comes back, and it is older: no slot kept.
    s.release(quiet.slot, quiet)
    assert await settled(newcomer) and not s.pools["m"].kept
    more.cancel()


async def test_without_anticipation_no_slot_is_kept() -> None:
    s = scheduler({"p": 2})
    quiet, backlog = await quiet_back_in_time(s)
    s.anticipate_s = 0.0
    s.release(quiet.slot, quiet)
    assert await settled(backlog) and not s.pools["m"].kept


def test_the_default_window_is_ten_milliseconds() -> None:
    assert QueueSettings().anticipate_ms == 10.0


async def test_the_other_edges_hear_a_kept_slot_as_held(nats_server: EmbeddedNats) -> None:
    s = scheduler({"p": 2})
    share = SlotShare(s, "edge-a")
    nc = await connection.connect(nats_server.url, "anticipate-test")
    heard: list[wire.EdgeSlots] = []
    news = asyncio.Event()

    async def on(msg: Msg) -> None:
        heard.append(wire.decode_edge_slots(msg.data))
        news.set()

    try:
        await nc.subscribe(wire.EDGE_SLOTS_SUBJECT, cb=on)
        await share.start(nc)
        quiet, backlog = await quiet_back_in_time(s)
        await until(lambda: bool(heard) and heard[-1].held.get("p") == 2, news)
        s.anticipate_s = 0.5
        s.release(quiet.slot, quiet)  # kept: still two held, as the other edges see it
        assert s.providers["p"].in_flight == 1 and s.pools["m"].kept
        n = len(heard)
        await until(lambda: len(heard) > n, news)
        assert heard[-1].held.get("p") == 2
        granted = await asyncio.wait_for(backlog, 5)  # lapsed: flood's request takes it
        assert granted.slot.id == "p"
        s.release(granted.slot, granted)
        await until(lambda: heard[-1].held.get("p") == 1, news)
    finally:
        await share.stop()
        await nc.close()


async def test_through_a_real_edge_a_tenant_back_at_once_takes_its_kept_slot_ahead_of_a_backlog(
    nats_server: EmbeddedNats,
) -> None:
    keys = EdgeKeys(clients=[Key("quiet", b"kq"), Key("flood", b"kf")], admins=[])
    async with fake_upstream() as up:
        dep = deployment(f"""
edge:
  queue: {{standby: 0, anticipate_ms: 1000}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: u, type: openai, base_url: "{up.url}", api: both}}]
    providers: [{{id: p, adapter: u, capacity: 2}}]
""")
        async with deployment_running(dep, nats_server.url, keys) as h, h.http() as http:
            s = h.edge.scheduler

            async def ask(key: str) -> httpx.Response:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                return await http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})

            held = up.gate = asyncio.Event()
            flood = asyncio.create_task(ask("kf"))  # holds one slot until `held` is set
            await up.wait_for(lambda u: u.in_flight == 1)
            up.gate = None
            assert (await ask("kq")).status_code == 200  # nobody waits: its slot is simply free again
            second = up.gate = asyncio.Event()
            quiet = asyncio.create_task(ask("kq"))  # back at once: it counts as coming back in time
            await up.wait_for(lambda u: u.in_flight == 2)
            backlog = asyncio.create_task(ask("kf"))
            await until(lambda: s.waiting("m") == 1, s.changed)
            up.gate = None
            second.set()
            assert (await quiet).status_code == 200
            third = await ask("kq")  # its slot was kept: it runs while flood's request still waits
            assert third.status_code == 200 and s.waiting("m") == 1
            metrics = (await http.get("/metrics", headers={"authorization": "Bearer kq"})).text
            assert 'iop_pool_kept_total{alias="m",outcome="taken"} 1.0' in metrics
            held.set()
            assert (await flood).status_code == 200 and (await backlog).status_code == 200
            assert up.peak == 2
