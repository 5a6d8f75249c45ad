"""The edge's wait for a work publish's ack: the ack ends it, a timer ends it, a cancel leaves the ack to withdraw."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from nats.aio.msg import Msg

from iop import wire
from iop.edge import publish
from iop.edge.channel import Channel
from iop.edge.publish import Publisher
from iop.nats import connection, streams
from iop.nats.server import EmbeddedNats


async def _publisher(nats_server: EmbeddedNats) -> Publisher:
    nc = await connection.connect(nats_server.url, "test-publish", wait_s=5)
    js = nc.jetstream()
    await streams.ensure_work_stream(js)
    p = Publisher(nc, js)
    await p.start()
    return p


async def test_the_ack_ends_the_wait_with_the_stored_sequence(nats_server: EmbeddedNats) -> None:
    p = await _publisher(nats_server)
    try:
        seqs = [await p._publish_work(Channel(f"c{i}"), wire.work_subject("p"), b"w", f"m{i}") for i in range(3)]
        assert seqs == [seqs[0], seqs[0] + 1, seqs[0] + 2] and not p._acks
    finally:
        await connection.close(p.nc)


async def test_an_ack_that_never_comes_ends_the_wait_in_time(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish, "PUBLISH_TIMEOUT_S", 0.2)
    p = await _publisher(nats_server)
    try:
        p._acks_inbox = p.nc.new_inbox()  # nothing listens there: the ack is lost on its way
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(nats.errors.TimeoutError):
            await asyncio.wait_for(p._publish_work(Channel("c"), wire.work_subject("p"), b"w", "m"), 5)
        assert 0.15 < loop.time() - t0 < 2 and not p._acks
    finally:
        await connection.close(p.nc)


async def test_a_cancelled_wait_leaves_the_ack_for_the_withdraw(nats_server: EmbeddedNats) -> None:
    p = await _publisher(nats_server)
    try:
        held: list[Msg] = []
        arrived = asyncio.Event()

        async def hold(msg: Msg) -> None:  # the ack arrives, but is read only later
            held.append(msg)
            arrived.set()

        p._acks_inbox = p.nc.new_inbox()
        await p.nc.subscribe(p._acks_inbox + ".*", cb=hold)
        ch = Channel("c")
        waiting = asyncio.create_task(p._publish_work(ch, wire.work_subject("p"), b"w", "m"))
        await asyncio.wait_for(arrived.wait(), 5)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert ch.publishing is not None and not ch.publishing.done()
        p._on_publish_ack(held[0])
        assert (await asyncio.wait_for(ch.publishing, 5)).data == held[0].data
    finally:
        await connection.close(p.nc)
