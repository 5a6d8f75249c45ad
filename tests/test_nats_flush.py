"""`connection.flush`: once it returns, the server has every subscription made before it (nats-py's alone does not)."""

from __future__ import annotations

import asyncio
import secrets

import nats

from iop.nats import connection
from iop.nats.server import EmbeddedNats


async def test_connection_flush_means_the_server_has_the_subscription(nats_server: EmbeddedNats) -> None:
    publisher = await nats.connect(nats_server.url)
    missed = 0
    try:
        # nats-py's flush() missed the first message in ~5 % of such tries: 80 make a miss all but certain.
        for _ in range(80):
            subscriber = await nats.connect(nats_server.url)
            got = asyncio.Event()

            async def on_message(msg: object, got: asyncio.Event = got) -> None:
                got.set()

            subject = "t." + secrets.token_hex(4)
            await subscriber.subscribe(subject, cb=on_message)
            await connection.flush(subscriber)
            await publisher.publish(subject, b"first")
            await connection.flush(publisher)
            try:
                async with asyncio.timeout(2):
                    await got.wait()
            except TimeoutError:
                missed += 1
            await subscriber.close()
    finally:
        await publisher.close()
    assert missed == 0
