"""A slot's own JetStream pull (iop/node/pull.py) and the fetch loop on it, on a real nats-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from iop import config, wire
from iop.nats import streams
from iop.nats.server import EmbeddedNats
from iop.node import adapters, fetch, pull
from iop.node.resource import Resource
from iop.node.running import RunningRequests

PROVIDER = "p-pull"


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NATS]:
    conn = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    js = conn.jetstream()
    await streams.ensure_work_stream(js)
    await streams.ensure_provider_consumer(js, PROVIDER, 1)
    yield conn
    await conn.close()


class PullSpy:
    """Sees every pull request sent to the provider's consumer (core NATS fans them out to us too)."""

    def __init__(self) -> None:
        self.count = 0
        self.seen = asyncio.Event()
        self.sub: Subscription | None = None

    async def start(self, conn: NATS) -> PullSpy:
        async def on(msg: Msg) -> None:
            self.count += 1
            self.seen.set()

        self.sub = await conn.subscribe(
            f"$JS.API.CONSUMER.MSG.NEXT.{wire.WORK_STREAM}.{wire.consumer_name(PROVIDER)}", cb=on
        )
        await conn.flush()
        return self

    async def wait(self) -> None:
        await asyncio.wait_for(self.seen.wait(), 5)
        self.seen.clear()

    async def stop(self) -> None:
        """Unsubscribed: a pull for a missing consumer then has no responder (the 503 the server sends)."""
        assert self.sub is not None
        await self.sub.unsubscribe()


def slot_of(conn: NATS, wait_s: float = 1.0) -> pull.SlotPull:
    return pull.SlotPull(conn, wire.WORK_STREAM, wire.consumer_name(PROVIDER), wait_s)


async def test_pull_hands_back_a_jetstream_message_that_acks(nc: NATS) -> None:
    js = nc.jetstream()
    slot = slot_of(nc)
    await slot.open()
    waiting = asyncio.create_task(slot.next())
    await js.publish(wire.work_subject(PROVIDER), b"work", headers={"traceparent": "00-ab-cd-01"})
    msg = await asyncio.wait_for(waiting, 5)
    assert isinstance(msg, Msg)
    assert msg.data == b"work"
    assert msg.headers == {"traceparent": "00-ab-cd-01"}
    assert msg.metadata.num_delivered == 1
    await msg.in_progress()
    await msg.ack_sync()
    info = await js.consumer_info(wire.WORK_STREAM, wire.consumer_name(PROVIDER))
    assert (info.num_ack_pending, info.num_pending) == (0, 0)
    await slot.close()


async def test_pull_ends_an_idle_wait_by_its_408_and_pulls_again(nc: NATS) -> None:
    slot = slot_of(nc, wait_s=0.4)
    await slot.open()
    t0 = time.monotonic()
    assert await slot.next() is None
    # Ended by the server's 408 (sent EXPIRES_MARGIN_S before the slot would give up), not the timer.
    assert slot.last_status == "408 Request Timeout"
    assert time.monotonic() - t0 < 0.4
    assert await slot.next() is None
    assert slot.pulls == 2
    await slot.close()


