"""Subscriptions handled as nats-py reads each message (iop/nats/inline.py), on a real nats-server."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.msg import Msg

from iop.nats import connection, inline
from iop.nats.server import EmbeddedNats


async def test_messages_are_handled_in_wire_order_as_they_are_read(nats_server: EmbeddedNats) -> None:
    reader = await connection.connect(nats_server.url, "test-inline-reader")
    writer = await connection.connect(nats_server.url, "test-inline-writer")
    try:
        seen: list[bytes] = []
        queued: list[int] = []
        done = asyncio.Event()
        sub = None

        def handle(msg: Msg) -> None:
            seen.append(msg.data)
            # Nothing waits behind it in a queue: the next message is not even read yet.
            queued.append(sub.pending_msgs if sub is not None else -1)
            if len(seen) == 2000:
                done.set()

        sub = await inline.subscribe(reader, "inline.t", handle)
        await reader.flush()
        for i in range(2000):  # one flush: the reader takes them in few reads, many per read
            await writer.publish("inline.t", b"%d" % i)
        await writer.flush()
        await asyncio.wait_for(done.wait(), 10)
        assert seen == [b"%d" % i for i in range(2000)]
        assert set(queued) == {0}
        assert sub.pending_bytes == 0  # nats-py's slow-consumer count does not grow with what was handled
    finally:
        await connection.close(writer)
        await connection.close(reader)


async def test_a_handler_that_fails_loses_that_message_only(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await connection.connect(nats_server.url, "test-inline-fail")
    try:
        seen: list[bytes] = []
        last = asyncio.Event()

        def handle(msg: Msg) -> None:
            if msg.data == b"bad":
                raise ValueError("a handler's bug")
            seen.append(msg.data)
            if msg.data == b"last":
                last.set()

        sub = await inline.subscribe(nc, "inline.f", handle)
        with caplog.at_level(logging.ERROR, logger="iop.nats"):
            for data in (b"first", b"bad", b"last"):
                await nc.publish("inline.f", data)
            await asyncio.wait_for(last.wait(), 5)
        assert seen == [b"first", b"last"]
        assert any("inline.f" in r.getMessage() and r.exc_info for r in caplog.records)
        # The subscription ends as any other does.
        await sub.unsubscribe()
        await nc.publish("inline.f", b"after")
        await nc.flush()
        assert seen == [b"first", b"last"]
    finally:
        await connection.close(nc)
