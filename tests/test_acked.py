"""Publishes acked on the publisher's own inbox (iop/nats/acked.py) behave as nats-py's JetStream publish."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js import api as js_api

from iop.nats import connection
from iop.nats.acked import AckedPublishes
from iop.nats.server import EmbeddedNats


async def test_acked_publishes_give_the_revision_and_nats_py_s_errors(nats_server: EmbeddedNats) -> None:
    nc = await connection.connect(nats_server.url, "test-acked")
    try:
        kv = await nc.jetstream().create_key_value(js_api.KeyValueConfig(bucket="acked", history=1))
        acked = AckedPublishes(nc, timeout_s=2.0)
        await acked.start()
        first = await acked.publish("$KV.acked.k", b"one")
        assert (await kv.get("k")).revision == first and (await kv.get("k")).value == b"one"
        last = js_api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value
        second = await acked.publish("$KV.acked.k", b"two", {last: str(first)})
        assert second > first and (await kv.get("k")).value == b"two"
        with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
            await acked.publish("$KV.acked.k", b"three", {last: str(first)})  # another writer came first
        assert (await kv.get("k")).value == b"two"
        with pytest.raises(nats.errors.NoRespondersError):
            await acked.publish("no.stream.stores.this", b"x")
        # Something listens but no stream answers: the wait ends at the timeout, as nats-py's.
        await nc.subscribe("silent.listener", cb=_ignore)
        slow = AckedPublishes(nc, timeout_s=0.2)
        await slow.start()
        with pytest.raises(nats.errors.TimeoutError):
            await slow.publish("silent.listener", b"x")
        assert acked.waiting == 0 and slow.waiting == 0  # every wait ended, none left behind
    finally:
        await nc.close()


async def test_publishes_sent_together_give_their_revisions_in_order_and_the_first_refusal(
    nats_server: EmbeddedNats,
) -> None:
    nc = await connection.connect(nats_server.url, "test-acked-many")
    stray: list[dict[str, Any]] = []  # "Future exception was never retrieved" goes to the loop's handler
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: stray.append(context))
    try:
        kv = await nc.jetstream().create_key_value(js_api.KeyValueConfig(bucket="many", history=1))
        acked = AckedPublishes(nc, timeout_s=2.0)
        await acked.start()
        seqs = await acked.publish_many([(f"$KV.many.k{n}", [b"v", b"%d" % n]) for n in range(5)])
        for n, seq in enumerate(seqs):
            entry = await kv.get(f"k{n}")
            assert (entry.revision, entry.value) == (seq, b"v%d" % n)
        assert seqs == sorted(seqs) and len(set(seqs)) == 5
        with pytest.raises(nats.errors.NoRespondersError):  # one of them stored nowhere
            await acked.publish_many([("$KV.many.k9", [b"x"]), ("no.stream.stores.this", [b"x"])])
        assert (await kv.get("k9")).value == b"x"  # the others are written all the same
        await nc.subscribe("silent.listener", cb=_ignore)
        slow = AckedPublishes(nc, timeout_s=0.2)
        await slow.start()
        with pytest.raises(nats.errors.TimeoutError):  # an answer missing: the wait ends at the timeout
            await slow.publish_many([("silent.listener", [b"x"]), ("silent.listener", [b"y"])])
        with pytest.raises(TimeoutError):  # cancelled from outside before its own timer (its client left)
            async with asyncio.timeout(0.05):
                await slow.publish_many([("silent.listener", [b"z"])] * 2)
        assert acked.waiting == 0 and slow.waiting == 0
        gc.collect()
        assert not stray  # no failed wait behind the first, nor a cancelled one, left unread
    finally:
        asyncio.get_running_loop().set_exception_handler(None)
        await nc.close()


async def _ignore(msg: Msg) -> None:
    pass
