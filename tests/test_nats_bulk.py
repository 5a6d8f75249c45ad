"""Large publishes queued as their pieces (iop/nats/bulk.py): received whole, never copied first."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from nats.aio.msg import Msg

from iop.nats import bulk, connection
from iop.nats.server import EmbeddedNats


async def test_bulk_publish_is_received_whole_beside_other_publishes(nats_server: EmbeddedNats) -> None:
    sender = await connection.connect(nats_server.url, "test-bulk-send")
    receiver = await connection.connect(nats_server.url, "test-bulk-receive")
    try:
        assert bulk.supported(sender)  # the pinned nats-py keeps its pending writes as a list
        got: list[Msg] = []
        done = asyncio.Event()

        async def heard(msg: Msg) -> None:
            got.append(msg)
            if len(got) == 41:
                done.set()

        await receiver.subscribe("bulk.>", cb=heard)
        await connection.flush(receiver)
        body = bytes(range(256)) * 4096  # 1 MiB
        view = memoryview(body)[1000 : 1000 + 600_000]

        async def small(n: int) -> None:
            await sender.publish(f"bulk.small.{n}", b"s%d" % n)

        await asyncio.gather(
            *(small(n) for n in range(20)),
            bulk.publish(sender, "bulk.large", [b"=", view, b"!"], reply="bulk.reply"),
            *(small(n) for n in range(20, 40)),
            bulk.publish(sender, "bulk.tiny", [b"a", b"b"]),  # under BULK_FROM: nats-py's own publish
        )
        await asyncio.wait_for(done.wait(), 10)
        by_subject = {m.subject: m for m in got}
        large = by_subject["bulk.large"]
        assert large.data == b"=" + body[1000 : 1000 + 600_000] + b"!" and large.reply == "bulk.reply"
        assert by_subject["bulk.tiny"].data == b"ab"
        assert sorted(m.data for m in got if m.subject.startswith("bulk.small.")) == sorted(
            b"s%d" % n for n in range(40)
        )
    finally:
        await sender.close()
        await receiver.close()


async def test_bulk_publish_queues_the_callers_buffers_not_copies(nats_server: EmbeddedNats) -> None:
    nc = await connection.connect(nats_server.url, "test-bulk-queue")
    try:
        view = memoryview(bytes(300_000))[10:]
        await bulk.publish(nc, "bulk.q", [view])
        # The flusher has not run yet (nothing awaited since): the queued piece is the view itself.
        assert any(piece is view for piece in nc._pending)
        await connection.flush(nc)
        assert nc.stats["out_bytes"] >= len(view)
    finally:
        await nc.close()


async def test_bulk_publish_refuses_what_nats_py_refuses(nats_server: EmbeddedNats) -> None:
    nc = await connection.connect(nats_server.url, "test-bulk-refuse")
    with pytest.raises(nats.errors.MaxPayloadError):
        await bulk.publish(nc, "bulk.big", [bytes(nc.max_payload), b"x"])
    await nc.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await bulk.publish(nc, "bulk.closed", [bytes(100_000)])