async def test_pull_stale_408_of_an_old_pull_does_not_end_the_current_one(
    nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server expires each pull 0.5 s after the slot gave up on it: pull 1's 408 comes during pull 2.
    monkeypatch.setattr(pull, "EXPIRES_MARGIN_S", -0.5)
    js = nc.jetstream()
    slot = slot_of(nc, wait_s=1.0)
    await slot.open()
    stale = asyncio.Event()

    async def saw(msg: Msg) -> None:
        stale.set()

    await nc.subscribe(f"{slot.inbox}.1", cb=saw)  # pull 1's subject (pull 2 is answered on .0)
    assert await slot.next() is None  # pull 1 given up by the slot, still live on the server
    second = asyncio.create_task(slot.next())
    await asyncio.wait_for(stale.wait(), 5)
    assert not second.done()
    await js.publish(wire.work_subject(PROVIDER), b"after the stale 408")
    msg = await asyncio.wait_for(second, 5)
    assert msg is not None and msg.data == b"after the stale 408"
    assert slot.pulls == 2
    await msg.ack()
    await slot.close()


async def test_pull_keeps_a_message_that_came_after_its_wait(nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pull, "EXPIRES_MARGIN_S", -2.0)
    js = nc.jetstream()
    slot = slot_of(nc, wait_s=0.3)
    await slot.open()
    assert await slot.next() is None  # given up by the slot; the server keeps the pull 2 s more
    kept = asyncio.Event()

    async def arrived(msg: Msg) -> None:
        kept.set()

    await nc.subscribe(f"{slot.inbox}.*", cb=arrived)
    await js.publish(wire.work_subject(PROVIDER), b"late")
    await asyncio.wait_for(kept.wait(), 5)  # delivered to the old pull, with no next() waiting
    msg = await asyncio.wait_for(slot.next(), 5)
    assert msg is not None and msg.data == b"late"
    assert slot.pulls == 1  # handed over without another pull
    await msg.ack()
    await slot.close()


async def test_pull_heartbeat_is_not_work_and_does_not_end_the_pull(nc: NATS) -> None:
    js = nc.jetstream()
    slot = slot_of(nc, wait_s=2.0)
    await slot.open()
    spy = await PullSpy().start(nc)
    waiting = asyncio.create_task(slot.next())
    await spy.wait()
    await nc.publish(f"{slot.inbox}.1", b"", headers={"Status": "100", "Description": "Idle Heartbeat"})
    await nc.flush()
    await js.publish(wire.work_subject(PROVIDER), b"work")
    msg = await asyncio.wait_for(waiting, 5)
    assert msg is not None and msg.data == b"work"
    await msg.ack()
    await slot.close()


async def test_pull_on_a_deleted_consumer_pauses_and_resumes_when_it_is_back(nc: NATS) -> None:
    js = nc.jetstream()
    slot = slot_of(nc, wait_s=5.0)
    await slot.open()
    spy = await PullSpy().start(nc)
    waiting = asyncio.create_task(slot.next())
    await spy.wait()
    await spy.stop()
    t0 = time.monotonic()
    await js.delete_consumer(wire.WORK_STREAM, wire.consumer_name(PROVIDER))
    assert await asyncio.wait_for(waiting, 5) is None
    assert slot.last_status == "409 Consumer Deleted"
    assert pull.PAUSE_S * 0.9 <= time.monotonic() - t0 < 5.0  # paused, then gave the pull up
    t0 = time.monotonic()
    assert await slot.next() is None  # no consumer: answered at once (503), and paused again
    assert slot.last_status.startswith("503")
    assert time.monotonic() - t0 >= pull.PAUSE_S * 0.9
    await streams.ensure_provider_consumer(js, PROVIDER, 1)
    await js.publish(wire.work_subject(PROVIDER), b"work")
    msg = await asyncio.wait_for(slot.next(), 5)
    assert msg is not None and msg.data == b"work"
    assert slot.pulls == 3
    await msg.ack()
    await slot.close()


async def test_pull_raises_connection_closed_once_closed(nats_server: EmbeddedNats) -> None:
    conn = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    slot = slot_of(conn)
    await slot.open()
    await conn.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await slot.next()


async def _loop(conn: NATS, capacity: int, index: int) -> tuple[RunningRequests, Resource, asyncio.Task[None]]:
    running = RunningRequests(conn, "n-pull", "i-1", asyncio.Event())
    adapter_cfg = config.MockAdapter(id="m")
    r = Resource(
        cfg=config.Provider(id=PROVIDER, adapter="m", capacity=capacity),
        adapter=adapters.build(adapter_cfg),
        kind="pool",
    )
    return running, r, asyncio.create_task(fetch.fetch_loop(running, r, index))


async def test_fetch_loop_ends_when_its_provider_is_retired(nc: NATS) -> None:
    spy = await PullSpy().start(nc)
    _, r, task = await _loop(nc, 1, 0)
    await spy.wait()
    r.retired = True
    await asyncio.wait_for(task, fetch.FETCH_TIMEOUT_S * 3)


async def test_fetch_loop_ends_when_capacity_drops_below_its_slot(nc: NATS) -> None:
    spy = await PullSpy().start(nc)
    _, r, task = await _loop(nc, 2, 1)
    await spy.wait()
    r.cfg = config.Provider(id=PROVIDER, adapter="m", capacity=1)
    await asyncio.wait_for(task, fetch.FETCH_TIMEOUT_S * 3)


async def test_fetch_loop_ends_when_the_node_stops(nc: NATS) -> None:
    spy = await PullSpy().start(nc)
    running, _, task = await _loop(nc, 1, 0)
    await spy.wait()
    running.stopping = True
    await asyncio.wait_for(task, fetch.FETCH_TIMEOUT_S * 3)


async def test_fetch_loop_ends_when_the_connection_closes(nats_server: EmbeddedNats, nc: NATS) -> None:
    conn = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    spy = await PullSpy().start(nc)
    _, _, task = await _loop(conn, 1, 0)
    await spy.wait()
    await conn.close()
    await asyncio.wait_for(task, fetch.FETCH_TIMEOUT_S * 3)


async def test_a_begun_pull_is_the_one_next_waits_for(nc: NATS) -> None:
    # A run sends its slot's next pull between its ack and its Done (`begin`); the fetch loop's
    # `next()` then waits on that pull, never sends a second one for the same message.
    js = nc.jetstream()
    spy = await PullSpy().start(nc)
    slot = slot_of(nc)
    await slot.open()
    await slot.begin()
    await spy.wait()
    await slot.begin()  # one is out already: nothing more is sent
    assert slot.waiting and slot.pulls == 1
    await js.publish(wire.work_subject(PROVIDER), b"work")
    msg = await asyncio.wait_for(slot.next(), 5)
    assert isinstance(msg, Msg) and msg.data == b"work" and slot.pulls == 1 and not slot.waiting
    await msg.ack_sync()
    await slot.close()
    assert spy.count == 1


async def test_a_slot_that_stops_serving_with_a_pull_out_hands_its_message_back(nc: NATS) -> None:
    # A run's early pull went out just before its slot stopped serving (retired, capacity lowered,
    # stopping): the message it brings goes back to the broker at once (nak), for a slot that
    # serves, not after the ack wait.
    js = nc.jetstream()
    _, r, _ = await _loop(nc, 1, 0)
    r.retired = True  # the loop itself ends at once: what is tested is its last step
    slot = slot_of(nc)
    await slot.open()
    await slot.begin()
    await js.publish(wire.work_subject(PROVIDER), b"work")
    await asyncio.wait_for(fetch._hand_back(r, slot, 0), 5)
    assert not slot.waiting
    await slot.close()
    other = slot_of(nc)
    await other.open()
    again = await asyncio.wait_for(other.next(), 5)
    assert isinstance(again, Msg) and again.data == b"work" and again.metadata.num_delivered == 2
    await again.ack_sync()
    await other.close()
